"""RTN and GPTQ onto llama.cpp's block grids (lowbit.algorithms.gguf_spec)."""

import pytest
import torch

from lowbit.algorithms.gguf_spec import GGUFWeightSpec
from lowbit.algorithms.gptq import GPTQSettings
from lowbit.errors import LowbitError
from lowbit.formats.gguf_blocks import BLOCK_TYPES


def _problem(out=48, n=128, tokens=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) / n**0.5
    x = torch.randn(tokens, n, generator=g) @ (torch.eye(n) + 2 * mix)  # correlated inputs
    w = torch.randn(out, n, generator=g)
    return w, 2 * x.T @ x / tokens  # [out, n], [n, n]


def _output_error(w, wq, h):
    delta = w - wq
    return float(((delta @ h) * delta).sum())


CASES = [(name, False) for name in BLOCK_TYPES]
CASES += [(name, True) for name in BLOCK_TYPES if BLOCK_TYPES[name].block == 32] + [("Q4_K", True)]


@pytest.mark.parametrize("name, act_order", CASES)
def test_gptq_weight_is_its_container_and_beats_rtn(name, act_order):
    w, h = _problem(n=128 if BLOCK_TYPES[name].block == 32 else 512)
    spec = GGUFWeightSpec(name)
    container, values, damp = spec.gptq(w, h, GPTQSettings(act_order=act_order))
    assert torch.equal(values, container.dequantize())  # bit for bit
    assert spec.matches(container) and damp == 0.01
    rtn = spec.rtn(w).dequantize()
    # measured on this problem: GPTQ's output error is 0.46x (Q4_0) to 0.57x (Q4_1 and Q8_0,
    # act-order) RTN's; the K types 0.41x (Q3_K) to 0.52x (Q2_K) at width 512
    assert _output_error(w, values, h) < 0.8 * _output_error(w, rtn, h)


def test_width_not_a_multiple_of_32_is_one_sentence():
    with pytest.raises(LowbitError, match="not a multiple of 32"):
        GGUFWeightSpec("Q4_0").check(torch.zeros(4, 48), "blk.q_proj")


def test_a_k_type_needs_rows_of_256():
    with pytest.raises(LowbitError, match="Q4_K stores blocks of 256 weights; the input width 576"):
        GGUFWeightSpec("Q4_K").check(torch.zeros(4, 576), "blk.q_proj")


@pytest.mark.parametrize("name", ["Q4_0", "IQ4_NL", "Q4_K"])
def test_gptq_fits_each_grid_weighted_by_input_energy(name, monkeypatch):
    import lowbit.algorithms.gguf_spec as gguf_spec

    n = 128 if BLOCK_TYPES[name].block == 32 else 512
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, n, generator=g) * torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)]
    w, h = torch.randn(48, n, generator=g), 2 * x.T @ x / 512  # inputs of 100x uneven energy
    spec = GGUFWeightSpec(name)
    weighted = _output_error(w, spec.gptq(w, h, GPTQSettings())[1], h)
    fit = gguf_spec.fit_grid
    monkeypatch.setattr(gguf_spec, "fit_grid", lambda b, kind, importance=None: fit(b, kind))
    unweighted = _output_error(w, spec.gptq(w, h, GPTQSettings())[1], h)
    # measured: 0.87x (Q4_0), 0.80x (IQ4_NL), 0.63x (Q4_K) the unweighted fit's output error
    assert weighted < 0.9 * unweighted


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_refit_recovers_the_numbers_of_a_weight_on_its_grid(name):
    from lowbit.algorithms.gguf_spec import refit_block_numbers
    from lowbit.formats.gguf_blocks import GGUFQuantized

    w, h = _problem(out=16, n=128 if BLOCK_TYPES[name].block == 32 else 512, seed=1)
    on_grid = GGUFWeightSpec(name).rtn(w)
    target = on_grid.dequantize()  # a weight exactly on its grid: zero output error
    off = GGUFQuantized(  # same codes, every fp16 number moved
        name, on_grid.codes, (on_grid.scale.float() * 1.1).half(),
        None if on_grid.minimum is None else (on_grid.minimum.float() * 0.9 - 0.01).half(),
        on_grid.sub_scale, on_grid.sub_min,
    )  # fmt: skip
    assert not torch.equal(off.dequantize(), target)
    found = refit_block_numbers(off, target, h, rows_per_chunk=5)  # chunks that split the rows
    assert torch.equal(found.scale, on_grid.scale)
    if on_grid.minimum is not None:
        assert torch.equal(found.minimum, on_grid.minimum)
    assert torch.equal(found.dequantize(), target)


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_gptq_refit_never_raises_a_rows_error_and_lowers_the_total(name, monkeypatch):
    import lowbit.algorithms.gguf_spec as gguf_spec

    w, h = _problem(n=128 if BLOCK_TYPES[name].block == 32 else 512, seed=2)
    spec = GGUFWeightSpec(name)
    settings = GPTQSettings(act_order=False)
    container, refitted, _ = spec.gptq(w, h, settings)
    assert torch.equal(refitted, container.dequantize())
    monkeypatch.setattr(gguf_spec, "refit_block_numbers", lambda q, *args: q)
    loop_only = spec.gptq(w, h, settings)[1]

    def rows(values):
        delta = w - values
        return ((delta @ h) * delta).sum(1)  # [out]

    assert bool((rows(refitted) <= rows(loop_only)).all())
    # measured: 0.92x (Q5_1) to 0.97x (Q8_0) for the 32-weight types; the K types, whose
    # refit moves only the two super-scales of 256 weights, 0.985x (Q4_K) to 0.994x (Q6_K)
    bound = 0.98 if BLOCK_TYPES[name].block == 32 else 0.997
    assert _output_error(w, refitted, h) < bound * _output_error(w, loop_only, h)
