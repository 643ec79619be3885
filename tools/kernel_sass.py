"""Compile lowbit's Triton integer kernels for a GPU architecture without a GPU and count the
SASS instructions of their main loop per decoded code (Triton's bundled ptxas and nvdisasm).

A GEMV at low bits is bound by instruction issue as much as by memory: an H100 issues about
3.3e13 thread-instructions/s, a 4-bit GEMV at 3 TB/s decodes 6e12 codes/s, so the loop must stay
near 5 instructions per code. This counts them. It also reads the scheduling controls ptxas
gives each instruction (the scoreboards a load sets and an instruction waits on) and replays
one loop iteration of a lone warp with every global load taking ``--latency`` cycles: how many
times the warp waits for memory a tile, one round trip after another ("round trips"), and the
cycles that takes. A model, not a measurement: loads that hit a cache return sooner, other
warps issue while one waits, and copies by TMA or cp.async (in flight across iterations) are
not counted.
For the prefill kernel a decoded weight serves BLOCK_M rows, so its count is per BLOCK_M MACs.
Pointers and strides are declared 16-divisible, as Triton's launcher specializes them. ::

    python tools/kernel_sass.py --bits 2 3 4 8 --arch 90
    python tools/kernel_sass.py --bits 4 --arch 90 --even-k  # K a multiple of the tile
    python tools/kernel_sass.py --spqr --arch 90     # lowbit's fused SpQR kernel
    python tools/kernel_sass.py --split-sums --arch 90  # the split-K epilogues' loads
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def _compile(kernel, scalars, constants, dtype, arch, words="*i32", **options):
    """``kernel`` compiled for ``sm_<arch>`` with fp16 scales and 16-divisible pointers and
    strides (as Triton's launcher specializes them); ``words`` the words' argument type."""
    pointers = {"x_ptr": f"*{dtype}", "words_ptr": words, "scale_ptr": "*fp16",
                "zero_ptr": "*u8", "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}  # fmt: skip
    return compile_for(kernel, pointers, scalars, constants, arch, **options)


def compile_for(kernel, pointers, scalars, constants, arch, **options):
    """``kernel`` compiled for ``sm_<arch>``: ``pointers`` name -> Triton type (or a TMA
    descriptor's, ``tensordesc<i32[128, 32]>``), ``scalars`` int32, ``constants`` constexprs;
    pointers, K and strides declared 16-divisible. The split-K outputs (``part_ptr`` fp32,
    ``count_ptr`` int32) are added where the kernel has them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    if "part_ptr" in names:
        pointers = {**pointers, "part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {**pointers, **{s: "i32" for s in scalars}, **{c: "constexpr" for c in constants}}
    pointers_only = [p for p, kind in pointers.items() if kind.startswith("*")]
    aligned = [*pointers_only, *(s for s in scalars if s == "K" or s.startswith("stride"))]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(c),): v for c, v in constants.items()},
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_decode_kernel(
    bits, block_m, block_n, num_warps, arch, dtype="fp16", split_k=1, has_bias=False,
    symmetric=True, even_k=False, stages=1, tma=None,
):  # fmt: skip
    """``_int_gemv_kernel``: g128, 32-word tiles, 16 tiles (``split_k`` splits); ``even_k``:
    K a multiple of the tile's codes (unmasked activation loads, most layers' shapes);
    ``stages``: 2 the next tile's words in registers, 3 or more pipelined through shared
    memory, by TMA (``tma``; by default from sm_90, as the launcher does) or ``cp.async``."""
    from lowbit.kernels import int_gemv

    scalars = ["M", "N", "K", "stride_xm", "stride_wn", "stride_sg", "stride_zg", "stride_ps",
               "stride_om"]  # fmt: skip
    constants = dict(
        BITS=bits, TILE_WORDS=32, GROUP_SIZE=128, SYMMETRIC=symmetric, HAS_BIAS=has_bias,
        K_TILES=16, SPLIT_K=split_k, TILES_PER_SPLIT=int_gemv.tiles_per_split(16, split_k, stages),
        BLOCK_M=block_m, BLOCK_N=block_n, EVEN_K=even_k, STAGES=stages,
        TMA=stages > 2 and (arch >= 90 if tma is None else tma), PAIRS=arch >= 90,
        INTERPRET=False,
    )  # fmt: skip
    words = f"tensordesc<i32[{block_n}, 32]>" if constants["TMA"] else "*i32"
    return _compile(int_gemv._int_gemv_kernel, scalars, constants, dtype, arch, words=words,
                    num_warps=num_warps)  # fmt: skip


def compile_prefill_kernel(
    bits, block_m, block_n, num_warps, arch, dtype="fp16", num_stages=3, symmetric=True,
    has_bias=False,
):  # fmt: skip
    """``_int_gemm_kernel``: g128, 32-word tiles, 16 tiles."""
    from lowbit.kernels import int_gemm

    scalars = ["M", "N", "K", "stride_xm", "stride_wn", "stride_sg", "stride_zg", "stride_om"]
    constants = dict(
        BITS=bits, TILE_WORDS=32, GROUP_SIZE=128, SYMMETRIC=symmetric, HAS_BIAS=has_bias,
        K_TILES=16,
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8, INTERPRET=False,
    )  # fmt: skip
    return _compile(int_gemm._int_gemm_kernel, scalars, constants, dtype, arch,
                    num_warps=num_warps, num_stages=num_stages)  # fmt: skip


def compile_dequant_kernel(bits, block_n, arch, dtype="fp16", symmetric=True):
    """``_int_dequant_kernel``: g128, 32-word tiles, the weight written in ``dtype``."""
    from lowbit.kernels import int_dequant

    pointers = {"words_ptr": "*i32", "scale_ptr": "*fp16", "zero_ptr": "*u8",
                "out_ptr": f"*{dtype}"}  # fmt: skip
    scalars = ["N", "K", "stride_wn", "stride_sg", "stride_zg", "stride_on"]
    constants = dict(BITS=bits, TILE_WORDS=32, GROUP_SIZE=128, SYMMETRIC=symmetric,
                     BLOCK_N=block_n, INTERPRET=False)  # fmt: skip
    return compile_for(int_dequant._int_dequant_kernel, pointers, scalars, constants, arch,
                       num_warps=4)  # fmt: skip


def compile_spqr_kernel(
    block_m, block_tr, block_g, num_warps, arch, dtype="fp16", split_k=1, has_bias=False
):
    """``_spqr_gemv_kernel`` (on the 64-bit words of Crnčević's SpQR inference kernel, master's
    thesis, 2025): 4096 columns (256 tiles), act-order permutation, CSR outliers, no masks
    (``EVEN_K``), ``split_k`` splits."""
    from lowbit.kernels import spqr_gemv

    pointers = {"x_ptr": f"*{dtype}", "words_ptr": "*i64", "perm_ptr": "*i32",
                "sp_ptr_ptr": "*i32", "sp_val_ptr": "*i32", "bias_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}"}  # fmt: skip
    scalars = ["M", "N", "K", "stride_xm", "stride_wt", "stride_ps", "stride_om"]
    constants = dict(
        N_TILES_G=256, SPLIT_K=split_k, CHUNKS_PER_SPLIT=256 // block_g // split_k,
        HAS_PERM=True, SPARSE=1, HAS_BIAS=has_bias, EVEN_K=True, BLOCK_TR=block_tr,
        BLOCK_G=block_g, BLOCK_M=block_m, SUBNORMAL=True, INTERPRET=False,
    )  # fmt: skip
    return compile_for(spqr_gemv._spqr_gemv_kernel, pointers, scalars, constants, arch,
                       num_warps=num_warps)  # fmt: skip


def compile_spqr_dense_kernel(arch, block_tr=2, block_g=4):
    """``_spqr_dense_kernel`` (SpQR's words decoded to the fp16 weight, for prefill): 4096
    columns (256 tiles)."""
    from lowbit.kernels import spqr_gemv

    pointers = {"words_ptr": "*i64", "out_ptr": "*fp16"}
    constants = dict(N_TILES_G=256, BLOCK_TR=block_tr, BLOCK_G=block_g)
    return compile_for(spqr_gemv._spqr_dense_kernel, pointers, ["N", "K", "stride_wt",
                       "stride_on"], constants, arch, num_warps=4)  # fmt: skip


def compile_kv_decode_kernel(
    name, arch, dim=128, bits=4, rope=False, stats=(1, 0, 1), levels=1, groups=4, outliers=False,
    num_warps=4,
):  # fmt: skip
    """:mod:`lowbit.kv.triton_decode_kernels`' ``scores_kernel`` or ``accumulate_kernel`` (``name``
    "scores" or "accumulate") for pages of ``bits``-bit codes of ``dim`` channels, 8 KV heads
    of ``groups`` queries; ``stats``: the dtype codes of scale, zero and offset (native's: 1
    fp16, 2 fp32, 3 uint8, 0 absent); ``levels``: 0 integer, 1 a codebook, 2 one a channel;
    ``outliers``: KVQuant's sparse outliers read (batch 1)."""
    import triton

    from lowbit.kv import triton_decode, triton_decode_kernels

    kernel = getattr(triton_decode_kernels, f"{name}_kernel")
    pointers = {"table": "*i64", "levels": "*fp32", "q": "*fp32", "scores": "*fp32",
                "positions": "*i32", "cos": "*fp32", "sin": "*fp32", "p": "*fp32",
                "partial": "*fp32", "scaling": "fp32"}  # fmt: skip
    scale, zero, offset = stats
    constants = dict(
        HEADS=8, G=groups, GP=triton.next_power_of_2(groups), D=dim,
        DP=triton.next_power_of_2(dim // 2 if rope else dim), ROPE=rope,
        BLOCK=triton_decode.BLOCK_T, BITS=bits, ROW_BYTES=-(-dim * bits // 8), LEVELS=levels,
        LEVEL_BIAS=0.0, TG=1, CG=dim, SCALE=scale, ZERO=zero, OFFSET=offset, OUTLIERS=outliers,
        BATCH=1, ROWS=triton_decode.BLOCK_T, RUN=triton_decode.RUN_BLOCKS,
    )  # fmt: skip
    names = kernel.arg_names
    pointers = {k: v for k, v in pointers.items() if k in names}
    constants = {k: v for k, v in constants.items() if k in names}
    scalars = [n for n in ("total", "positions_stride", "blocks", "runs") if n in names]
    return compile_for(kernel, pointers, scalars, constants, arch, num_warps=num_warps)


def spqr_table(arch: int, latency: int) -> None:
    """Instructions per decoded 3-bit code of the SpQR kernel's main loop (one chunk of
    ``BLOCK_TR`` x 16 rows x ``BLOCK_G`` tiles per iteration), and its round trips a chunk."""
    print("| kernel | x | BLOCK_M | BLOCK_TR | BLOCK_G | warps | loop instrs | per code | "
          "round trips per chunk | lone-warp cycles per chunk | most frequent |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for block_m, block_tr, block_g, warps, dtype in (
        (1, 4, 8, 4, "fp16"), (1, 8, 8, 4, "fp16"), (1, 8, 8, 4, "bf16"), (1, 16, 8, 4, "fp16"),
        (16, 4, 16, 4, "fp16"), (16, 8, 16, 4, "fp16"),
    ):  # fmt: skip
        kernel = compile_spqr_kernel(block_m, block_tr, block_g, warps, arch, dtype)
        ops = loop_instructions(kernel.asm["cubin"])
        codes_per_thread = block_tr * 16 * block_g * 16 / (32 * warps)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(6))
        trips, cycles = memory_round_trips(kernel.asm["cubin"], latency)
        print(f"| spqr | {dtype} | {block_m} | {block_tr} | {block_g} | {warps} | {len(ops)} | "
              f"{len(ops) / codes_per_thread:.1f} | {trips} | {cycles} | {top} |",
              flush=True)  # fmt: skip


def split_sum_table(arch: int, splits: int = 32) -> None:
    """The loads of the split-K partials in each GEMV's epilogue at ``splits`` splits, and how
    many of them are issued before the first add (all: they wait once; a rolled loop waits
    once per split)."""
    from kernel_sass_mixed import compile_mixed

    kernels = {
        "int M=1, 128 rows, 4 warps": compile_decode_kernel(4, 1, 128, 4, arch, split_k=splits),
        "int M=16, 64 rows, 4 warps": compile_decode_kernel(4, 16, 64, 4, arch, split_k=splits),
        "spqr M=1, BLOCK_TR 8, 4 warps": compile_spqr_kernel(1, 8, 8, 4, arch, split_k=splits),
        "2/4/16 M=1, 128 rows, 1 warp": compile_mixed(1, 128, 2, 1, True, True, arch,
                                                      split_k=splits),
    }  # fmt: skip
    print(f"| kernel ({splits} splits) | partial loads | issued before the first add |")
    print("|---|---|---|")
    for name, kernel in kernels.items():
        loads, before = split_sum_loads(kernel.asm["cubin"])
        print(f"| {name} | {loads} | {before} |", flush=True)


def compiler_line(arch: int) -> str:
    """Which Triton compiled the tables (their counts differ between versions: the device
    image runs Triton 3.6) and for which architecture."""
    import triton

    return f"Triton {triton.__version__}, sm_{arch}"


#: an instruction's opcode with its modifiers (``LDG.E.128``), after a predicate if any
_OPCODE = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]+)")


@functools.lru_cache(maxsize=8)
def _disassembly(cubin: bytes) -> tuple[str, ...]:
    """The SASS of a cubin, one line per instruction or label (Triton's bundled nvdisasm),
    each instruction followed by a line with the upper half of its 128-bit encoding (kept for
    the tables that read one kernel's code twice: its opcodes and its round trips)."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([nvdisasm, "-hex", f.name], capture_output=True, text=True)
    return tuple(run.stdout.splitlines())


#: the upper half of an instruction's encoding, on the line after it (``nvdisasm -hex``)
_UPPER = re.compile(r"^\s+/\* 0x([0-9a-f]{16}) \*/\s*$")


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """An instruction with the controls ptxas encodes in bits 105-125 of it (Volta and later):
    the cycles to stall before the next one issues, the scoreboard (0-5, or None) it releases
    when its result is written and when its operands have been read, and the scoreboards it
    waits on before it issues (a bit mask)."""

    opcode: str  # with modifiers: LDG.E.128
    stall: int
    writes: int | None
    reads: int | None
    waits: int


def _scheduled(lines: Sequence[str]) -> list[Scheduled]:
    out = []
    for line, upper in zip(lines, lines[1:], strict=False):
        if (m := _OPCODE.match(line)) and (u := _UPPER.match(upper)):
            controls = int(u.group(1), 16) >> 41
            writes, reads = (controls >> 5) & 7, (controls >> 8) & 7
            out.append(Scheduled(m.group(1), controls & 15, writes if writes < 6 else None,
                                 reads if reads < 6 else None, (controls >> 11) & 63))  # fmt: skip
    return out


def memory_round_trips(cubin: bytes, latency: int = 800) -> tuple[int, int]:
    """``(round trips, cycles)`` of one iteration of the longest loop of a cubin for a warp
    alone on its scheduler (:func:`replay`)."""
    return replay(_scheduled(_loop_lines(cubin)), latency)


def replay(body: list[Scheduled], latency: int = 800) -> tuple[int, int]:
    """``(round trips, cycles)`` of a loop body issued in order by a lone warp, every global
    load (``LDG``) ``latency`` cycles, other variable-latency instructions 20, operand reads
    15: the fourth iteration (a load issued in one iteration and used in the next counts
    there). A round trip is a wait of more than a quarter of ``latency``: loads issued together
    wait once, a load issued only once another has arrived waits again."""
    now, ready, trips, start = 0, [0] * 6, 0, 0
    for _ in range(4):  # the fourth iteration is the one measured
        start, trips = now, 0
        for ins in body:
            due = max([ready[b] for b in range(6) if ins.waits >> b & 1], default=now)
            if due - now > latency // 4:
                trips += 1
            now = max(now, due)
            if ins.writes is not None:
                done = now + (latency if ins.opcode.startswith("LDG") else 20)
                ready[ins.writes] = max(ready[ins.writes], done)
            if ins.reads is not None:
                ready[ins.reads] = max(ready[ins.reads], now + 15)
            now += max(ins.stall, 1)
    return trips, now - start


def split_sum_loads(cubin: bytes) -> tuple[int, int]:
    """``(loads, before)``: how many loads of the split-K partials (``.cg``: ``LDG.E.STRONG.GPU``)
    the program that arrives last issues, and how many of them come before its first add. A
    loop over the splits issues one, waits for it, adds: 1; unrolled, all of them."""
    names = [m.group(1) for line in _disassembly(cubin) if (m := _OPCODE.match(line))]
    loads = [i for i, name in enumerate(names) if name.startswith("LDG.E.STRONG.GPU")]
    first_add = next((i for i in range(loads[0], len(names)) if names[i] == "FADD"), len(names))
    return len(loads), sum(i < first_add for i in loads)


def _loop_lines(cubin: bytes) -> Sequence[str]:
    """The disassembly's lines of the longest backward-branch loop of a cubin."""
    lines = _disassembly(cubin)
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:$", line)}
    best: Sequence[str] = ()
    for i, line in enumerate(lines):
        # a loop's back edge is predicated; an unconditional backward branch returns from an
        # out-of-line block (a TMA wait spinning on its barrier) into the loop
        match = re.search(r"@!?U?P\w+\s+BRA `\((\.L_x_\d+)\)", line)
        if match and labels.get(match.group(1), i) < i and i - labels[match.group(1)] > len(best):
            best = lines[labels[match.group(1)] : i + 2]  # (and the branch's encoding)
    return best


def loop_instructions(cubin: bytes, suffixes: bool = False) -> list[str]:
    """Opcodes of the longest backward-branch loop of a cubin (``suffixes``: with their
    modifiers, ``LDG.E.128``)."""
    ops = [m.group(1) for line in _loop_lines(cubin) if (m := _OPCODE.match(line))]
    return ops if suffixes else [op.split(".")[0] for op in ops]


def word_load_positions(ops: list[str]) -> list[int]:
    """Where a decode loop issues its tiles' words (16-byte global loads, ``LDG.E.128``): for
    each batch, the percentage of the loop's FFMAs issued before it. A loop that loads a tile
    and then decodes it has one batch at 0; one that loads the next tile while this one decodes
    has a batch at 0 and one near 50 (two tiles a step)."""
    total, seen, positions = ops.count("FFMA"), 0, []
    for op in ops:
        seen += op == "FFMA"
        position = round(100 * seen / max(total, 1))
        if op.startswith("LDG.E.128") and (not positions or positions[-1] != position):
            positions.append(position)
    return positions


def add_latency_option(parser: argparse.ArgumentParser) -> None:
    """``--latency``: the cycles a global load takes in :func:`replay` (this tool's and
    ``kernel_sass_mixed.py``'s tables)."""
    parser.add_argument("--latency", type=int, default=800,
                        help="cycles a global load takes in the round-trip model (default 800)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--spqr", action="store_true", help="the SpQR kernel's table instead")
    parser.add_argument("--split-sums", action="store_true",
                        help="how each GEMV's last program loads the split-K partials instead")  # fmt: skip
    add_latency_option(parser)
    parser.add_argument("--even-k", action="store_true",
                        help="decode kernels compiled for K a multiple of the tile's codes "
                             "(unmasked activation loads, as the launcher picks for such K)")  # fmt: skip
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    print(compiler_line(args.arch))
    if args.spqr:
        spqr_table(args.arch, args.latency)
        return
    if args.split_sums:
        split_sum_table(args.arch)
        return
    print("| kernel | bits | x | zeros | BLOCK_M | BLOCK_N | warps | stages | shared bytes | "
          "loop instrs | per code | barriers per tile | words loaded at | round trips per tile | "
          "lone-warp cycles per tile | most frequent |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = [("decode", bm, bn, w, "fp16", sym, 1)
            for bm, bn, w in ((1, 64, 4), (1, 128, 4)) for sym in (True, False)]  # fmt: skip
    # the pipelined tile loop (TMA from sm_90), 3 and 4 stages
    runs += [("decode", 1, bn, w, "fp16", sym, st) for bn, w, sym, st in
             ((128, 4, True, 3), (128, 4, False, 3), (128, 4, True, 4), (128, 8, True, 3),
              (64, 4, True, 3))]  # fmt: skip
    # the next tile's words in registers (two tiles a loop iteration)
    runs += [("decode", 1, 128, w, "fp16", sym, 2) for w in (4, 8) for sym in (True, False)]
    # bf16 at M = 1: the same subnormal codes, x scaled otherwise
    runs += [("decode", 1, 128, w, "bf16", True, st) for w, st in ((4, 1), (4, 2), (8, 2))]
    runs += [("decode", 16, bn, w, "fp16", True, 1) for bn, w in ((64, 4), (128, 4), (128, 8))]
    runs += [("decode", 16, 64, 4, "fp16", True, 3), ("decode", 16, 128, 4, "bf16", True, 1)]
    runs += [("prefill", 128, 128, 8, dt, True, 2) for dt in ("fp16", "bf16")]  # 2: it fits
    for bits in args.bits:
        for name, block_m, block_n, warps, dtype, sym, stages in runs:
            if name == "decode":
                kernel = compile_decode_kernel(bits, block_m, block_n, warps, args.arch, dtype,
                                               symmetric=sym, even_k=args.even_k,
                                               stages=stages)  # fmt: skip
            else:
                kernel = compile_prefill_kernel(bits, block_m, block_n, warps, args.arch, dtype,
                                                num_stages=stages)  # fmt: skip
            full = loop_instructions(kernel.asm["cubin"], suffixes=True)
            ops = [op.split(".")[0] for op in full]
            tiles = 2 if name == "decode" and stages == 2 else 1  # tiles a loop iteration
            codes_per_thread = tiles * block_n * 32 * (32 // bits) / (32 * warps)
            barriers = sum(op == "BAR" for op in ops) / tiles
            loads = ", ".join(map(str, word_load_positions(full))) if name == "decode" else "-"
            trips, cycles = memory_round_trips(kernel.asm["cubin"], args.latency)
            top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(6))
            print(f"| {name} | {bits} | {dtype} | {'no' if sym else 'yes'} | {block_m} | "
                  f"{block_n} | {warps} | {stages} | {kernel.metadata.shared} | {len(ops)} | "
                  f"{len(ops) / codes_per_thread:.2f} | {barriers:g} | {loads or '-'} | "
                  f"{trips / tiles:g} | {cycles / tiles:.0f} | {top} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
