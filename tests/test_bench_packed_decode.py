"""``benchmarks/bench_packed_decode.py``: its table on the CPU, the packed rows by lowbit's
dispatch (the compiled C kernels) and by the Triton kernels in the interpreter."""

import pytest

from lowbit.kv.triton_decode import triton_decode_attention


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_packed_decode")


@pytest.mark.parametrize("kernels", ["dispatch", "triton"])
def test_table_times_every_row_beside_the_float_cache(bench, kernels):
    pytest.importorskip("triton")
    import torch

    attend = triton_decode_attention if kernels == "triton" else None
    text = bench.table(torch.device("cpu"), torch.float32, [40, 70], 4, 2, 32, 1,
                       list(bench.ROWS), attend)  # fmt: skip
    rows = [line.strip("|").split("|") for line in text.splitlines()[2:]]
    assert len(rows) == 2 * (1 + len(bench.ROWS))
    base = None
    for row in rows:
        context, name, ms, ratio, mb, byte_ratio = (c.strip() for c in row)
        assert float(ms) > 0
        if name.startswith("float"):
            assert (ratio, byte_ratio) == ("1.00", "1.000")
            base = float(ms)
        else:
            # both times printed to 3 decimals of a ms: the ratio of the printed times within 10 %
            assert float(ratio) == pytest.approx(
                base / float(ms), rel=0.1, abs=0.006
            )  # 4, 3 or 2 bits a value and their statistics: well under the float32 cache
            assert 0.05 < float(byte_ratio) < 0.25, row


def test_an_existing_table_is_refused_before_the_run(bench, tmp_path):
    out = tmp_path / "table.md"
    out.write_text("an earlier table\n")
    args = ["--device", "cpu", "--contexts", "64", "--heads", "4", "--kv-heads", "2", "--dim",
            "32", "--steps", "1", "--rows", "kv-int 4", "--out", str(out)]  # fmt: skip
    with pytest.raises(SystemExit, match="pass --force"):
        bench.main(args)
    assert out.read_text() == "an earlier table\n"
    bench.main([*args, "--force"])
    assert "| 64 | kv-int 4 |" in out.read_text()
