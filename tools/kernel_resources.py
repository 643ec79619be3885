"""Compile every Triton kernel of lowbit and every launch configuration its tuner may time for
a GPU architecture without a GPU, and print what each needs per block: registers, shared memory,
spilled bytes, and the blocks per SM that leaves (ptxas' resource usage read back from the
cubin with Triton's bundled cuobjdump; shared memory from Triton's metadata).

A configuration that cannot launch on an H100 (over 232,448 bytes of shared memory per block,
no block resident) or that spills is what ``tests/kernels/test_kernel_resources.py`` fails on.
Each kernel is compiled in its heaviest variant (split-K epilogue, bias, zero points, bf16
where they add code). ::

    python tools/kernel_resources.py --arch 90
    python tools/kernel_resources.py --arch 90 --even-k  # the integer GEMV for whole tiles
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sass import (  # noqa: E402
    compile_decode_kernel,
    compile_dequant_kernel,
    compile_for,
    compile_kv_decode_kernel,
    compile_prefill_kernel,
    compile_spqr_dense_kernel,
    compile_spqr_kernel,
    compiler_line,
)
from kernel_sass_mixed import compile_mixed, compile_mixed_dequant  # noqa: E402


def cubin_resources(compiled):
    """:class:`~lowbit.kernels.triton_support.Resources` of a compiled kernel, from its cubin:
    registers and local memory (spills, stack) as ptxas allotted them, shared memory as Triton
    launches it (dynamic) plus the cubin's static shared memory."""
    import triton

    from lowbit.kernels.triton_support import Resources

    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    usage = dict(re.findall(r"(\w+):(\d+)", text.split("Function", 1)[1]))
    return Resources(
        registers=int(usage["REG"]),
        shared=compiled.metadata.shared + int(usage["SHARED"]),
        spill=int(usage["STACK"]) + int(usage["LOCAL"]),
        num_warps=compiled.metadata.num_warps,
    )


def _outlier_spmv(arch):
    from lowbit.kernels import mixed_gemv

    pointers = {"x_ptr": "*fp16", "row_ptr_ptr": "*i32", "col_val_ptr": "*i32",
                "out_ptr": "*fp32"}  # fmt: skip
    constants = dict(BLOCK_N=128, BLOCK_M=16, MAX_ROW_NNZ=16)
    return compile_for(mixed_gemv._outlier_spmv_kernel, pointers, ["M", "N", "stride_xm",
                       "stride_om"], constants, arch, num_warps=4)  # fmt: skip


def kernel_variants(arch: int = 90, even_k: bool = False):
    """``(kernel, configuration, variant, compile())`` for every kernel and every distinct
    compiled shape its tuner's candidates take at M = 1 and M = 16 (SPLIT_K only decides
    whether the split epilogue is compiled: it is, with 4 splits). ``even_k``: the integer
    GEMV compiled for K a whole number of tiles (unmasked activations, most layers), not its
    heaviest variant."""
    from lowbit.kernels import int_gemm, int_gemv, mixed_gemv, spqr_gemv

    seen = set()
    for bits in (2, 3, 4, 8):
        for m in (1, 16):
            for block_m, block_n, warps, _, stages in int_gemv._candidates(m, bits):
                if (bits, block_m, block_n, warps, stages) in seen:
                    continue
                seen.add((bits, block_m, block_n, warps, stages))
                config = f"BLOCK_M {block_m} BLOCK_N {block_n} warps {warps} stages {stages}"
                shape = (bits, block_m, block_n, warps)
                if block_m == 1:  # the symmetric GEMV decodes differently (codes in place)
                    yield (
                        "int decode",
                        config,
                        f"{bits}-bit fp16 sym split 4",
                        lambda a=shape, s=stages: compile_decode_kernel(
                            *a, arch, split_k=4, stages=s, even_k=even_k
                        ),
                    )
                yield (
                    "int decode",
                    config,
                    f"{bits}-bit bf16 asym split 4 bias",
                    lambda a=shape, s=stages: compile_decode_kernel(
                        *a,
                        arch,
                        dtype="bf16",
                        split_k=4,
                        has_bias=True,
                        symmetric=False,
                        stages=s,
                        even_k=even_k,
                    ),
                )
    for block_m, block_n, warps, stages in int_gemm._candidates():
        config = f"BLOCK {block_m}x{block_n} warps {warps} stages {stages}"
        yield (
            "int prefill",
            config,
            "4-bit fp16",
            lambda a=(block_m, block_n, warps, stages): compile_prefill_kernel(
                4, a[0], a[1], a[2], arch, num_stages=a[3]
            ),
        )
        yield (
            "int prefill",
            config,
            "3-bit bf16 asym bias",
            lambda a=(block_m, block_n, warps, stages): compile_prefill_kernel(
                3,
                a[0],
                a[1],
                a[2],
                arch,
                dtype="bf16",
                num_stages=a[3],
                symmetric=False,
                has_bias=True,
            ),
        )
    for bits, dtype, symmetric in ((4, "fp16", True), (3, "bf16", False), (2, "bf16", False)):
        yield (
            "int weight decoder",
            "BLOCK_N 64 warps 4",
            f"{bits}-bit {dtype} {'sym' if symmetric else 'asym'}",
            lambda a=(bits, dtype, symmetric): compile_dequant_kernel(
                a[0], 64, arch, dtype=a[1], symmetric=a[2]
            ),
        )
    seen.clear()
    for m in (1, 16):
        for block_m, block_tr, block_g, warps, _ in spqr_gemv._candidates(m):
            if (block_m, block_tr, block_g, warps) in seen:
                continue
            seen.add((block_m, block_tr, block_g, warps))
            config = f"BLOCK_M {block_m} BLOCK_TR {block_tr} BLOCK_G {block_g} warps {warps}"
            yield (
                "spqr decode",
                config,
                "fp16 CSR split 4 bias",
                lambda a=(block_m, block_tr, block_g, warps): compile_spqr_kernel(
                    *a, arch, split_k=4, has_bias=True
                ),
            )
    yield (
        "spqr dense decode",
        "BLOCK_TR 2 BLOCK_G 4 warps 4",
        "fp16",
        lambda: compile_spqr_dense_kernel(arch),
    )
    seen.clear()
    for m in (1, 16):
        for block_m, block_n, tile, warps, _ in mixed_gemv._candidates(m):
            if (block_m, block_n, tile, warps) in seen:
                continue
            seen.add((block_m, block_n, tile, warps))
            config = f"BLOCK_M {block_m} BLOCK_N {block_n} T {tile} warps {warps}"
            yield (
                "2/4/16 decode",
                config,
                "async fused split 4 bias",
                lambda a=(block_m, block_n, tile, warps): compile_mixed(
                    *a, True, True, arch, split_k=4, has_bias=True
                ),
            )
    yield "2/4/16 weight decoder", "BLOCK_N 64 warps 4", "fp32", lambda: compile_mixed_dequant(arch)
    yield (
        "2/4/16 outlier SpMV",
        "BLOCK_N 128 BLOCK_M 16 warps 4",
        "fp16",
        lambda: _outlier_spmv(arch),
    )
    # packed KV decode attention: its heaviest variants (128 channels, kv-int's fp16 scale and
    # uint8 zero point, KVQuant's pre-RoPE keys on per-channel ranges with sparse outliers,
    # channel codebooks)
    for name, variant, options in (
        ("scores", "4-bit int zero", dict(stats=(1, 3, 0), levels=0)),
        ("scores", "4-bit codebook pre-RoPE outliers", dict(rope=True, outliers=True)),
        ("scores", "3-bit channel codebooks pre-RoPE", dict(bits=3, rope=True, levels=2)),
        ("accumulate", "4-bit int zero", dict(stats=(1, 3, 0), levels=0)),
        ("accumulate", "3-bit codebook outliers", dict(bits=3, outliers=True)),
    ):
        yield (
            f"KV decode {name}",
            "BLOCK_T 16 warps 4",
            f"{variant}, 128 channels",
            lambda n=name, o=options: compile_kv_decode_kernel(n, arch, **o),
        )


def resource_rows(arch: int = 90, even_k: bool = False):
    """One dict per compiled variant: kernel, config, variant, resources, blocks per SM and
    why it cannot launch (None when it can)."""
    from lowbit.kernels.triton_support import SM90, blocks_per_sm, launch_refusal

    for kernel, config, variant, make in kernel_variants(arch, even_k):
        res = cubin_resources(make())
        yield dict(kernel=kernel, config=config, variant=variant, resources=res,
                   blocks=blocks_per_sm(res, SM90), refusal=launch_refusal(res, SM90))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--even-k", action="store_true",
                        help="the integer GEMV for K a whole number of tiles (most layers)")  # fmt: skip
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    print(compiler_line(args.arch))
    print("| kernel | configuration | variant | registers | shared bytes | spill bytes | "
          "blocks/SM | launches on sm_90 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in resource_rows(args.arch, args.even_k):
        res = row["resources"]
        print(f"| {row['kernel']} | {row['config']} | {row['variant']} | {res.registers} | "
              f"{res.shared} | {res.spill} | {row['blocks']} | {row['refusal'] or 'yes'} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
