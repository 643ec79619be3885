"""``benchmarks/bench_long_context.py``'s llama.cpp rows: llama.cpp's decode steps after a real
prefix with its own quantized K/V caches, on the embedded GGUF."""

import math

import pytest

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_long_context")


@pytest.mark.slow
def test_llama_cpp_rows_time_each_cache_type_after_a_real_prefix(
    bench, embedded, wikitext_path, monkeypatch
):
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
