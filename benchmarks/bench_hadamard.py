"""Fast Walsh–Hadamard transform vs a dense matmul on a [tokens, n] float32 input (CPU).

Run: ``python benchmarks/bench_hadamard.py [--tokens 2048] [--sizes 576 1536 4096 11008 14336]``
Prints one row per n: K*2^m split, milliseconds of each path and their ratio. The dense
path multiplies by a prebuilt H/sqrt(n) (building it is not timed).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from lowbit.transforms.hadamard import (
    fast_hadamard_transform,
    hadamard_factorization,
    hadamard_matrix,
)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--sizes", type=int, nargs="+", default=[576, 1536, 4096, 11008, 14336])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, [{args.tokens}, n] fp32")
    print(
        f"{'n':>6} {'K x 2^m':>11} {'fast ms':>9} {'dense ms':>9} {'dense/fast':>10} {'max err':>8}"
    )
    for n in args.sizes:
        k, power = hadamard_factorization(n)
        x = torch.randn(args.tokens, n)  # [T, n]
        dense_t = (hadamard_matrix(n, dtype=torch.float32) / math.sqrt(n)).T.contiguous()
        fast_ms = median_ms(lambda x=x: fast_hadamard_transform(x), args.repeats)
        dense_repeats = max(1, args.repeats // 2) if n > 8192 else args.repeats
        dense_ms = median_ms(lambda x=x, d=dense_t: x @ d, dense_repeats)
        error = (fast_hadamard_transform(x) - x @ dense_t).abs().max().item()
        print(
            f"{n:>6} {f'{k} x {power}':>11} {fast_ms:>9.1f} {dense_ms:>9.1f}"
            f" {dense_ms / fast_ms:>10.2f} {error:>8.1e}"
        )
        del dense_t


if __name__ == "__main__":
    main()
