import math

import pytest
import torch

from lowbit.algorithms.gptq import GPTQSettings
from lowbit.algorithms.mixed import (
    MixedWeightSpec,
    choose_4bit_groups,
    choose_outliers,
    group_sensitivity,
    inverse_hessian_diagonal,
    mixed_quantize,
)
from lowbit.errors import LowbitError
from lowbit.formats.mixed import GROUP


def _problem(n, k, seed=0, tokens=256):
    """A weight with a few wide groups and a Hessian of correlated inputs of uneven energy."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[:, 16:32] *= 4  # a wide group
    w[3, 5] = 0.5  # a lone large weight
    x = torch.randn(tokens, k, generator=gen) @ (
        torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k**0.5
    )
    x = x * torch.linspace(0.2, 3.0, k)
    return w, 2.0 / tokens * x.T @ x


def _output_error(w, deq, h):
    delta = deq - w
    return float(((delta @ h) * delta).sum() / ((w @ h) * w).sum())


def test_sensitivity_against_a_direct_computation():
    w, h = _problem(6, 40)
    hinv_diag, damp = inverse_hessian_diagonal(h, 0.01)
    direct_inv = torch.linalg.inv(h.double() + damp * h.diagonal().mean().double() * torch.eye(40))
    assert torch.allclose(hinv_diag.double(), direct_inv.diagonal(), rtol=1e-5)
    sens = group_sensitivity(w, hinv_diag)
    assert sens.shape == (3,)  # 40 columns: groups of 16, 16, 8
    for i in range(3):
        expect = 0.0
        for m in range(GROUP):
            j = GROUP * i + m
            if j < 40:
                for row in range(6):
                    expect += float(w[row, j]) ** 2 / float(direct_inv[j, j]) ** 2
        assert float(sens[i]) == pytest.approx(expect, rel=1e-4)


def test_four_bit_groups_are_the_most_sensitive():
    sens = torch.tensor([3.0, 9.0, 1.0, 7.0, 5.0, 8.0, 0.5, 2.0])
    assert torch.nonzero(choose_4bit_groups(sens, 0.25)).squeeze(1).tolist() == [1, 5]
    assert int(choose_4bit_groups(sens, 0.1).sum()) == 1
    assert int(choose_4bit_groups(sens, 0.0).sum()) == 0
    w, h = _problem(32, 128, seed=1)
    result = mixed_quantize(w, h, MixedWeightSpec(frac_4bit=0.25))
    top = torch.argsort(result.sensitivity, descending=True)[:2]
    assert sorted(torch.nonzero(result.is4).squeeze(1).tolist()) == sorted(top.tolist())
    _, stats, _ = result.quantized.unpack()
    assert torch.equal(stats.is4, result.is4)


def test_outliers_only_in_two_bit_groups_and_counted_exactly():
    w, h = _problem(32, 128, seed=2)
    is4 = torch.tensor([False, True, False, False, True, False, False, False])
    mask = choose_outliers(w, is4, 40)
    assert int(mask.sum()) == 40
    cols = torch.nonzero(mask)[:, 1]
    assert not bool(is4[cols // GROUP].any())
    result = mixed_quantize(w, h, MixedWeightSpec(frac_4bit=0.25, outlier_fraction=0.01))
    rows, cols, _ = result.quantized.outliers._coo()
    assert cols.numel() == round(0.01 * w.numel())
    assert not bool(result.is4[cols // GROUP].any())


def test_outliers_shrink_the_range_they_leave():
    w = torch.zeros(1, 16)
    w[0, :15] = torch.linspace(-0.1, 0.1, 15)
    w[0, 15] = 2.0
    mask = choose_outliers(w, torch.tensor([False]), 1)
    assert mask[0, 15] and int(mask.sum()) == 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_gptq_weight_is_the_container_and_beats_rtn(dynamic):
    w, h = _problem(48, 200, seed=3)  # 13 groups, the last of 8 columns
    spec = MixedWeightSpec(frac_4bit=0.25, outlier_fraction=0.005)
    gptq = mixed_quantize(w, h, spec, dynamic=dynamic, block_size=64)
    rtn = mixed_quantize(w, None, spec)
    assert torch.equal(gptq.weight, gptq.quantized.dequantize())  # bit for bit
    assert torch.equal(rtn.weight, rtn.quantized.dequantize())
    err_gptq, err_rtn = _output_error(w, gptq.weight, h), _output_error(w, rtn.weight, h)
    # measured: static 0.0350, dynamic 0.0296, RTN 0.0661
    assert err_gptq < 0.6 * err_rtn and err_gptq < 0.04
    # outliers keep fp16 values exactly and their dense code decodes to 0
    rows, cols, vals = gptq.quantized.outliers._coo()
    assert torch.equal(gptq.weight[rows, cols], vals)


def test_dead_inputs_are_zeroed():
    w, h = _problem(16, 48, seed=4)
    h[7, :] = 0
    h[:, 7] = 0
    result = mixed_quantize(w, h, MixedWeightSpec())
    assert torch.equal(result.weight[:, 7], torch.zeros(16))


def test_spec_checks_and_describes():
    spec = MixedWeightSpec()
    assert "25% 4-bit" in spec.describe() and "0.20% fp16 outliers" in spec.describe()
    w = torch.randn(8, 32)
    for bad, message in [
        (MixedWeightSpec(frac_4bit=1.5), "frac_4bit"),
        (MixedWeightSpec(outlier_fraction=0.2), "outlier_fraction"),
        (MixedWeightSpec(g2=0), "g2"),
        (MixedWeightSpec(is4=torch.zeros(3, dtype=torch.bool)), "fixed 4-bit groups"),
    ]:
        with pytest.raises(LowbitError, match=message):
            bad.check(w)
    with pytest.raises(LowbitError, match="Hessian"):
        mixed_quantize(w, torch.eye(5), spec)
    fixed = torch.tensor([True, False])
    result = mixed_quantize(w, None, MixedWeightSpec(is4=fixed))
    assert torch.equal(result.is4, fixed)
    assert spec.guard_candidate(w) is None
    container, weight, damp = spec.gptq(w, torch.eye(32), GPTQSettings())
    assert damp == 0.01 and container.shape == w.shape
    assert torch.equal(weight, container.dequantize()) and spec.matches(container)
    assert not MixedWeightSpec(g2=8).matches(container)
    assert not MixedWeightSpec(frac_4bit=1.0).matches(container)
    assert math.isclose(spec.rtn(w).dequantize().abs().max(), w.abs().max(), rel_tol=0.5)
