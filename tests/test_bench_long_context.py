"""``benchmarks/bench_long_context.py``: the replicated contexts' caches, and the llama.cpp rows
(llama.cpp's decode steps after a real prefix with its own quantized K/V caches, on the
embedded GGUF)."""

import math

import pytest
import torch

from lowbit.api import quantize
from lowbit.kv import cache as kv_cache
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_long_context")


@pytest.mark.parametrize(
    "method, settings",
    [("kv-int", {"bits": 4}), ("kvquant", {"bits": 4, "calib_tokens": 128})],
    ids=["kv-int 4", "kvquant 4"],
)
def test_grow_lays_the_copied_tokens_out_in_whole_pages(bench, monkeypatch, method, settings):
    """A replicated context is paged as a prefill of its length would be (every page but the
    last full), so the kernels read it as they would a real one; its tokens are the prefix's,
    repeated."""
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", 8)
    recipe = get_recipe(method, **settings)
    calibration = torch.randint(3, 256, (4, 64), generator=torch.Generator().manual_seed(5))
    model = quantize(
        tiny_model("llama", head_dim=32), recipe, calibration=calibration, progress=False
    )
    prompt = torch.randint(3, 256, (1, 14), generator=torch.Generator().manual_seed(6))
    caches, _, _ = bench.prefill_rows({"q": model}, prompt, 5)  # pages of 8 filled 5 at a time
    layer = caches["q"].layers[0]
    before = [torch.cat([p.dequantize() for p in s.chunks], 2) for s in (layer.k, layer.v)]
    bench.grow(caches["q"], 61)
    assert layer.length == 61
    for stream, source in zip((layer.k, layer.v), before, strict=True):
        sizes = [p.num_tokens for p in stream.chunks]
        assert all(n == 8 for n in sizes[:-1]) and 0 < sizes[-1] <= 8, sizes
        fixed = sum(t.shape[2] for t in (stream.sink, stream.residual) if t is not None)
        assert sum(sizes) + fixed == 61
        grown = torch.cat([p.dequantize() for p in stream.chunks], 2)  # [B, H, T, D]
        cycle = source.repeat(1, 1, -(-grown.shape[2] // source.shape[2]), 1)
        assert torch.equal(grown, cycle[:, :, : grown.shape[2]])


@pytest.mark.slow
def test_llama_cpp_rows_time_each_cache_type_after_a_real_prefix(
    bench, embedded, wikitext_path, monkeypatch
):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(bench, "WIKI", wikitext_path.parent)
    tokenizer = embedded.tokenizer
    table = bench.llama_cpp_table(["f16", "q4_0"], [256, 16_384], tokenizer, steps=3, threads=1)
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, one row a cache type; 16,384 is past the positions
    f16, q4 = (line.strip("|").split("|") for line in lines[2:])
    assert [c.strip() for c in f16[:3]] == ["256", "real", "llama.cpp f16"]
    assert f16[5].strip() == "1.00"  # the first cache type is the base of the ratios
    ms, per_s = float(q4[3].replace(",", "")), float(q4[4])
    assert ms > 0 and math.isclose(per_s, 1e3 / ms, rel_tol=0.05)
    # bytes: 30 layers x 2 x 3 KV heads x 64 channels x 256 tokens, 2 bytes (f16) or 18/32 (q4_0)
    assert float(f16[6]) == pytest.approx(30 * 2 * 192 * 256 * 2 / 1e6, abs=0.06)
    assert float(q4[6]) == pytest.approx(30 * 2 * 192 * 256 * 18 / 32 / 1e6, abs=0.06)
