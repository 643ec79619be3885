"""Quantize-and-pack throughput of each format on a 4096 x 4096 fp32 tensor (CPU).

Run: .venv/bin/python benchmarks/bench_formats.py [--threads N] [--repeats R]

Target (the formats issue): integer and BFP within 3x of one plain ``torch.round`` pass over the
same tensor; weighted k-means of 1M samples to 16 levels under 2 s.

The cores may be shared, so every timing of a format is paired with a ``torch.round`` timing
taken just before it in the same process; each of ``R`` rounds goes through all formats, and the
table reports the median ms and the median of the per-pair ratios. GB/s counts the fp32 input
read once.
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


def timed(fn) -> float:
    """Seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
    nbytes = x.numel() * 4
    baseline = lambda: torch.round(x)  # noqa: E731
    cases = {
        "int4 sym per-row fake": lambda: fake_quant_int(x, 4),
        "int4 sym per-token c0.9 fake": lambda: fake_quant_int(x, 4, clip_ratio=0.9),
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
    baseline()
    for fn in cases.values():  # warm-up
        fn()
    base_times: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in cases}
    ratios: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            base = timed(baseline)
            t = timed(fn)
            base_times.append(base)
            times[name].append(t)
            ratios[name].append(t / base)

    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads, 4096x4096 fp32, median of {args.repeats} interleaved pairs"
    )
    print(f"| {'format':<28} | {'ms':>8} | {'GB/s':>6} | {'x round':>7} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 8}|{'-' * 9}|")
    ms = statistics.median(base_times) * 1e3
    print(f"| {'torch.round (baseline)':<28} | {ms:8.1f} | {nbytes / ms / 1e6:6.2f} | {1:7.2f} |")
    for name in cases:
        ms = statistics.median(times[name]) * 1e3
        ratio = statistics.median(ratios[name])
        print(f"| {name:<28} | {ms:8.1f} | {nbytes / ms / 1e6:6.2f} | {ratio:7.2f} |")

    samples = torch.randn(1_000_000, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(1_000_000, generator=torch.Generator().manual_seed(2))
    fit_codebook(samples, 16, weights)
    ms = statistics.median(timed(lambda: fit_codebook(samples, 16, weights)) for _ in range(3))
    print(f"\nweighted k-means, 1M samples -> 16 levels: {ms * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
