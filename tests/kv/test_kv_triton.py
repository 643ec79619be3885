"""The Triton decode attention (lowbit.kv.triton_decode) in the interpreter: over the caches of
tiny models it equals the torch path on the same stored bits, for every format it reads, and
refuses (None) what it does not."""

import pytest
import torch

from lowbit.api import quantize
from lowbit.kv import cache as kv_cache
from lowbit.kv import decode
from lowbit.kv.triton_decode import triton_decode_attention
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

CALIB = torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(5))
RECIPES = {
    "kv-int 4": ("kv-int", {"bits": 4}),
    "kv-int 3, pre-RoPE channel keys, sinks": (
        "kv-int",
        {
            "bits": 3,
            "pre_rope": True,
            "per_channel_keys": True,
            "key_token_group": 8,
            "sink_tokens": 2,
        },
    ),  # fmt: skip
    "quarot K3V2": ("kv-int", {"k_bits": 3, "v_bits": 2, "rotate_qk": "hadamard"}),
    "kivi 2": ("kivi", {"bits": 2, "group": 8, "residual": 16}),
    "kvquant 3 without outliers": (
        "kvquant",
        {"bits": 3, "outlier_fraction": 0.0, "calib_tokens": 128},
    ),  # fmt: skip
    # KVQuant's recipe: pre-RoPE per-channel keys, sparse outliers (here 5 %, many a block),
    # an fp16 sink, rotated values
    "kvquant 4": ("kvquant", {"bits": 4, "outlier_fraction": 0.05, "calib_tokens": 128}),
    "kvquant 3 channel codebooks": (
        "kvquant",
        {"bits": 3, "channel_codebooks": True, "calib_tokens": 128},
    ),  # fmt: skip
}


def _cache(name, head_dim, steps=6):
    """A tiny llama quantized with recipe ``name``, its cache after a prefill of 29 tokens (in
    pages of 8) and ``steps`` decode steps by the torch path."""
    method, settings = RECIPES[name] if isinstance(name, str) else name
    recipe = get_recipe(method, **settings)
    model = tiny_model("llama", head_dim=head_dim)
    model = quantize(model, recipe, calibration=CALIB if recipe.needs_calibration else None,
                     progress=False)  # fmt: skip
    ids = torch.randint(3, 256, (2, 29 + steps), generator=torch.Generator().manual_seed(7))
    cache = model.lowbit_make_cache()
    with torch.no_grad():
        model(ids[:, :29], past_key_values=cache)
        for t in range(29, 29 + steps):
            model(ids[:, t : t + 1], past_key_values=cache)
    return model, cache


def _both(model, cache, mask=None):
    """Per layer: (Triton's output, the torch path's) for a random query."""
    g = torch.Generator().manual_seed(8)
    out = []
    for block, layer in zip(model.model.layers, cache.layers, strict=True):
        attn = block.self_attn
        hq = model.config.num_attention_heads
        q = torch.randn(2, hq, 1, attn.head_dim, generator=g)
        key_rope = None
        if attn.pre_rope:

            def key_rope(keys, positions, attn=attn):
                cos, sin = attn.rope_table(positions.long(), keys.dtype)
                return attn._rope(keys, cos, sin)

        kw = dict(scaling=attn.scaling, mask=mask, key_rope=key_rope)
        got = decode._triton_decode(q, layer, attn.scaling, mask, key_rope, attn.rope_table)
        want = decode.chunked_attention(q, layer, max_tokens=8, **kw)  # the torch road
        out.append((got, want))
    return out


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", 8)


@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("name", list(RECIPES))
def test_triton_decode_equals_the_torch_path(small_pages, name, head_dim):
    model, cache = _cache(name, head_dim)
    for got, want in _both(model, cache):
        assert got is not None
        # float32 sums in another order: measured max |difference| 2.1e-7 over every recipe and
        # head dim here, on outputs up to 0.38
        assert (got - want).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_triton_decode_applies_the_mask(small_pages, kind):
    """A padded batch row: the masked slots get no weight (a float mask adds)."""
    model, cache = _cache("kv-int 4", 32)
    total = cache.layers[0].length
    allowed = torch.ones(2, 1, 1, total, dtype=torch.bool)
    allowed[1, ..., :5] = False  # row 1 left-padded
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, -1e9)
    for got, want in _both(model, cache, mask):
        assert (got - want).abs().max() < 1e-6


@pytest.mark.parametrize(
    "name",
    ["kv-int 4", ("kvquant", {"bits": 4, "outlier_fraction": 0.01, "calib_tokens": 128})],
    ids=["kv-int 4", "kvquant 4, 1 % outliers"],
)
def test_a_layers_table_is_kept_between_steps(small_pages, name):
    """Step after step, pages closing on the way (pages of 8), the table kept on the layer
    gives the torch path's result; while no page closes it is the same table, the open page's
    token count written into it."""
    model, cache = _cache(name, 32, steps=0)
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(10))
    reused = 0
    for step in range(10):
        with torch.no_grad():
            model(ids[:, step : step + 1], past_key_values=cache)
        before = cache.layers[0].decode_streams.get("triton k")
        for got, want in _both(model, cache):
            assert (got - want).abs().max() < 1e-6
        after = cache.layers[0].decode_streams["triton k"]
        reused += before is not None and before[1] is after[1]
    # a page of 8 closes every 8 steps, KVQuant's outliers' room moves as it doubles: measured 7
    # of 10 steps for kv-int 4, 5 for KVQuant
    assert reused >= 5, reused


@pytest.mark.parametrize("name", ["kv-int 4", "kvquant 3"])
def test_pages_of_several_runs(load_benchmark, name):
    """Pages longer than a weighted-sum program's run (600 and 1,024 tokens, runs of 256, the
    last ones partial): every block of every run counted once."""
    bench = load_benchmark("bench_packed_decode")
    g = torch.Generator().manual_seed(11)
    keys, values = (torch.randn(1, 2, 1624, 32, generator=g) for _ in range(2))
    layer = bench.fill(name, keys, values)  # pages of 1,024 and 600 tokens
    q = torch.randn(1, 4, 1, 32, generator=g)
    got = triton_decode_attention(q, layer, scaling=32**-0.5)
    want = decode.chunked_attention(q, layer, scaling=32**-0.5, max_tokens=1024)
    # float32 sums in another order: measured max |difference| 6.0e-8 on outputs up to 0.13
    assert got is not None and (got - want).abs().max() < 1e-6


def test_what_it_does_not_read_is_left_to_torch(small_pages):
    """K-sort + BFP pages: None, nothing changed."""
    model, cache = _cache(("ksort-bfp", {}), 32, steps=1)
    for got, want in _both(model, cache):
        assert got is None and want is not None


def test_pages_of_two_formats_are_left_to_torch(small_pages):
    """One launch reads a stream's pages with one format's constants: a page of another (here
    3-bit among 4-bit ones) sends the step to torch."""
    from lowbit.kv.int_quant import IntTokenQuantizer

    model, cache = _cache("kv-int 4", 32, steps=1)
    for layer in cache.layers:
        page = layer.k.chunks[0]
        layer.k.chunks[0] = IntTokenQuantizer(3).quantize(page.dequantize(torch.float32))
    for got, want in _both(model, cache):
        assert got is None and want is not None


def test_not_on_cuda_outside_the_interpreter(small_pages, monkeypatch):
    model, cache = _cache("kv-int 4", 32, steps=1)
    monkeypatch.setattr("lowbit.kernels.triton_support.interpreting", lambda: False)
    q = torch.randn(2, model.config.num_attention_heads, 1, 32)
    assert triton_decode_attention(q, cache.layers[0], scaling=0.1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kv-int 4", "kvquant 3"])
def test_compiled_on_cuda_equals_the_torch_path(load_benchmark, name):
    """The compiled kernels at a real model's KV shape (Llama-3-8B's: 8 KV heads of 128, 32
    query heads), over 5,000 tokens in pages of 1,024 and an open page."""
    bench = load_benchmark("bench_packed_decode")
    g = torch.Generator().manual_seed(9)
    keys, values = (torch.randn(1, 8, 5000, 128, generator=g).cuda().half() for _ in range(2))
    layer = bench.fill(name, keys, values)
    q = torch.randn(1, 32, 1, 128, generator=g).cuda().half()
    got = triton_decode_attention(q, layer, scaling=128**-0.5)
    want = decode.chunked_attention(q, layer, scaling=128**-0.5, max_tokens=1024)
    assert got is not None
    # both float32 inside, returned in float16: an fp16 rounding apart at most (outputs < 0.1;
    # in the interpreter on the CPU, same data: measured 3.1e-5)
    assert (got.float() - want.float()).abs().max() < 1e-4
