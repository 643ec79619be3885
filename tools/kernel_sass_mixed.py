"""Compile the mixed 2/4-bit GEMV kernels for a GPU architecture without a GPU and count the
SASS instructions of their main loop per decoded code (as ``tools/kernel_sass.py`` does for
the integer kernels).

The M = 1 kernel walks two 128-bit words per row per step (segment A at 25 % 4-bit: 64 codes
per word), ``BLOCK_N / (32 * warps)`` rows per thread; the 16-row kernel a tile of ``T`` words
for ``BLOCK_N`` rows over ``32 * warps`` threads. Pointers and strides are declared
16-divisible, as Triton's launcher specializes them. ::

    python tools/kernel_sass_mixed.py --arch 90
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sass import (  # noqa: E402
    add_latency_option,
    compile_for,
    compiler_line,
    loop_instructions,
    memory_round_trips,
)

_POINTERS = {
    "primary_ptr": "*i32", "secondary_ptr": "*i32", "stats2_ptr": "*i16", "stats4_ptr": "*u8",
    "second2_ptr": "*i32", "second4_ptr": "*i32", "col2_ptr": "*i32", "col4_ptr": "*i32",
    "row_ptr_ptr": "*i32", "col_val_ptr": "*i32",
}  # fmt: skip


def compile_mixed(
    block_m, block_n, tile, warps, asynchronous, fuse, arch, dtype="fp16", split_k=1,
    has_bias=False,
):  # fmt: skip
    """The M = 1 (``block_m`` 1) or 16-row kernel, segment A only (UA = 64 words), g2 16."""
    from lowbit.kernels import mixed_gemv

    pointers = {"x_ptr": f"*{dtype}", **_POINTERS, "bias_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}"}  # fmt: skip
    common = dict(UA=64, UB=0, UC=0, G2=16, BLOCK_N=block_n, ASYNC=asynchronous,
                  FUSE_OUTLIERS=fuse, MAX_ROW_NNZ=16 if fuse else 0, SPLIT_K=split_k,
                  HAS_BIAS=has_bias, INTERPRET=False)  # fmt: skip
    strides = ["stride_pn", "stride_sn", "stride_t2", "stride_t4", "stride_r2", "stride_r4"]
    if block_m == 1:
        kernel = mixed_gemv._gemv1_kernel
        scalars = ["N", "K", *strides, "stride_ps"]
        constants = dict(common, STEPS_A=8, STEPS_B=0, STEPS_C=0, EVEN_K=True)
    else:
        kernel = mixed_gemv._gemm16_kernel
        scalars = ["M", "N", "K", "stride_xm", *strides, "stride_ps", "stride_om"]
        constants = dict(common, TILES_A=4, TILES_B=0, TILES_C=0, T=tile, BLOCK_M=block_m)
    return compile_for(kernel, pointers, scalars, constants, arch, num_warps=warps)


def compile_mixed_dequant(arch):
    """The prefill decoder (``mixed_dequant``): every segment (UA 32, UB 16, C after), g2 16."""
    from lowbit.kernels import mixed_dequant

    pointers = {name: _POINTERS[name] for name in list(_POINTERS)[:6]}  # primary .. second4
    pointers.update(group2_ptr="*i32", group4_ptr="*i32", out_ptr="*fp32")
    scalars = ["N", "K", "stride_pn", "stride_sn", "stride_t2", "stride_t4", "stride_r2",
               "stride_r4", "stride_on"]  # fmt: skip
    constants = dict(UA=32, UB=16, G2=16, BLOCK_N=mixed_dequant.BLOCK_N)
    return compile_for(mixed_dequant._mixed_dequant_kernel, pointers, scalars, constants, arch,
                       num_warps=4)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    add_latency_option(parser)
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    print(compiler_line(args.arch))
    print("| kernel | x | schedule | outliers | BLOCK_N | T | warps | loop instrs | per code | "
          "round trips per step | lone-warp cycles per step | most frequent |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = [(1, bn, 2, w, a, True, "fp16") for bn, w in ((128, 1), (256, 2)) for a in (True, False)]
    runs += [(1, 128, 2, 1, True, False, "fp16"), (1, 128, 2, 1, True, True, "bf16")]
    runs += [(16, 64, 16, 4, True, True, "fp16")]
    for block_m, block_n, tile, warps, asynchronous, fuse, dtype in runs:
        kernel = compile_mixed(block_m, block_n, tile, warps, asynchronous, fuse, args.arch,
                               dtype=dtype)  # fmt: skip
        ops = loop_instructions(kernel.asm["cubin"])
        if block_m == 1:  # a step: two 64-code words of each of the thread's rows
            codes_per_thread = block_n / (32 * warps) * 2 * 64
        else:  # a tile: T words of 64 codes for BLOCK_N rows
            codes_per_thread = block_n * tile * 64 / (32 * warps)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(6))
        trips, cycles = memory_round_trips(kernel.asm["cubin"], args.latency)
        name = "gemv M=1" if block_m == 1 else "M<=16 (tl.dot)"
        schedule = "async" if asynchronous else "sync"
        print(
            f"| {name} | {dtype} | {schedule} | {'fused' if fuse else 'none'} | {block_n} | "
            f"{tile} | {warps} | {len(ops)} | {len(ops) / codes_per_thread:.2f} | {trips} | "
            f"{cycles} | {top} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
