"""What a tuning sweep's compiles cost, one after another and side by side (no GPU needed).

The tuner of lowbit's Triton kernels compiles every launch candidate of a shape before timing
it; :func:`lowbit.kernels.triton_support.compile_ahead` compiles them in threads first (Triton
compiles with the GIL released, ptxas runs as a process). This compiles two sets of integer GEMV
kernels for sm_90 with Triton's bundled toolchain, into an empty cache: one set one kernel after
another, the other (the same kernels with other split counts, so nothing is cached) through
``compile_ahead``, and prints both wall times side by side::

    python benchmarks/bench_tuning_compile.py --kernels 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from common import command_line, markdown_table, stamp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=4, help="kernels per set")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never interpreted
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="lowbit-compile-")

    import triton
    from kernel_sass import compile_decode_kernel  # tools/

    from lowbit.kernels.triton_support import compile_ahead

    def compile_one(split_k: int) -> None:  # a 4-bit g128 GEMV, 128 rows, 4 warps
        compile_decode_kernel(4, 1, 128, 4, args.arch, split_k=split_k)

    compile_one(16)  # imports and Triton's per-kernel state, outside the timings
    n = args.kernels
    start = time.perf_counter()
    for split in range(1, n + 1):
        compile_one(split)
    in_order = time.perf_counter() - start
    start = time.perf_counter()
    compile_ahead(compile_one, range(n + 1, 2 * n + 1))
    ahead = time.perf_counter() - start
    print(stamp(command_line()) + f" Triton {triton.__version__}, sm_{args.arch}.\n")
    rows = [["one after another", n, f"{in_order:.2f}", "1.00"],
            ["compile_ahead (threads)", n, f"{ahead:.2f}", f"{in_order / ahead:.2f}"]]  # fmt: skip
    print(markdown_table(["compiles", "kernels", "seconds", "× one after another"], rows))


if __name__ == "__main__":
    main()
