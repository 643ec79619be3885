"""GPTQ's compiled column loop (lowbit.algorithms.gptq_native, gptq_columns.c) against the torch
loop it replaces: the same containers bit for bit, integer grids and llama.cpp's block grids."""

import shutil

import pytest
import torch

from lowbit.algorithms import gptq_native
from lowbit.algorithms.gguf_spec import GGUFWeightSpec
from lowbit.algorithms.gptq import GPTQSettings, gptq_quantize
from lowbit.algorithms.int_spec import IntWeightSpec

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

OUT = 96  # a multiple of 32: torch's addr_ fuses every output's update (see gptq_native)


def _problem(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) / n**0.5
    x = torch.randn(4 * n, n, generator=g) @ (torch.eye(n) + 2 * mix)  # correlated inputs
    x[:, 5] = 0.0  # a dead input
    w = torch.randn(OUT, n, generator=g) * (1 + 3 * (torch.rand(n, generator=g) > 0.9))
    return w, 2 * x.T @ x / x.shape[0]  # [out, n], [n, n]


def _torch_rank1_is_fused() -> bool:
    """Whether torch's addr_ rounds c - u * e once (its vectorized kernels) on this CPU."""
    g = torch.Generator().manual_seed(1)
    c, u, e = (
        torch.randn(4, OUT, generator=g),
        torch.randn(4, generator=g),
        torch.randn(OUT, generator=g),
    )
    fused = (c.double() - u.double()[:, None] * e.double()).float()
    return torch.equal(c.clone().addr_(u, e, alpha=-1.0), fused)


def _both(monkeypatch, run):
    """run() with the compiled loop, then with the torch loop; the calls counted."""
    calls = []
    compiled = gptq_native.quantize_columns

    def counted(*args):
        calls.append(compiled(*args))
        return calls[-1]

    monkeypatch.setattr(gptq_native, "quantize_columns", counted)
    fast = run()
    assert calls and all(calls)  # the compiled loop ran, every segment
    monkeypatch.setattr(gptq_native, "quantize_columns", lambda *args: False)
    return fast, run()


@pytest.mark.parametrize(
    "spec, act_order, static, block_size",
    [
        (IntWeightSpec(4, None, True), True, None, 128),
        (IntWeightSpec(4, 32, False), False, False, 48),  # dynamic groups across GPTQ blocks
        (IntWeightSpec(3, 32, False), True, True, 128),
        (IntWeightSpec(2, 64, True), False, True, 40),
        (IntWeightSpec(8, None, False), False, None, 128),
    ],
    ids=["w4-channel-act", "w4-g32-dynamic", "w3-g32-static-act", "w2-g64-static", "w8-asym"],
)
def test_int_gptq_compiled_equals_the_torch_loop(monkeypatch, spec, act_order, static, block_size):
    if not _torch_rank1_is_fused():
        pytest.skip("torch's addr_ does not fuse its update on this CPU")
    w, h = _problem(192)

    def run():
        return gptq_quantize(w, h, spec, act_order=act_order, static_groups=static,
                             block_size=block_size)  # fmt: skip

    fast, slow = _both(monkeypatch, run)
    assert torch.equal(fast.weight, slow.weight)
    for field in ("qdata", "scale", "zero"):
        a, b = getattr(fast.quantized, field), getattr(slow.quantized, field)
        assert (a is None and b is None) or torch.equal(a, b), field


@pytest.mark.parametrize("name, act_order", [("Q4_0", False), ("Q4_1", True), ("Q4_K", False),
                                              ("Q6_K", True), ("Q2_K", False)])  # fmt: skip
def test_gguf_gptq_compiled_equals_the_torch_loop(monkeypatch, name, act_order):
    if not _torch_rank1_is_fused():
        pytest.skip("torch's addr_ does not fuse its update on this CPU")
    spec = GGUFWeightSpec(name)
    w, h = _problem(512 if spec.type_name.endswith("_K") else 128)

    def run():
        return spec.gptq(w, h, GPTQSettings(act_order=act_order))

    (fast, fast_values, _), (slow, slow_values, _) = _both(monkeypatch, run)
    assert torch.equal(fast_values, slow_values)
    assert torch.equal(fast.codes, slow.codes)
    for field in ("scale", "minimum"):
        a, b = getattr(fast.grid(), field)(), getattr(slow.grid(), field)()
        assert (a is None and b is None) or torch.equal(a, b), field


def test_non_uniform_levels_stay_on_the_torch_loop(monkeypatch):
    """IQ4_NL's levels are not consecutive integers: no compiled call."""
    monkeypatch.setattr(gptq_native, "quantize_columns", lambda *a: pytest.fail("called"))
    w, h = _problem(64)
    GGUFWeightSpec("IQ4_NL").gptq(w, h, GPTQSettings(act_order=False))


@pytest.mark.parametrize("grid", ["int-asym", "int-sym", "levels-affine", "levels-symmetric"])
def test_a_run_of_columns_updates_the_block_as_the_torch_steps_do(grid):
    """The kernel alone: codes, values, errors and the updated block bit for bit against the
    torch steps (a difference in one update's last bit shows here even where no code flips)."""
    if not _torch_rank1_is_fused():
        pytest.skip("torch's addr_ does not fuse its update on this CPU")
    from lowbit.formats.gguf_blocks import BLOCK_TYPES, round_to_grid

    g = torch.Generator().manual_seed(2)
    b, groups = 24, 3
    w, h = _problem(b)
    block = w.T.contiguous() * 3  # [b, out]
    upper = torch.linalg.cholesky(torch.linalg.inv(h.double() + torch.eye(b))).T.float()
    block_u = upper.T.contiguous().T  # [b, b], a transposed view as GPTQ's is
    rows = torch.arange(b) % groups
    s = (torch.rand(groups, OUT, generator=g) + 0.2).half().float()
    s[1, :5] = 0.0  # a zero scale: rounded with 1 (levels grids)
    z = torch.randint(0, 8, (groups, OUT), generator=g).float()
    a = torch.reciprocal(s)
    kind = BLOCK_TYPES["Q4_K" if grid == "levels-affine" else "Q3_K"]
    if grid.startswith("levels"):
        z = -(torch.rand(groups, OUT, generator=g)) if kind.affine else None
        args = (gptq_native.GRID_LEVELS, None, s, z, float(kind.levels[0]), len(kind.levels) - 1.0)
    else:
        s[1, :5] = 1.0
        a = torch.reciprocal(s)
        z = z if grid == "int-asym" else None
        qmin, qmax = (0.0, 7.0) if z is not None else (-4.0, 3.0)
        args = (gptq_native.GRID_INT, a, s, z, qmin, qmax)
    s[0, :4] = 0.5  # column 3's first outputs land halfway between two levels: ties
    a = torch.reciprocal(s)
    block[3, :4] = 1.25 + (0.0 if z is None else z[0, :4])
    args = (args[0], None if args[1] is None else a, s, *args[3:])
    want = block.clone()
    out = [torch.empty(b, OUT) for _ in range(3)]  # errors, codes, values
    assert gptq_native.quantize_columns(block, block_u, 3, 20, *out, rows, *args)
    ref = [torch.zeros(b, OUT) for _ in range(3)]
    for i in range(3, 20):
        r, x = int(rows[i]), want[i]
        if grid.startswith("levels"):
            q, dq = round_to_grid(x, kind, s[r], None if z is None else z[r])
        else:
            q = torch.round(x * a[r]) + (z[r] if z is not None else 0)
            q = q.clamp(args[-2], args[-1])
            dq = (q - z[r]) * s[r] if z is not None else q * s[r]
        err = (x - dq) / block_u[i, i]
        want[i:].addr_(block_u[i, i:], err, alpha=-1.0)
        ref[0][i], ref[1][i], ref[2][i] = err, q.float(), dq
    assert torch.equal(block, want)
    for mine, theirs in zip(out, ref, strict=True):
        assert torch.equal(mine[3:20], theirs[3:20])
