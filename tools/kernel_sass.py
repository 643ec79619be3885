"""Compile lowbit's Triton decode kernel for a GPU architecture without a GPU and count the
SASS instructions of its main loop per decoded code (Triton's bundled ptxas and nvdisasm).

A GEMV at low bits is bound by instruction issue as much as by memory: an H100 issues about
3.3e13 thread-instructions/s, a 4-bit GEMV at 3 TB/s decodes 6e12 codes/s, so the loop must stay
near 5 instructions per code. This counts them; it says nothing about stalls (measure on a GPU).
Pointers and strides are declared 16-divisible, as Triton's launcher specializes them. ::

    python tools/kernel_sass.py --bits 2 3 4 8 --arch 90
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path


def compile_decode_kernel(bits, block_m, block_n, num_warps, arch, tile=32, group=128):
    """The compiled ``_int_gemv_kernel`` (fp16 input, symmetric, 16 tiles, no split)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lowbit.kernels import int_gemv

    kernel = int_gemv._int_gemv_kernel
    names = kernel.arg_names
    pointers = {"x_ptr": "*fp16", "words_ptr": "*i32", "scale_ptr": "*fp16", "zero_ptr": "*u8",
                "bias_ptr": "*fp16", "out_ptr": "*fp16"}  # fmt: skip
    scalars = ["M", "N", "K", "stride_xm", "stride_wn", "stride_sg", "stride_zg", "stride_os",
               "stride_om"]  # fmt: skip
    constants = dict(
        BITS=bits, TILE_WORDS=tile, GROUP_SIZE=group, SYMMETRIC=True, HAS_BIAS=False,
        K_TILES=16, SPLIT_K=1, TILES_PER_SPLIT=16, BLOCK_M=block_m, BLOCK_N=block_n,
        INTERPRET=False,
    )  # fmt: skip
    signature = {**pointers, **{s: "i32" for s in scalars}, **{c: "constexpr" for c in constants}}
    aligned = [*pointers, "K", *scalars[3:]]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(c),): v for c, v in constants.items()},
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned},
    )
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}
    )


def loop_instructions(cubin: bytes) -> list[str]:
    """Opcodes of the longest backward-branch loop of a cubin."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([nvdisasm, f.name], capture_output=True, text=True).stdout
    lines = lines.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:$", line)}
    best: list[str] = []
    for i, line in enumerate(lines):
        match = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if match and labels.get(match.group(1), i) < i and i - labels[match.group(1)] > len(best):
            best = lines[labels[match.group(1)] : i + 1]
    opcode = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]+)")
    return [m.group(1) for line in best if (m := opcode.match(line))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    print("| bits | BLOCK_M | BLOCK_N | warps | loop instrs | per code | most frequent |")
    print("|---|---|---|---|---|---|---|")
    for bits in args.bits:
        for block_m, block_n, warps in ((1, 64, 4), (1, 128, 4), (16, 64, 4), (16, 128, 4)):
            ops = loop_instructions(
                compile_decode_kernel(bits, block_m, block_n, warps, args.arch).asm["cubin"]
            )
            codes_per_thread = block_n * 32 * (32 // bits) / (32 * warps)  # one tile
            top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(6))
            print(f"| {bits} | {block_m} | {block_n} | {warps} | {len(ops)} | "
                  f"{len(ops) / codes_per_thread:.1f} | {top} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
