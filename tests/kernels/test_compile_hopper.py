"""Every Triton kernel compiles for an H100 (sm_90) without a GPU.

The interpreter tests check what the kernels compute, but the interpreter runs them as Python:
a constexpr missing from a launch, a type the compiler rejects or a helper that only works
interpreted pass there and fail on the first CUDA call. This compiles each kernel — integer
decode (2, 3 and 4 bits, M = 1 and 16, split-K with bias), integer prefill, SpQR, the 2/4/16
GEMV (async and sync, split-K with bias) and its 16-row kernel, and the three formats' weight
decoders — through Triton's own ptxas to SASS (``tools/kernel_sass*.py``) and checks that each
has its main loop (the decoders, which have none, their 16-byte stores; the pipelined integer
decode, its asynchronous copies, by TMA from sm_90; the register-prefetching one, its word loads
a tile ahead of their use).
It runs in a fresh process because ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``, under
which ``@triton.jit`` builds interpreted functions that cannot be compiled.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from kernel_sass import (compile_decode_kernel, compile_dequant_kernel, compile_prefill_kernel,
                         compile_spqr_dense_kernel, compile_spqr_kernel, loop_instructions,
                         memory_round_trips, split_sum_loads, word_load_positions)
from kernel_sass_mixed import compile_mixed, compile_mixed_dequant

kernels = {
    "decode 4-bit M=1": lambda: compile_decode_kernel(4, 1, 128, 4, 90),
    "decode 3-bit M=16 split 4 bias bf16": lambda: compile_decode_kernel(
        3, 16, 64, 4, 90, dtype="bf16", split_k=4, has_bias=True),
    "decode 4-bit M=16": lambda: compile_decode_kernel(4, 16, 128, 4, 90, even_k=True),
    "decode 2-bit M=16 bf16 asym": lambda: compile_decode_kernel(
        2, 16, 64, 4, 90, dtype="bf16", symmetric=False, even_k=True),
    "prefill 4-bit": lambda: compile_prefill_kernel(4, 64, 64, 4, 90),
    "spqr M=1 split 2 bias": lambda: compile_spqr_kernel(1, 8, 8, 4, 90, split_k=2,
                                                         has_bias=True),
    "mixed M=1 async fused split 2 bias": lambda: compile_mixed(
        1, 128, 2, 1, True, True, 90, split_k=2, has_bias=True),
    "mixed M=1 sync": lambda: compile_mixed(1, 128, 2, 1, False, False, 90),
    "mixed M=1 async fused bf16": lambda: compile_mixed(1, 128, 2, 1, True, True, 90,
                                                        dtype="bf16"),
    "mixed M=16 async fused": lambda: compile_mixed(16, 64, 16, 4, True, True, 90),
}
loops = {name: len(loop_instructions(make().asm["cubin"])) for name, make in kernels.items()}
# the prefill weight decoder has no loop (one K tile per program): its 16-byte stores instead
dequant = compile_dequant_kernel(4, 64, 90, dtype="bf16", symmetric=False)
loops["dequant stores"] = dequant.asm["ptx"].count("st.global.v4") if dequant.asm["cubin"] else 0
# SpQR's decoder: each thread's 16 weights of a word as 32 contiguous bytes, no 2-byte store
spqr_dense = compile_spqr_dense_kernel(90).asm["ptx"]
loops["spqr dense stores"] = [spqr_dense.count("st.global.v4"), spqr_dense.count("st.global.b16")]
# the 2/4/16 decoder: each group's 16 fp32 weights of a row as 16-byte vectors
mixed_dense = compile_mixed_dequant(90).asm["ptx"]
loops["mixed dense stores"] = [mixed_dense.count("st.global.v4"), mixed_dense.count("st.global.b32")]
# the pipelined tile loop (STAGES = 3) copies the next tiles' words with cp.async before sm_90
piped = compile_decode_kernel(4, 1, 128, 4, 90, even_k=True, stages=3, tma=False)
loops["pipelined cp.async"] = piped.asm["ptx"].count("cp.async.")
# and by TMA from sm_90, on a split that runs past the last tile: its loop's opcodes
tma = compile_decode_kernel(4, 1, 128, 4, 90, split_k=3, even_k=True, stages=3)
loops["pipelined TMA loop"] = loop_instructions(tma.asm["cubin"], suffixes=True)
# the register prefetch (STAGES = 2, two tiles a step): where the words are loaded, as % of
# the step's FFMAs before them, on a split that runs past the last tile and K not a whole tile
prefetch = compile_decode_kernel(4, 1, 128, 8, 90, split_k=3, stages=2, symmetric=False)
ops = loop_instructions(prefetch.asm["cubin"], suffixes=True)
loops["prefetch loads at"] = word_load_positions(ops)
# the split-K sum of the last program (32 splits): every partial's load issued before the
# first add
loops["split sums"] = [
    split_sum_loads(compile_mixed(1, 128, 2, 1, True, True, 90, split_k=32).asm["cubin"]),
    split_sum_loads(compile_decode_kernel(4, 1, 128, 4, 90, split_k=32).asm["cubin"]),
]
# how often a lone warp waits for memory a tile, one round trip after another (the model of
# tools/kernel_sass.py), 4-bit g128 whole tiles at M = 1 and 16
loops["round trips"] = [
    memory_round_trips(compile_decode_kernel(4, m, 128, 4, 90, even_k=True).asm["cubin"])[0]
    for m in (1, 16)
] + [
    memory_round_trips(compile_spqr_kernel(16, 8, 16, 4, 90).asm["cubin"])[0],
    memory_round_trips(compile_mixed(16, 64, 16, 4, True, True, 90).asm["cubin"])[0],
    memory_round_trips(compile_prefill_kernel(4, 64, 64, 4, 90).asm["cubin"])[0],
]
print(json.dumps(loops))
"""


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "tools")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if run.returncode != 0 and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("this Triton build ships no ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    loops = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(loops) == 18
    # a tile's scales loaded with its words (integer M = 1) and the activations (the scales,
    # for the prefill) before the barriers of the dots that take them (integer, SpQR and
    # 2/4/16 at M = 16, integer prefill): measured [2, 2, 2, 17, 1], [4, 9, 32, 65, 8] when
    # each was loaded where it is used
    trips = loops.pop("round trips")
    assert all(got <= bound for got, bound in zip(trips, [2, 2, 4, 20, 2], strict=True)), trips
    # 32 splits x 4 rows a thread (2/4/16) and x 1 (integer), all loaded before they are
    # summed: as a loop over the splits, LLVM unrolled the integer one but left 2/4/16's
    # rolled, a load and a wait for it per split ([4, 4]: the loop body's loads)
    assert loops.pop("split sums") == [[128, 128], [32, 32]]
    # TMA: one bulk copy a tile, no word loaded by a thread from global memory, x kept out of
    # the pipeline (a tl.load of x went through shared memory: 11 barriers a tile, measured 3)
    ops = loops.pop("pipelined TMA loop")
    assert sum(op.startswith("UTMALDG") for op in ops) == 1, ops
    assert not any(op.startswith("LDG.E.128") for op in ops)
    assert sum(op == "BAR.SYNC.DEFER_BLOCKING" for op in ops) <= 3
    # 256 codes a thread a tile: measured 3.64 a code (3.50 where the splits end at the last
    # tile: here each x of a tile past K is zeroed)
    assert len(ops) <= 3.7 * 256, len(ops)
    # each tile's words are issued before the other tile's decode, not just before their own
    # (ptxas moves them there without the kernel's store-that-never-runs): measured [0, 50]
    at = loops.pop("prefetch loads at")
    assert len(at) == 2 and at[0] <= 5 and 35 <= at[1] <= 65, at
    assert loops.pop("spqr dense stores") == [2, 0]  # measured (was [0, 16])
    assert loops.pop("mixed dense stores") == [20, 0]  # 10 groups a program (scalar: [0, 80])
    stores = loops.pop("dequant stores")
    assert stores >= 8, stores  # 16-byte stores, at least one per slot (measured 16: two per slot)
    assert loops.pop("pipelined cp.async") > 0  # measured 84 (copies, commits and waits)
    # SpQR's fp16 GEMV (8 x 16 rows x 8 tiles, 128 codes a thread): an and and an FMA per code
    # at least; above 5 a code the codes are no longer multiplied as subnormals or a thread's
    # words span several tile columns (measured 4.49; 6.43 with the exponent trick's FADD, 7.3
    # with the words' layout Triton 3.6 chose for a [TR, 16, G] load)
    assert 2 * 128 <= loops["spqr M=1 split 2 bias"] <= 5 * 128, loops
    # 2/4/16's bf16 GEMV (a step: two 64-code words of each of a thread's 4 rows, 512 codes):
    # measured 4.47 a code, fp16's count (4.61 with bf16 x widened from named 16-bit halves)
    assert loops["mixed M=1 async fused bf16"] <= 4.5 * 512, loops
    # the 16-row integer kernel (256 codes a thread a tile, 4-bit 128 rows and 2-bit 64 rows):
    # two slots' codes a dot, a PRMT, a LOP3 and an HFMA2 for two codes (measured 2.62 and 3.66
    # a code under Triton 3.9; 3.77 and 5.34 with a shift, a mask, a repack and half a
    # subtraction per code)
    assert loops["decode 4-bit M=16"] <= 2.8 * 256, loops
    assert loops["decode 2-bit M=16 bf16 asym"] <= 4.0 * 256, loops
    for name, instructions in loops.items():
        assert instructions > 50, name  # a real main loop (measured 575 to 5623 instructions)
