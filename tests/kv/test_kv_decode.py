"""Attention over the packed cache (lowbit.kv.decode): the same logits as the
dequantize-everything path on every cache kind and family (decode steps through the compiled
kernels where they read the format, prefill chunks and the rest in torch), pages instead of one
growing tensor, and a torch decode step that decodes one chunk at a time, never the whole
cache."""

import copy

import pytest
import torch

from lowbit.api import quantize
from lowbit.kv import cache as kv_cache
from lowbit.kv import decode, native
from lowbit.kv.attention import KVQuantAttention
from lowbit.kv.decode import RopeTable
from lowbit.kv.kvquant import KVQuantQuantizer
from lowbit.kv.quantizer import PackedKV
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
CALIB = torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(5))
RECIPES = {
    "kv-int 4": ("kv-int", {"bits": 4}),
    "quarot K3V2": ("kv-int", {"k_bits": 3, "v_bits": 2, "rotate_qk": "hadamard"}),
    "kv-int pre-RoPE channel keys, sinks": (
        "kv-int",
        {
            "bits": 3,
            "pre_rope": True,
            "per_channel_keys": True,
            "key_token_group": 8,
            "sink_tokens": 2,
        },
    ),  # fmt: skip
    "kivi": ("kivi", {"bits": 2, "group": 8, "residual": 16}),
    "kvquant 3": ("kvquant", {"bits": 3, "calib_tokens": 128}),
    "ksort-bfp": ("ksort-bfp", {}),
}
# fp32 logits, packed chunked attention vs the whole cache dequantized then sdpa; measured max
# |difference| over all cases and families: 1.4e-6 (summation order only: both read the same
# stored bits)
TOL = 1e-4


def _quantized(name, family):
    method, settings = RECIPES[name]
    recipe = get_recipe(method, **settings)
    model = tiny_model(family, head_dim=32)
    calibration = CALIB if recipe.needs_calibration else None
    return quantize(model, recipe, calibration=calibration, progress=False)


def _set_packed(model, packed: bool) -> None:
    for module in model.modules():
        if isinstance(module, KVQuantAttention):
            module.packed_attention = packed


def _run(model, ids, mask, prefill=(0, 13, 24)):
    """Real tokens' logits: a prefill in two chunks, then one token at a time."""
    cache = model.lowbit_make_cache()
    out = []
    with torch.no_grad():
        for lo, hi in zip(prefill, prefill[1:], strict=False):
            positions = (mask[:, :hi].cumsum(1) - 1)[:, lo:hi].clamp_min(0)
            out.append(
                model(
                    ids[:, lo:hi],
                    attention_mask=mask[:, :hi],
                    position_ids=positions,
                    past_key_values=cache,
                ).logits
            )
        for t in range(prefill[-1], ids.shape[1]):
            positions = (mask[:, : t + 1].cumsum(1) - 1)[:, -1:]
            step = model(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                position_ids=positions,
                past_key_values=cache,
            )
            out.append(step.logits)
    return torch.cat(out, 1)[mask.bool()], cache


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", 8)  # many pages and chunks on tiny inputs


@pytest.mark.parametrize("prefill", ["whole", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_packed_attention_equals_dequantized_path(small_pages, monkeypatch, name, family, prefill):
    """Prefill steps reading each layer's K/V whole (torch's fused attention) or, past
    ``DENSE_PREFILL_BYTES``, chunk by chunk; decode steps as they come."""
    if prefill == "chunked":
        monkeypatch.setattr(decode, "DENSE_PREFILL_BYTES", 0)
    model = _quantized(name, family)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: pinned sinks, masked slots
    mask[2, :11] = 0
    packed, cache = _run(model, ids, mask)
    reference = copy.deepcopy(model)
    _set_packed(reference, False)
    expected, _ = _run(reference, ids, mask)
    assert (packed - expected).abs().max() < TOL
    for layer in cache.layers:  # storage grew in pages: all full but the last
        for stream in (layer.k, layer.v):
            sizes = [c.num_tokens for c in stream.chunks]
            assert all(n == 8 for n in sizes[:-1]) and (not sizes or sizes[-1] <= 8)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_a_prefill_step_reads_the_layer_whole_or_chunked_alike(small_pages, monkeypatch, mask):
    """Several queries a row: the layer's K/V dequantized whole for torch's fused attention
    while they fit ``DENSE_PREFILL_BYTES``, else chunk by chunk, with the same outputs: values
    stored in a rotated basis, 5 query heads a KV head, a row that may see nothing gets zeros."""
    layer = kv_cache.QuantizedKVLayer(
        KVQuantQuantizer(bits=3, num_heads=2, head_dim=16, outlier_fraction=0.05),
        KVQuantQuantizer(bits=4, num_heads=2, head_dim=16, outlier_fraction=0.05, rotate=True),
        sink_tokens=1,
    )
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 2, 30, 16, generator=g) * 2
    layer.store(k[:, :, :20], v[:, :, :20])
    layer.store(k[:, :, 20:], v[:, :, 20:])  # the prompt's second chunk: its 10 queries
    q = torch.randn(3, 10, 10, 16, generator=g)  # [B, H_q, S, D]
    full = None
    if mask is not None:
        allowed = torch.arange(30)[None, :] <= 20 + torch.arange(10)[:, None]  # causal [S, T]
        allowed = allowed.expand(3, 1, 10, 30).clone()
        allowed[1, ..., 3:12] = False
        allowed[2] = False  # a row that may see nothing
        full = (
            allowed
            if mask == "bool"
            else torch.zeros(3, 1, 10, 30).masked_fill(~allowed, float("-inf"))
        )
    taken = []
    dense = decode._dense_attention
    monkeypatch.setattr(
        decode, "_dense_attention", lambda *a, **kw: taken.append(1) or dense(*a, **kw)
    )
    whole = decode.chunked_attention(q, layer, scaling=0.25, mask=full)
    monkeypatch.setattr(decode, "DENSE_PREFILL_BYTES", 0)
    chunked = decode.chunked_attention(q, layer, scaling=0.25, mask=full)
    assert len(taken) == 2 and whole.shape == (3, 10, 10, 16)
    # float32 sums in another order: measured max |difference| 1.7e-6 on outputs up to 6.1
    assert (whole - chunked).abs().max() < 1e-5
    if mask is not None:
        assert torch.equal(whole[2], torch.zeros_like(whole[2]))


def test_decode_step_decodes_one_chunk_at_a_time(small_pages, monkeypatch):
    """The torch path (no compiled library; tests/kv/test_kv_native.py covers the other)."""
    monkeypatch.setattr(native, "library", lambda: None)
    model = _quantized("kvquant 3", "llama")
    ids = torch.randint(3, 256, (1, 41), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model.lowbit_make_cache()
        model(ids[:, :40], past_key_values=cache)
        sizes = []
        original = PackedKV.dequantize_tokens

        def counted(self, start, stop, dtype, **kwargs):
            sizes.append(stop - start)
            return original(self, start, stop, dtype, **kwargs)

        def refuse(self, dtype):
            raise AssertionError("a decode step dequantized a whole stream")

        monkeypatch.setattr(PackedKV, "dequantize_tokens", counted)
        monkeypatch.setattr(kv_cache._Stream, "full", refuse)
        model(ids[:, 40:], past_key_values=cache)
    layers = len(cache.layers)
    assert max(sizes) <= 8
    # each packed token (all but the fp16 sink) decoded once per stream and layer
    assert sum(sizes) == layers * 2 * (41 - 1)


def test_rope_table_equals_direct_cos_sin():
    model = tiny_model("qwen3", head_dim=32)
    adapter = adapter_for(model)
    table = RopeTable(adapter.rope_cos_sin, limit=300)
    positions = torch.tensor([[0, 7, 299, 5], [1, 2, 3, 4]])
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = table(positions, dtype)
        want_cos, want_sin = adapter.rope_cos_sin(positions, dtype)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    far = torch.tensor([[400, 401]])  # beyond the table: computed directly
    assert torch.equal(table(far, torch.float32)[0], adapter.rope_cos_sin(far, torch.float32)[0])


def test_rope_table_past_its_limit_doubles_and_its_blocks_follow_it():
    """Decode steps past the model's positions grow the table by doubling (not one position a
    step), and the compiled kernels' blocks are remade from the grown table."""
    model = tiny_model("llama", head_dim=32)
    table = RopeTable(adapter_for(model).rope_cos_sin, limit=300)
    cos, _ = table.table(301, torch.float32, torch.device("cpu"))
    assert cos.shape[0] == 1024  # at least 1,024 positions once past the limit
    assert table.table(302, torch.float32, torch.device("cpu"))[0] is cos  # not remade
    blocks, _ = table.blocks(302, torch.float32, torch.device("cpu"))
    grown, _ = table.table(1025, torch.float32, torch.device("cpu"))
    assert grown.shape[0] == 2048
    grown_blocks, _ = table.blocks(1025, torch.float32, torch.device("cpu"))
    assert grown_blocks.shape[0] == 2048 // 16 + 1 and blocks.shape[0] == 1024 // 16 + 1
    # position p, channel i at block p // 16, lane p % 16 (rotate-half: the first half kept)
    assert torch.equal(grown_blocks[1500 // 16, :, 1500 % 16], grown[1500, : grown.shape[1] // 2])
