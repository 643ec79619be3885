"""``tools/gpu_smoke.py``, the first stage of a GPU session, runs every kernel it launches on the
GPU in Triton's interpreter here on a small weight: its calls still fit the kernels' wrappers
(a broken smoke stage would cost a device call), and each product is within the tolerance the
stage enforces."""

import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gpu_smoke  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="the GPU runs the tool itself"),
]


def test_every_kernel_of_the_smoke_stage_runs_and_matches_its_reference():
    rows = list(gpu_smoke.smoke_rows("cpu", n=40, k=256, prefill_rows=20))
    # 5 int formats x dtypes x (M + the weight decoder), the four M = 1 candidates with another
    # tile loop (two register-prefetching, two pipelined) for 4 bits (sym, asym) at fp16, SpQR
    # and 2/4/16 at M 1 (fp16, bf16), 16 and their weight decoders, 2/4/16 with outliers 11008
    # wide
    assert len(rows) == 5 * 2 * 4 + 2 * 4 + 4 + 4 + 1
    assert sum("stages" in row[0] for row in rows) == 8
    assert sum("weight decoder" in row[0] for row in rows) == 5 * 2 + 2
    for name, _, compiled, err, dtype in rows:
        assert compiled is None  # interpreted: nothing compiled
        assert err <= gpu_smoke.TOL[str(dtype).removeprefix("torch.")], name
