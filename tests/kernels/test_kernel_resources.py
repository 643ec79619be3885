"""Every Triton kernel and every launch configuration its tuner may time fits an H100.

``tools/kernel_resources.py`` compiles each for sm_90 with Triton's own ptxas (no GPU) and reads
the resources back from the cubin; a configuration with more shared memory than a block may
have (232,448 bytes), whose registers leave no block resident, or that spills to local memory,
fails here instead of being skipped by the tuner on the first GPU. It runs in a fresh process
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1``, under which nothing compiles); measured
about 90 s on this 2-core CPU with an empty Triton cache, a few seconds with a warm one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from lowbit.kernels.triton_support import (  # noqa: E402
    SM90,
    Resources,
    blocks_per_sm,
    launch_refusal,
    split_for,
)

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from kernel_resources import cubin_resources, resource_rows
from kernel_sass import compile_decode_kernel
rows = [dict(row, resources=vars(row["resources"])) for row in resource_rows(90)]
# the 16-row integer default compiled for an A100 (sm_80): slot by slot, as it launches there
a100 = compile_decode_kernel(4, 16, 128, 4, 80, symmetric=False, split_k=4, has_bias=True)
print(json.dumps({"rows": rows, "sm_80 spill": cubin_resources(a100).spill}))
"""


def test_blocks_per_sm_follows_the_h100_occupancy_table():
    # 128 registers x 128 threads: 16384 registers a block, 4 blocks in 65536
    assert blocks_per_sm(Resources(128, 1536, 0, 4)) == 4
    # 255 registers round up to 256 a thread: 8192 a warp, 8 warps an SM
    assert blocks_per_sm(Resources(255, 0, 0, 8)) == 1
    assert blocks_per_sm(Resources(255, 0, 0, 1)) == 8
    # shared memory: 233472 bytes an SM, 1024 reserved per block
    assert blocks_per_sm(Resources(32, 115_000, 0, 4)) == 2
    assert blocks_per_sm(Resources(32, 116_000, 0, 4)) == 1
    assert blocks_per_sm(Resources(32, 0, 0, 1)) == SM90.blocks  # 32 blocks at most
    assert blocks_per_sm(Resources(32, 232_449, 0, 4)) == 0
    assert "shared memory" in launch_refusal(Resources(32, 237_568, 0, 8))
    assert "spills" in launch_refusal(Resources(255, 1024, 176, 8))
    assert launch_refusal(Resources(248, 139_264, 0, 4)) is None


def test_split_k_fills_one_wave_without_a_tail():
    # 28672 rows in blocks of 128: 224 programs; 396 resident -> one split (no 448-program grid)
    assert split_for(224, 64, 396) == 1
    assert split_for(32, 32, 264) == 8  # 4096 rows: 8 splits fill 256 of 264 slots
    assert split_for(32, 4, 264) == 4  # never more splits than K tiles
    assert split_for(1000, 8, 264) == 1


def test_every_kernel_and_tuning_candidate_launches_on_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "tools")],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    if run.returncode != 0 and "No such file" in run.stderr:
        pytest.skip("this Triton build ships no ptxas or cuobjdump")
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # two slots a dot (int_gemv's PAIRS) spilled 64 bytes a thread there: sm_90 only
    assert got["sm_80 spill"] == 0
    rows = got["rows"]
    kernels = {row["kernel"] for row in rows}
    assert {
        "int decode",
        "int prefill",
        "spqr decode",
        "2/4/16 decode",
        "KV decode scores",
        "KV decode accumulate",
    } <= kernels
    assert len(rows) >= 20
    for row in rows:
        name = f"{row['kernel']} {row['config']} {row['variant']}"
        assert row["refusal"] is None, f"{name}: {row['refusal']}"
        assert row["blocks"] >= 1 and row["resources"]["spill"] == 0, name
