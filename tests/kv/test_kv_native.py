"""The compiled decode attention (lowbit.kv.native, packed_attention.c): every page format it
reads decodes to the torch dequantization bit for bit, its scores and weighted sums match torch
on the same stored bits, a model's decode steps take it, and without a compiler lowbit falls
back to the torch path."""

import copy
import ctypes
import shutil
import sys

import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.kv import cache as kv_cache
from lowbit.kv import decode, native, page_descriptors
from lowbit.kv.attention import _rope
from lowbit.kv.int_quant import IntChannelQuantizer, IntTokenQuantizer
from lowbit.kv.kivi import KIVIKeyQuantizer, KIVIValueQuantizer
from lowbit.kv.kvquant import KVQuantQuantizer
from lowbit.kv.quantizer import PackedKV
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

B, H, T, D = 2, 3, 40, 48  # T and D not powers of two; D even so rotate-half pairs


def _kvquant(**settings):
    q = KVQuantQuantizer(num_heads=H, head_dim=D, **settings)
    g = torch.Generator().manual_seed(3)
    if q.per_channel:  # calibrated-looking ranges and codebooks, not the defaults
        q.center.copy_(torch.randn(H, D, generator=g) * 0.3)
        q.half_range.copy_(torch.rand(H, D, generator=g) + 0.5)
    levels = torch.sort(torch.rand(q.codebook.shape, generator=g) * 2 - 1, dim=-1).values
    q.codebook.copy_(levels)
    return q


QUANTIZERS = {
    "int4 token": lambda: IntTokenQuantizer(4),
    "int4 token g16": lambda: IntTokenQuantizer(4, group_size=16),
    "int3 token": lambda: IntTokenQuantizer(3, group_size=24),
    "int2 symmetric": lambda: IntTokenQuantizer(2, symmetric=True),
    "int8 token": lambda: IntTokenQuantizer(8),
    "int5 fp16 min": lambda: IntTokenQuantizer(5, group_size=16, zero="fp16"),
    "int4 channel": lambda: IntChannelQuantizer(4, token_group=8),
    "int2 channel fp16 min": lambda: IntChannelQuantizer(2, token_group=8, zero="fp16"),
    "int3 channel": lambda: IntChannelQuantizer(3, token_group=8),
    "kvquant3 token outliers": lambda: _kvquant(bits=3, outlier_fraction=0.05),
    "kvquant4 rotated": lambda: _kvquant(bits=4, outlier_fraction=0.02, rotate=True),
    "kvquant3 channel codebooks": lambda: _kvquant(
        bits=3, per_channel=True, channel_codebooks=True, outlier_fraction=0.05
    ),
    "kvquant2 channel": lambda: _kvquant(bits=2, per_channel=True, outlier_fraction=0.0),
    # KVQuant's keys: 4 bits, per-channel ranges, outliers beyond them (the fused 4-bit tiles)
    "kvquant4 channel": lambda: _kvquant(bits=4, per_channel=True, outlier_fraction=0.01),
    # and 3 bits (fused at head dims of whole 64s)
    "kvquant3 channel": lambda: _kvquant(bits=3, per_channel=True, outlier_fraction=0.03),
    "int3 token whole rows": lambda: IntTokenQuantizer(3),
}


def _pages(name: str, dim: int = D) -> list[PackedKV]:
    """Two pages of one stream (24 and 16 tokens), quantized from heavy-tailed data."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, H, T, dim, generator=g) * torch.rand(1, 1, T, dim, generator=g) * 3
    q = QUANTIZERS[name]()
    return [q.quantize(x[:, :, :24]), q.quantize(x[:, :, 24:])]


def _stored(pages: list[PackedKV]) -> torch.Tensor:
    """The pages in their stored basis (a rotated format is not rotated back), [B, H, T, D]."""
    parts = [
        p.dequantize(torch.float32, rotate_back=False) if p.rotation is not None
        else p.dequantize(torch.float32)
        for p in pages
    ]  # fmt: skip
    return torch.cat(parts, 2)


def _call(fn, pages, *args):
    described = [page_descriptors.page_descriptor(p) for p in pages]
    assert all(d is not None for d in described)
    firsts = [sum(p.num_tokens for p in pages[:i]) for i in range(len(pages))]
    descs, starts = page_descriptors.page_array([d for d, _ in described], firsts)
    status = fn(descs, starts, len(pages), *args)
    assert status == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_decoded_values_equal_torch_bit_for_bit(name, threads):
    """acc += p v with p one-hot on token t gives the decoded value of token t exactly."""
    _check_decoded(_pages(name), D, threads)


@pytest.mark.parametrize("bits", [3, 5, 7])
def test_decoded_rows_of_codes_not_a_whole_8(bits, monkeypatch):
    """A row whose codes end inside a byte run (20 channels of 3, 5 or 7 bits)."""
    monkeypatch.setitem(QUANTIZERS, "odd", lambda: IntTokenQuantizer(bits, group_size=10))
    _check_decoded(_pages("odd", dim=20), 20, 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["int4 token", "kvquant3 token outliers", "kvquant4 rotated",
                                  "kvquant2 channel", "kvquant4 channel"])  # fmt: skip
def test_decoded_values_of_a_long_page(name, threads):
    """A page of 150 tokens: runs of tiles decoded together (9 tiles and a tail of 6; with two
    threads each thread's share), decoded exactly, and their weighted sums as torch's."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(B, H, 150, D, generator=g) * torch.rand(1, 1, 150, D, generator=g) * 3
    pages = [QUANTIZERS[name]().quantize(x)]
    _check_decoded(pages, D, threads)
    p = torch.softmax(torch.randn(B, H, 5, 150, generator=g) * 3, -1)
    acc = torch.zeros(B, H, 5, D)
    _call(native.library().lb_accumulate, pages, p.data_ptr(), 5, 150, acc.data_ptr(), threads)
    want = p @ _stored(pages)
    # float32 sums in another order: measured max |difference| 2.4e-6 on sums of magnitude up to 6.6
    assert (acc - want).abs().max() < 1e-5


def _check_decoded(pages: list[PackedKV], dim: int, threads: int) -> None:
    lib = native.library()
    want = _stored(pages)  # [B, H, T, dim]
    total = want.shape[2]
    for first in range(0, total, 20):  # 20 query rows, each picking one token
        tokens = torch.arange(first, min(first + 20, total))
        p = torch.zeros(B, H, len(tokens), total)
        p[:, :, torch.arange(len(tokens)), tokens] = 1.0
        acc = torch.zeros(B, H, len(tokens), dim)
        _call(lib.lb_accumulate, pages, p.data_ptr(), len(tokens), total, acc.data_ptr(), threads)
        assert torch.equal(acc, want[:, :, tokens])


# pre-RoPE keys: their positions, and whether the kernels get the cos/sin tables in blocks of
# 16 positions (16-token tiles then rotate a channel of the tile at once: loads for
# consecutive positions, gathers for others; without them every row is rotated on its own)
ROPES = [
    None,
    "random, rows",
    "random, blocks",
    "consecutive, blocks",
    "consecutive, blocks of unequal halves",
]


@pytest.mark.parametrize("pre_rope", ROPES)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_scores_and_sums_match_torch(name, pre_rope):
    lib = native.library()
    pages = _pages(name, D)
    keys = _stored(pages)  # [B, H, T, D]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 5, D, generator=g)  # 5 query heads per KV head: 4 at once, then 1
    rope = None
    if pre_rope:
        if pre_rope.startswith("random"):
            positions = torch.randint(0, 500, (B, T), generator=g, dtype=torch.int32)
        else:  # batch row 1 starts later, as after left padding
            positions = (torch.arange(T) + torch.tensor([[0], [7]])).to(torch.int32)
        freq = torch.rand(D // 2, generator=g)
        angle = torch.arange(500)[:, None].float() * torch.cat([freq, freq])[None]  # [P, D]
        if pre_rope.endswith("unequal halves"):  # not rotate-half's tables: blocks of every channel
            angle[:, D // 2 :] *= 1.5
        cos, sin = angle.cos(), angle.sin()
        cos_b, sin_b = native.rope_blocks(cos, sin)
        assert cos_b.shape[1] == (D if pre_rope.endswith("unequal halves") else D // 2)
        rope = native.Rope(cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), T)
        if "blocks" in pre_rope:
            rope.cos_blocks, rope.sin_blocks = cos_b.data_ptr(), sin_b.data_ptr()
            rope.block_channels = cos_b.shape[1]
        keys = _rope(keys, cos[positions.long()], sin[positions.long()])
    scores = torch.empty(B, H, 5, T)
    _call(lib.lb_scores, pages, None if rope is None else ctypes.byref(rope), q.data_ptr(), 5,
          scores.data_ptr(), T, 0.125, 2)  # fmt: skip
    want = q @ keys.transpose(2, 3) * 0.125
    # float32 sums in another order (the 4-bit integer road factors the scale out of the sum):
    # measured max |difference| 2.9e-6 on scores of magnitude ~10
    assert (scores - want).abs().max() < 1e-4 * want.abs().max()
    p = torch.softmax(want, -1)
    acc = torch.zeros(B, H, 5, D)
    _call(lib.lb_accumulate, pages, p.data_ptr(), 5, T, acc.data_ptr(), 2)
    expected = p @ keys if not pre_rope else p @ _stored(pages)
    assert (acc - expected).abs().max() < 1e-5 * expected.abs().max() + 1e-6


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(
    "name",
    ["int4 token", "int2 symmetric", "kvquant4 rotated", "kvquant4 channel",
     "kvquant3 token outliers", "kvquant3 channel", "int3 token whole rows"],
)  # fmt: skip
def test_rows_of_whole_8_code_words(name, dim, monkeypatch):
    """Rows of a multiple of 8 code words (64 or 128 channels of 4 bits, 128 of 2), whose tiles
    are transposed by shuffles rather than gathers, and 3-bit rows of whole 64 channels (fused
    tiles, codes crossing words): decoded exactly, scored as torch."""
    monkeypatch.setattr(sys.modules[__name__], "D", dim)
    _check_decoded(_pages(name, dim), dim, 2)
    test_scores_and_sums_match_torch(name, "consecutive, blocks")


@pytest.mark.parametrize("dim", [48, 64])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_pages_in_tiles(bits, dim):
    """KIVI's keys (per channel over 32-token groups: value tables built a group at a time) and
    values (per token in groups of 16 channels) read in 16-token tiles: decoded exactly, and
    scores and weighted sums as torch's."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(B, H, 96, dim, generator=g) * torch.rand(1, 1, 96, dim, generator=g) * 3
    for quantizer in (KIVIKeyQuantizer(bits, 32), KIVIValueQuantizer(bits, 16)):
        pages = [quantizer.quantize(x[:, :, :64]), quantizer.quantize(x[:, :, 64:])]
        _check_decoded(pages, dim, 2)
        stored = _stored(pages)
        q = torch.randn(B, H, 3, dim, generator=g)
        scores = torch.empty(B, H, 3, 96)
        _call(native.library().lb_scores, pages, None, q.data_ptr(), 3, scores.data_ptr(), 96,
              0.125, 2)  # fmt: skip
        want = q @ stored.transpose(2, 3) * 0.125
        # float32 sums in another order: measured max |difference| 0 on scores up to 7.7
        assert (scores - want).abs().max() < 1e-5 * want.abs().max()
        p = torch.softmax(want, -1)
        acc = torch.zeros(B, H, 3, dim)
        _call(native.library().lb_accumulate, pages, p.data_ptr(), 3, 96, acc.data_ptr(), 2)
        expected = p @ stored
        # measured max |difference| 1.9e-6 on sums up to 4.8
        assert (acc - expected).abs().max() < 1e-5 * expected.abs().max() + 1e-6


@pytest.mark.parametrize("mask", [None, "float", "bool"])
@pytest.mark.parametrize("fp_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_call_attention_equals_torch_path(monkeypatch, fp_dtype, mask):
    """lb_attend (a layer's whole decode attention in one call) against the chunked torch path on
    the same cache: fp sinks and an fp window in each dtype beside packed pages, values stored in
    a rotated basis, 5 query heads a KV head, and masks that hide some slots of one batch row
    and every slot of another."""
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", 8)  # many pages, one of them open
    layer = kv_cache.QuantizedKVLayer(
        QUANTIZERS["kvquant3 token outliers"](), QUANTIZERS["kvquant4 rotated"](),
        sink_tokens=2, fp_window=5, residual_dtype=fp_dtype,
    )  # fmt: skip
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, H, T + 1, D, 2, generator=g) * 2
    layer.store(x[:, :, :T, :, 0], x[:, :, :T, :, 1])  # the prefill
    layer.store(x[:, :, T:, :, 0], x[:, :, T:, :, 1])  # the step's token
    q = torch.randn(3, H * 5, 1, D, generator=g)
    full = None
    if mask is not None:
        allowed = torch.ones(3, 1, 1, T + 1, dtype=torch.bool)
        allowed[1, ..., 3:17] = False
        allowed[2] = False  # a row that may see nothing: zeros
        full = (
            allowed
            if mask == "bool"
            else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        )
    got = decode.compiled_decode_attention(q, layer, scaling=0.125, mask=full)
    want = decode.chunked_attention(q, layer, scaling=0.125, mask=full, max_tokens=8)
    assert got is not None and got.shape == (3, 1, H * 5, D)
    # float32 sums in another order (and lb_exp): measured max |difference| 3.1e-6 on outputs
    # of magnitude up to 4.8
    assert (got - want).abs().max() < 1e-5
    if mask is not None:
        assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_one_call_attention_split_between_threads(monkeypatch):
    """lb_attend's parts (one a thread, each with its own softmax maximum and sum, merged at the
    end) on a cache long enough to split: 3 threads equal the torch path, and equal 1 thread
    within rounding, with a part's slots all masked in one batch row and a part boundary inside
    a page."""
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", 64)
    n = 1000  # three parts of at least 256 slots: boundaries near 333 and 666, inside pages
    layer = kv_cache.QuantizedKVLayer(
        QUANTIZERS["kvquant4 channel"](), QUANTIZERS["kvquant4 rotated"](), sink_tokens=1,
        fp_window=3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, H, n, D, 2, generator=g) * 2
    layer.store(x[:, :, :-1, :, 0], x[:, :, :-1, :, 1])
    layer.store(x[:, :, -1:, :, 0], x[:, :, -1:, :, 1])
    q = torch.randn(2, H * 4, 1, D, generator=g)
    allowed = torch.ones(2, 1, 1, n, dtype=torch.bool)
    allowed[1, ..., 300:700] = False  # the middle part of row 1 sees nothing
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        got = decode.compiled_decode_attention(q, layer, scaling=0.125, mask=allowed)
        torch.set_num_threads(1)
        one = decode.compiled_decode_attention(q, layer, scaling=0.125, mask=allowed)
    finally:
        torch.set_num_threads(threads)
    want = decode.chunked_attention(q, layer, scaling=0.125, mask=allowed, max_tokens=64)
    assert got is not None and one is not None
    # float32 sums in another order and the parts' merge: measured max |difference| 1.1e-6 against
    # torch and 3.0e-7 between the thread counts, on outputs of magnitude up to 1.5
    assert (got - want).abs().max() < 1e-5
    assert (got - one).abs().max() < 1e-5
    assert not torch.equal(got, one)  # the parts really were merged (3 threads, not 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_call_attention_reads_and_writes_the_models_dtype(monkeypatch, dtype):
    """A half-precision model's query goes to the library as it is and the output comes back in
    its dtype: equal, bit for bit, to the float32 call's output rounded by torch."""
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", 8)
    layer = kv_cache.QuantizedKVLayer(
        QUANTIZERS["kvquant4 channel"](), QUANTIZERS["kvquant4 rotated"](), sink_tokens=1
    )
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, H, 30, D, 2, generator=g) * 2
    layer.store(x[..., 0], x[..., 1])
    q = torch.randn(2, H * 2, 1, D, generator=g).to(dtype)
    got = decode.compiled_decode_attention(q, layer, scaling=0.125)
    want = decode.compiled_decode_attention(q.float(), layer, scaling=0.125)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_a_decode_steps_query_is_rotated_by_the_library_as_by_torch(monkeypatch):
    """A pre-RoPE cache's decode step hands the library its query unrotated: rotated there at the
    step's position, it gives the attention of the query rotated by torch, bit for bit."""
    model = tiny_model("llama", head_dim=32)
    quantize(model, get_recipe("kvquant", bits=4), calibration=CALIB, progress=False)
    original = decode.compiled_decode_attention
    compared = []

    def both(q, layer, **kwargs):
        out = original(q, layer, **kwargs)
        rotate = kwargs.pop("query_rope")
        assert rotate is not None  # pre-RoPE keys: the query comes unrotated
        compared.append(torch.equal(out, original(rotate(q), layer, **kwargs)))
        return out

    monkeypatch.setattr(decode, "compiled_decode_attention", both)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    cache = model.lowbit_make_cache()
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache)
        for t in range(20, 24):
            model(ids[:, t : t + 1], past_key_values=cache)
    assert compared and all(compared)


@pytest.mark.parametrize("key, value", [("kvquant4 channel", "kvquant4 rotated"),
                                        ("int4 token", "int4 token g16")])  # fmt: skip
def test_decode_streams_kept_between_steps_equal_ones_built_anew(monkeypatch, key, value):
    """A layer's library structures are kept from step to step (the open page's token count
    updated in place) and built anew only when a page closes: each step's attention equals, bit
    for bit, that of structures built from nothing, across pages that close and outliers whose
    room moves."""
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", 8)
    layer = kv_cache.QuantizedKVLayer(QUANTIZERS[key](), QUANTIZERS[value](), sink_tokens=1)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, H, 40, D, 2, generator=g) * 3
    layer.store(x[:, :, :5, :, 0], x[:, :, :5, :, 1])
    q = torch.randn(1, H * 5, 1, D, generator=g)
    kept = rebuilt = 0
    for t in range(5, 40):
        layer.store(x[:, :, t : t + 1, :, 0], x[:, :, t : t + 1, :, 1])
        before = layer.decode_streams.get("k")
        got = decode.compiled_decode_attention(q, layer, scaling=0.125)
        after = layer.decode_streams["k"]
        kept, rebuilt = (kept + 1, rebuilt) if after is before else (kept, rebuilt + 1)
        layer.decode_streams.clear()
        assert torch.equal(got, decode.compiled_decode_attention(q, layer, scaling=0.125)), t
    # rebuilt when a page closes (every 8 tokens) or an outliers' room moves: measured 16 of 35
    assert kept >= 15 and rebuilt >= 5


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(), reason="no AVX-512")
def test_avx512_builds_take_16_token_tiles():
    """Codebook pages of at most 4 bits are read 16 tokens at a time where the CPU has AVX-512
    (the tests above then cover the tiles: pages of 24 and 16 tokens, a tile and a tail)."""
    assert native.library().lb_tile_width() == 16


def test_formats_it_cannot_read_are_refused_not_misread():
    from lowbit.kv.bfp_quant import BFPKVQuantizer

    page = BFPKVQuantizer(num_heads=2, head_dim=64).quantize(torch.randn(1, 2, 8, 64))
    assert page_descriptors.page_descriptor(page) is None


def test_a_page_is_described_once_while_it_lives():
    """A decode step describes only pages it has not seen: the same page object gets the same
    descriptor, a joined page (a new object) a new one, and a dropped page's entry goes."""
    quantizer = KVQuantQuantizer(num_heads=2, head_dim=64, bits=3, per_channel=True)
    first = quantizer.quantize(torch.randn(1, 2, 8, 64))
    described = page_descriptors.page_descriptor(first)
    assert page_descriptors.page_descriptor(first)[0] is described[0]
    joined = type(first).concat([first, quantizer.quantize(torch.randn(1, 2, 4, 64))])
    assert page_descriptors.page_descriptor(joined)[0] is not described[0]
    assert page_descriptors.page_descriptor(joined)[0].tokens == 12
    key = id(joined)
    del joined
    assert key not in page_descriptors._described


def test_an_open_pages_descriptor_is_its_rooms_with_its_tokens():
    """Pages written into one room share the room's descriptor, copied with their token count:
    byte for byte what describing each page anew gives, as the first outliers come and the
    outliers' room doubles."""
    quantizer = KVQUANT_STORES["kvquant4 channel outliers"]()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, H, 40, D, generator=g) * 0.1  # inside the channel ranges: no outliers
    x[0, 1, 6:, 5] = 100.0  # from token 6 on, one outlier a token
    x[0, :, 20:] *= 40  # and from token 20 on, many
    page = quantizer.quantize(x[:, :, :1])
    for t in range(1, 40):
        page = quantizer.extend(page, x[:, :, t : t + 1], 64)
        got = page_descriptors.page_descriptor(page)[0]
        assert bytes(got) == bytes(page_descriptors._describe(page)[0]), t
    assert page.room is not None and page.col_val.numel() > 64  # the outliers' room grew


CALIB = torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(5))


def _count_compiled_steps(monkeypatch) -> list[bool]:
    """Whether each call of compiled_decode_attention from now on took the compiled path."""
    taken = []
    original = decode.compiled_decode_attention

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(decode, "compiled_decode_attention", counted)
    return taken


@pytest.mark.parametrize(
    "method, settings, compiled",
    [
        ("kv-int", {"bits": 4}, True),
        ("kv-int", {"bits": 3, "pre_rope": True, "per_channel_keys": True, "key_token_group": 8}, True),
        ("kivi", {"bits": 2, "group": 8, "residual": 16}, True),
        ("kvquant", {"bits": 3, "calib_tokens": 128}, True),
        ("ksort-bfp", {}, False),
    ],
)  # fmt: skip
def test_decode_steps_take_the_compiled_path(monkeypatch, method, settings, compiled):
    recipe = get_recipe(method, **settings)
    model = tiny_model("llama", head_dim=32)
    calibration = CALIB if recipe.needs_calibration else None
    quantize(model, recipe, calibration=calibration, progress=False)
    taken = _count_compiled_steps(monkeypatch)
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = model.lowbit_make_cache()
    with torch.no_grad():
        model(ids[:, :27], past_key_values=cache)  # prefill: the torch path, never asked
        assert taken == []
        for t in range(27, 30):
            model(ids[:, t : t + 1], past_key_values=cache)
    layers = model.config.num_hidden_layers
    assert taken == [compiled] * (3 * layers)


def test_fp_keys_are_rotated_by_the_library(monkeypatch):
    """KVQuant's fp16 sink tokens (4 here, at positions 0-3): their pre-RoPE keys are rotated by
    the library at their positions at every step (no torch rotation on the compiled path), with
    the scores of the torch path, which rotates them in torch."""
    model = tiny_model("llama", head_dim=32)
    recipe = get_recipe("kvquant", bits=4, sink_tokens=4)
    quantize(model, recipe, calibration=CALIB, progress=False)
    calls = []
    real = decode._rotated_fp_keys
    monkeypatch.setattr(decode, "_rotated_fp_keys", lambda *a: calls.append(a[1]) or real(*a))
    taken = _count_compiled_steps(monkeypatch)
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    cache, reference = model.lowbit_make_cache(), model.lowbit_make_cache()
    with torch.no_grad():
        model(ids[:, :27], past_key_values=cache)
        outs = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(27, 30)]
        for layer in model.model.layers:
            layer.self_attn.packed_attention = (
                False  # the reference: every key dequantized, rotated
            )
        model(ids[:, :27], past_key_values=reference)
        want = [model(ids[:, t : t + 1], past_key_values=reference).logits for t in range(27, 30)]
    assert taken and all(taken) and calls == []
    for got, expected in zip(outs, want, strict=True):
        # measured max |difference| 2.1e-7 on logits up to 1.0 (the sums in another order)
        assert (got - expected).abs().max() < 1e-5


def test_the_fp_residual_grows_in_place_and_its_structures_are_kept():
    """A window of fp tokens (KIVI's residual) grows in its buffer from step to step: an earlier
    view of it never changes, the library's structures are kept while no token leaves the
    window (described anew when a group does), and every step's attention equals torch's."""
    layer = kv_cache.QuantizedKVLayer(
        QUANTIZERS["int4 channel"](), QUANTIZERS["int4 token"](), sink_tokens=1, fp_window=8
    )
    g = torch.Generator().manual_seed(10)
    x = torch.randn(1, H, 60, D, 2, generator=g) * 2
    layer.store(x[:, :, :20, :, 0], x[:, :, :20, :, 1])
    q = torch.randn(1, H * 2, 1, D, generator=g)
    kept = rebuilt = 0
    for t in range(20, 60):
        earlier = layer.k.residual
        saved = earlier.clone()
        layer.store(x[:, :, t : t + 1, :, 0], x[:, :, t : t + 1, :, 1])
        assert torch.equal(earlier, saved)  # written past its end only
        before = layer.decode_streams.get("k")
        got = decode.compiled_decode_attention(q, layer, scaling=0.125)
        kept, rebuilt = (
            (kept + 1, rebuilt) if layer.decode_streams["k"] is before else (kept, rebuilt + 1)
        )
        want = decode.chunked_attention(q, layer, scaling=0.125, max_tokens=8)
        # float32 sums in another order: measured max |difference| 1.9e-6 on outputs up to 4.6
        assert (got - want).abs().max() < 1e-5, t
    # the keys' residual loses a group of 8 every 8 steps (rebuilt then, and once when the
    # prompt's buffer is traded for a small one): measured 33 kept, 7 rebuilt (the residual
    # copied every step before: 0 kept)
    assert kept >= 30 and rebuilt >= 4


def test_a_negative_position_keeps_the_step_on_the_torch_path(monkeypatch):
    """The kernels read cos/sin tables by position: a negative one is left to torch."""
    model = tiny_model("llama", head_dim=32)
    quantize(model, get_recipe("kvquant", bits=4), calibration=CALIB, progress=False)
    taken = _count_compiled_steps(monkeypatch)
    ids = torch.randint(3, 256, (1, 21), generator=torch.Generator().manual_seed(2))
    cache = model.lowbit_make_cache()
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache)
        model(ids[:, 20:], past_key_values=cache)
        assert taken and all(taken)
        taken.clear()
        cache.layers[0].track.positions[0, 5] = -1
        model(ids[:, 20:], past_key_values=cache)
    assert taken and not any(taken)


def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    native.library.cache_clear()
    try:
        assert native.library() is None
        model = quantize(
            tiny_model("llama", head_dim=32), get_recipe("kv-int", bits=4), progress=False
        )
        cache = model.lowbit_make_cache()
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]), past_key_values=cache)
            logits = model(torch.tensor([[8]]), past_key_values=cache).logits
        assert torch.isfinite(logits).all()
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))
    finally:
        native.library.cache_clear()


@pytest.mark.slow
def test_compiled_decode_on_embedded_at_2k(embedded, wikitext_path, monkeypatch):
    """The real model, a 2,048-token WikiText-2 prefix in a KVQuant 3-bit cache (pre-RoPE keys
    with outliers, rotated values, an fp16 sink): in each of three decode steps (one filling the
    last page by a join, one opening a page, one joining it) every layer's compiled attention
    equals the torch path's on the same cache.

    Compared layer by layer, not by logits: a step's stored codes depend on its hidden states,
    so a 1e-6 difference in one layer's attention can flip a later layer's key outlier of the
    new token (seen with one thread: logits then differed by 0.135, both paths right)."""
    from lowbit.data import load_corpus, tokenize

    tokens = tokenize(embedded.tokenizer, load_corpus(str(wikitext_path)).text[:20000])
    assert tokens.numel() > 2051 + 512
    calibration = tokens[-256:].view(1, 256)  # past the prompt
    model = copy.deepcopy(embedded.model)
    recipe = get_recipe("kvquant", bits=3, calib_tokens=256, outlier_allocation="even")
    quantize(model, recipe, calibration=calibration, progress=False)
    compiled_attention = decode.compiled_decode_attention
    differences = []

    def both_paths(q, layer, **kwargs):
        out = compiled_attention(q, layer, **kwargs)  # [B, 1, H_q, D]
        assert out is not None  # every page of this cache is one the kernels read
        torch_path = decode.chunked_attention(q, layer, max_tokens=kv_cache.PAGE_TOKENS, **kwargs)
        differences.append((out - torch_path).abs().max().item())
        return out

    monkeypatch.setattr(decode, "compiled_decode_attention", both_paths)
    prompt, steps = tokens[None, :2048], tokens[None, 2048:2051]
    cache = model.lowbit_make_cache()
    with torch.no_grad():
        for lo in range(0, 2048, 1024):
            model(prompt[:, lo : lo + 1024], past_key_values=cache, logits_to_keep=1)
        for i in range(3):
            model(steps[:, i : i + 1], past_key_values=cache)
    assert len(differences) == 3 * 30
    # float32 sums in another order over 2,049-2,051 tokens: measured max 3.6e-6 (one thread)
    # on attention outputs of magnitude 0.3-5.5
    assert max(differences) < 1e-4


@pytest.mark.parametrize("zero", ["int", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits, group, clip", [(4, None, 1.0), (4, 16, 0.95), (3, 24, 1.0),
                                               (2, 8, 0.9), (8, None, 1.0), (5, 48, 0.95)])  # fmt: skip
def test_compiled_store_equals_torch_quantizer(monkeypatch, bits, group, clip, dtype, zero):
    """The decode step's store of per-token integer codes, with integer zero points (kv-int)
    or fp16 minimums (KIVI's values): compiled and torch, bit for bit."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(B, H, T, D, generator=g) * torch.rand(1, 1, T, D, generator=g) * 4
    x[0, 0, 0] = 0.0  # an all-zero token: scale 1
    x[0, 1, 1] = 1e-3  # a constant one
    x[1, 2, 2] = -torch.rand(D, generator=g)  # all negative: zero point at the top
    x = x.to(dtype)
    quantizer = IntTokenQuantizer(bits, group_size=group, clip_ratio=clip, zero=zero)
    compiled = quantizer.quantize(x)
    minimum = zero == "fp16"
    assert native.quantize_int_tokens(x, bits, group or D, clip, minimum) is not None  # it ran
    monkeypatch.setattr(native, "library", lambda: None)
    reference = quantizer.quantize(x)
    assert reference.stored_tensors().keys() == compiled.stored_tensors().keys()
    for name, tensor in reference.stored_tensors().items():
        assert torch.equal(compiled.stored_tensors()[name], tensor), name
    assert native.quantize_int_tokens(x, bits, group or D, clip, minimum) is None


def test_compiled_store_leaves_non_finite_input_to_torch():
    x = torch.randn(1, 2, 3, D)
    x[0, 1, 2, 5] = float("nan")
    assert native.quantize_int_tokens(x, 4, D, 1.0) is None


KVQUANT_STORES = {
    **{name: QUANTIZERS[name] for name in QUANTIZERS if name.startswith("kvquant")},
    "kvquant8 token": lambda: _kvquant(bits=8, outlier_fraction=0.01),
    "kvquant4 channel outliers": lambda: _kvquant(bits=4, per_channel=True, outlier_fraction=0.1),
    "kvquant2 token no outliers": lambda: _kvquant(bits=2, outlier_fraction=0.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, T])
@pytest.mark.parametrize("name", list(KVQUANT_STORES))
def test_compiled_kvquant_store_equals_torch_quantizer(monkeypatch, name, tokens, dtype):
    """KVQuant's store (outliers, ranges, nearest levels, CSR): compiled and torch, bit for bit
    (bfloat16 data has equal magnitudes within a token: both take the lower channel first)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, H, tokens, D, generator=g) * torch.rand(1, 1, tokens, D, generator=g) * 4
    x[0, 1, 0] = 0.25  # a constant head vector: a zero half range is stored as 1
    x = x.to(dtype)
    quantizer = KVQUANT_STORES[name]()
    compiled = quantizer.quantize(x)
    xf = x.float() @ quantizer.rotation.float() if quantizer.rotate else x.float()
    assert native.quantize_kvquant_tokens(xf, quantizer) is not None  # it ran
    monkeypatch.setattr(native, "library", lambda: None)
    reference = quantizer.quantize(x)
    assert reference.col_val.numel() > 0 or quantizer.outlier_fraction == 0
    for field, tensor in reference.stored_tensors().items():
        assert torch.equal(compiled.stored_tensors()[field], tensor), field


#: formats whose open page is written in place: KVQuant's room (CSR outliers) and the per-token
#: integer formats' TokenRoom
ROOM_FORMATS = {
    **KVQUANT_STORES,
    **{name: QUANTIZERS[name] for name in QUANTIZERS if name.startswith("int") and "token" in name},
    "int2 symmetric": QUANTIZERS["int2 symmetric"],
    "int5 fp16 min": QUANTIZERS["int5 fp16 min"],
}


@pytest.mark.parametrize("name", list(ROOM_FORMATS))
def test_page_extended_in_place_equals_one_quantized_run(name):
    """A decode step's open page: tokens written in place into the page's room (outliers' room
    doubled as it fills) give the same stored bits as quantizing every token at once; the pages
    of earlier steps keep their bits; extending one of them (a stale view) copies it first, and
    a page at its capacity is joined instead."""
    quantizer = ROOM_FORMATS[name]()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, H, 30, D, generator=g) * torch.rand(1, 1, 30, D, generator=g) * 4
    page = quantizer.quantize(x[:, :, :3])
    pages = {3: page}
    for t in list(range(3, 20)) + list(range(20, 30, 2)):  # one token a step, then two
        step = 1 if t < 20 else 2
        page = quantizer.extend(page, x[:, :, t : t + step], 32)
        pages[t + step] = page
    assert page.room is not None and page.room.tokens == 30  # written in place

    def assert_stores(got, tokens):
        want = quantizer.quantize(tokens)
        for field, tensor in want.stored_tensors().items():
            assert torch.equal(got.stored_tensors()[field], tensor), field

    assert_stores(page, x)
    assert_stores(pages[8], x[:, :, :8])  # an earlier step's page, unchanged
    # and described as anew: the room's descriptor with the page's tokens
    got, want = page_descriptors.page_descriptor(pages[12]), page_descriptors._describe(pages[12])
    assert bytes(got[0]) == bytes(want[0])
    # a stale view: copied, not written over
    branch = quantizer.extend(pages[8], x[:, :, 25:26], 32)
    assert branch.room is not page.room
    assert_stores(branch, torch.cat([x[:, :, :8], x[:, :, 25:26]], 2))
    assert_stores(page, x)
    full = quantizer.extend(page, x[:, :, :3], 32)  # past the page's capacity: joined
    assert full.room is None
    assert_stores(full, torch.cat([x, x[:, :, :3]], 2))


def test_compiled_kvquant_store_leaves_what_fp16_cannot_hold_to_torch():
    quantizer = _kvquant(bits=4, outlier_fraction=0.05)
    x = torch.randn(1, H, 2, D)
    x[0, 2, 1, 7] = 1e6  # an outlier beyond fp16's range: torch's sentence
    assert native.quantize_kvquant_tokens(x, quantizer) is None
    with pytest.raises(LowbitError, match="fp16 range"):
        quantizer.quantize(x)
    x[0, 2, 1, 7] = float("nan")
    assert native.quantize_kvquant_tokens(x, quantizer) is None
