"""Quantize-and-pack throughput of each format on a 4096 x 4096 fp32 tensor (CPU).

Run: .venv/bin/python benchmarks/bench_formats.py [--threads N]
Prints ms per call (median of 5 after a warm-up), GB/s of fp32 input read, and the ratio to one
plain torch.round pass over the same tensor; then weighted k-means of 1M samples to 16 levels.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lowbit.formats import (
    BFPQuantized,
    IntQuantized,
    NUQQuantized,
    fake_quant_bfp,
    fake_quant_int,
    fit_codebook,
    normal_float_codebook,
)


def bench(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
    nbytes = x.numel() * 4
    base = bench(lambda: torch.round(x))
    cases = {
        "torch.round (baseline)": lambda: torch.round(x),
        "int4 sym per-row fake": lambda: fake_quant_int(x, 4),
        "int4 asym g128 fake": lambda: fake_quant_int(x, 4, symmetric=False, group_size=128),
        "int4 sym per-row pack": lambda: IntQuantized.from_float(x, 4),
        "int4 asym g128 pack": lambda: IntQuantized.from_float(
            x, 4, symmetric=False, group_size=128
        ),
        "int8 sym g32 pack": lambda: IntQuantized.from_float(x, 8, group_size=32),
        "bfp12 n64 fake": lambda: fake_quant_bfp(x, 4, 64),
        "bfp12 n64 pack": lambda: BFPQuantized.from_float(x, 4, 64),
        "mxint8 n32 pack": lambda: BFPQuantized.from_float(x, 8, 32),
        "nf4 per-row pack": lambda: NUQQuantized.from_float(x, normal_float_codebook(4)),
    }
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads, 4096x4096 fp32"
    )
    print(f"| {'format':<26} | {'ms':>8} | {'GB/s':>6} | {'x round':>7} |")
    print(f"|{'-' * 28}|{'-' * 10}|{'-' * 8}|{'-' * 9}|")
    for name, fn in cases.items():
        ms = base if name.startswith("torch.round") else bench(fn)
        print(f"| {name:<26} | {ms:8.1f} | {nbytes / ms / 1e6:6.2f} | {ms / base:7.2f} |")
    samples = torch.randn(1_000_000, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(1_000_000, generator=torch.Generator().manual_seed(2))
    ms = bench(lambda: fit_codebook(samples, 16, weights), repeats=3)
    print(f"\nweighted k-means, 1M samples -> 16 levels: {ms:.0f} ms")


if __name__ == "__main__":
    main()
