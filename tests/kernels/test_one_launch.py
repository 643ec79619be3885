"""A packed linear call at M <= 16 is one kernel launch for every format: split-K partial sums,
the bias and the cast to the output dtype happen inside the kernel (the last program of each
output tile sums the tile's partials in split order), with no torch compute around it.

Runs in Triton's interpreter (``tests/conftest.py``) on irregular shapes with SPLIT_K forced
above 1: launches are counted at the interpreter's kernel entry, torch operators with a
dispatch mode, and the products checked against the reference backend.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402

from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize  # noqa: E402
from lowbit.algorithms.spqr import SpQRSpec  # noqa: E402
from lowbit.formats.intq import IntQuantized  # noqa: E402
from lowbit.kernels import int_gemv, mixed_gemv, split_k, spqr_gemv  # noqa: E402
from lowbit.kernels.triton_support import LaunchRefused  # noqa: E402
from lowbit.nn.mixed_linear import MixedLinear  # noqa: E402
from lowbit.nn.packed_linear import PackedLinear  # noqa: E402
from lowbit.nn.spqr_linear import SpQRLinear  # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)
pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRET, reason="counts launches in Triton's interpreter"),
]
N = 37  # three output tiles of 16 rows, the last one partial
# as tests/kernels/test_triton_int.py: |kernel - reference| <= TOL * max|reference|
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# torch operators a call may dispatch: allocations and views, nothing that computes
ALLOWED = {"empty.memory_format", "view.default", "_unsafe_view.default", "alias.default"}


class _Calls(TorchDispatchMode):
    """Kernel launches (names) and the torch operators dispatched outside them."""

    def __init__(self):
        super().__init__()
        self.launches, self.ops, self.inside = [], [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:  # the interpreter's own copies of a launch's arguments are not
            self.ops.append(str(func.__name__))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def calls(monkeypatch):
    recorder = _Calls()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        recorder.launches.append((self.fn.__name__, kwargs.get("SPLIT_K")))
        recorder.inside = True
        try:
            return run(self, *args, **kwargs)
        finally:
            recorder.inside = False

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    return recorder


def _int_layer(m):  # K = 800: four 256-code tiles, the last partial
    gen = torch.Generator().manual_seed(0)
    q = IntQuantized.from_float(torch.randn(N, 800, generator=gen), 4, group_size=32,
                                symmetric=False, scale_dtype=torch.float16)  # fmt: skip
    b = torch.randn(N, generator=gen)
    return PackedLinear.from_quantized(q, b, backend="triton"), PackedLinear.from_quantized(
        q, b, backend="reference"
    )


def _spqr_layer(m):  # K = 264: 17 tile columns, chunks of 4 (M = 1) or 16 (M = 5)
    gen = torch.Generator().manual_seed(1)
    q = SpQRSpec(outlier_fraction=0.05).rtn(torch.randn(N, 264, generator=gen))
    b = torch.randn(N, generator=gen)
    return SpQRLinear.from_quantized(q, b, backend="triton"), SpQRLinear.from_quantized(
        q, b, backend="reference"
    )


def _mixed_layer(m):  # 10 words per row at M = 1 (steps of 2), 32 at M = 5 (tiles of 16)
    gen = torch.Generator().manual_seed(2)
    spec = MixedWeightSpec(frac_4bit=0.25, outlier_fraction=0.01, g2=8)
    q = mixed_quantize(torch.randn(N, 640 if m == 1 else 2048, generator=gen) * 0.02, None,
                       spec).quantized  # fmt: skip
    b = torch.randn(N, generator=gen) * 0.02
    return MixedLinear.from_quantized(q, b, backend="triton"), MixedLinear.from_quantized(
        q, b, backend="reference"
    )


def _force_splits(monkeypatch):
    """Launch configurations with several splits and several output tiles (N = 37 rows in
    blocks of 16), instead of the interpreter's single split."""
    monkeypatch.setattr(int_gemv, "_choose", lambda args, m, n_tiles, tune: (
        (1 if m == 1 else 16), 16, 3, 4, 1))  # fmt: skip
    monkeypatch.setattr(int_gemv, "_TUNED", {})
    monkeypatch.setattr(spqr_gemv, "_choose", lambda args, m, n_groups: (
        (1, 1, 4, 3, 4) if m == 1 else (16, 1, 16, 2, 4)))  # fmt: skip
    monkeypatch.setattr(spqr_gemv, "_TUNED", {})
    monkeypatch.setattr(mixed_gemv, "_choose", lambda x, ops, bias, a, f, tune: (
        (1, 16, 2, 3, 1) if x.shape[0] == 1 else (16, 16, 16, 2, 4)))  # fmt: skip
    monkeypatch.setattr(mixed_gemv, "_TUNED", {})


@pytest.mark.parametrize("make", [_int_layer, _spqr_layer, _mixed_layer],
                         ids=["int4-asym-g32", "spqr-3bit", "mixed-2-4"])  # fmt: skip
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_one_launch_per_call_with_splits_bias_and_cast_inside(make, m, dtype, calls, monkeypatch):
    _force_splits(monkeypatch)
    fast, reference = make(m)
    fast, reference = fast.to(dtype=dtype), reference.to(dtype=dtype)
    x = torch.randn(m, fast.in_features, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = reference(x)
    fast(x)  # prepares the layout (prepare-time work is not counted)
    calls.launches.clear()
    with calls:
        got = fast(x)
    assert len(calls.launches) == 1, calls.launches
    assert calls.launches[0][1] > 1  # a split launch
    assert set(calls.ops) <= ALLOWED, calls.ops
    assert got.dtype == dtype and got.shape == (m, N)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= TOL[dtype]
    # the split sum is in a fixed order: a second call is the same bit for bit, and the
    # tiles' arrival counters are back to zero
    assert torch.equal(fast(x), got)
    assert int(split_k._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.parametrize("make", [_int_layer, _spqr_layer, _mixed_layer],
                         ids=["int4-asym-g32", "spqr-3bit", "mixed-2-4"])  # fmt: skip
@pytest.mark.parametrize("m", [1, 5])
def test_a_gemv_that_cannot_launch_leaves_the_decoded_weight_path(make, m, monkeypatch):
    """When no launch configuration of a layer's GEMV kernel runs (every one refused by the
    device), the layer warns once with the reason and computes the product from its decoded
    weight; later calls do not try the kernel again."""
    tried = []

    def refuse(*args, **kwargs):
        tried.append(1)
        raise LaunchRefused("no launch configuration runs here ((1, 128): it spills 8 bytes)")

    for module in (int_gemv, spqr_gemv, mixed_gemv):
        monkeypatch.setattr(module, "_choose", refuse)
        monkeypatch.setattr(module, "_TUNED", {})
    fast, reference = make(m)
    fast, reference = fast.to(dtype=torch.float16), reference.to(dtype=torch.float16)
    x = torch.randn(m, fast.in_features, generator=torch.Generator().manual_seed(3)).half()
    with pytest.warns(UserWarning, match="cannot launch .*it spills 8 bytes.*F.linear"):
        got = fast(x)
    want = reference(x)
    assert (got.float() - want.float()).abs().max() / want.float().abs().max() <= TOL[x.dtype]
    assert torch.equal(fast(x), got) and len(tried) == 1  # no second try, no second warning
