import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lowbit.errors import LowbitError
from lowbit.formats.bfp import BFP_FORMATS, BFPQuantized, bfp_quantize, fake_quant_bfp

NAN = float("nan")


def test_rounding_ties_go_to_even():
    # amax = 1 → E = 0 - (4 - 2) = -2, step 0.25; x/step = 4, 0.5, 1.5, 2.5, -0.5, -1.5
    x = torch.tensor([[1.0, 0.125, 0.375, 0.625, -0.125, -0.375, 0.0, 0.0]])
    mant, exp = bfp_quantize(x, 4, 8)
    assert exp.tolist() == [[127 - 2]]
    assert mant.flatten().tolist() == [4, 0, 2, 2, 0, -2, 0, 0]
    assert fake_quant_bfp(x, 4, 8).tolist() == [[1.0, 0.0, 0.5, 0.5, 0.0, -0.5, 0.0, 0.0]]


def test_saturation_floor_rule_and_fit_rule():
    # amax = 1.96875 → floor(log2) = 0, E = -2: 1.96875 / 0.25 = 7.875 → 8 saturates to 7
    x = torch.tensor([[1.96875, -1.96875, 0.25, 0.0]])
    mant, exp = bfp_quantize(x, 4, 4)
    assert mant.flatten().tolist() == [7, -7, 1, 0] and exp.item() == 125
    # fit: E = -1 instead (step 0.5), so 1.96875 / 0.5 = 3.94 → 4 fits without saturating
    mant, exp = bfp_quantize(x, 4, 4, exponent_rule="fit")
    assert mant.flatten().tolist() == [4, -4, 0, 0] and exp.item() == 126


def test_zero_nan_inf_and_subnormal_blocks():
    x = torch.tensor(
        [
            [0.0, 0.0, -0.0, 0.0],
            [1.0, NAN, 2.0, 3.0],
            [1.0, float("-inf"), 2.0, 3.0],
            [1e-45, 2e-40, 1e-38, 0.0],
            [3e38, -3.4e38, 1.0, 0.0],
        ]
    )
    mant, exp = bfp_quantize(x, 8, 4)
    assert exp.flatten().tolist() == [0, 255, 255, 0, 127 + 127 - 6]
    out = fake_quant_bfp(x, 8, 4)
    assert torch.equal(out[0], torch.zeros(4))
    assert bool(out[1].isnan().all()) and bool(out[2].isnan().all())
    # subnormals: E clamps to -127; 1e-38 / 2**-127 = 1.70 → 2, the others round to 0
    assert out[3].tolist() == [0.0, 0.0, 2 * 2.0**-127, 0.0]
    assert torch.isfinite(out[4]).all() and mant[4, 0, 1].item() == -127
    assert torch.equal(
        BFPQuantized.from_float(x, 8, 4).dequantize().nan_to_num(7.0), out.nan_to_num(7.0)
    )


@pytest.mark.parametrize("name", list(BFP_FORMATS))
@pytest.mark.parametrize("axis", [-1, 0])
def test_packed_equals_simulated_bit_exact(name, axis):
    p, n = BFP_FORMATS[name]
    x = torch.randn(128, 128) * torch.logspace(-3, 3, 128)
    assert torch.equal(
        BFPQuantized.from_float(x, p, n, axis).dequantize(), fake_quant_bfp(x, p, n, axis)
    )


def test_blocks_stay_inside_heads():
    # [tokens, heads, head_dim]: one huge head must not change its neighbours' exponents
    x = torch.randn(5, 3, 32)
    y = x.clone()
    y[:, 1] *= 1000
    a, b = fake_quant_bfp(x, 4, 32), fake_quant_bfp(y, 4, 32)
    assert torch.equal(a[:, 0], b[:, 0]) and torch.equal(a[:, 2], b[:, 2])


def test_bfp12_block64_is_4_125_bits():
    assert BFPQuantized.from_float(torch.randn(8, 128), 4, 64).bits_per_element() == 4.125
    assert BFPQuantized.from_float(torch.randn(8, 128), 8, 32).bits_per_element() == 8.25


@settings(deadline=None, max_examples=50)
@given(
    x=arrays(np.float32, (3, 32), elements=st.floats(-1e6, 1e6, width=32)),
    p=st.integers(2, 8),
    block=st.sampled_from([8, 16, 32]),
)
def test_error_bound_and_idempotence(x, p, block):
    xt = torch.from_numpy(x)
    mant, exp = bfp_quantize(xt, p, block)
    out = fake_quant_bfp(xt, p, block)
    step = torch.ldexp(torch.ones(exp.shape), exp.int() - 127).repeat_interleave(block, -1)
    mmax = 2 ** (p - 1) - 1
    inside = xt.abs() <= step * mmax  # below saturation: within half a step
    err = (out - xt).abs()
    assert bool((err[inside] <= step[inside] / 2).all())
    # saturated values land on the largest mantissa, of the right sign
    assert bool((out[~inside].abs() == (step * mmax)[~inside]).all())
    assert torch.equal(fake_quant_bfp(out, p, block), out)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fake_quant_bfp(torch.randn(4, 30), 4, 16), "block_size"),
        (lambda: fake_quant_bfp(torch.randn(4, 32), 9, 16), "mantissa_bits"),
        (lambda: fake_quant_bfp(torch.randn(0, 32), 4, 16), "empty"),
        (lambda: fake_quant_bfp(torch.ones(4, 32, dtype=torch.int8), 4, 16), "floating"),
        (lambda: fake_quant_bfp(torch.randn(4, 32), 4, 16, exponent_rule="ceil"), "exponent_rule"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(LowbitError, match=match):
        call()


def test_exponent_is_floor_log2_of_amax():
    x = torch.randn(64, 32) * 10
    _, exp = bfp_quantize(x, 8, 32)
    amax = x.abs().amax(-1)
    expected = [math.floor(math.log2(a)) - 6 + 127 for a in amax.tolist()]
    assert exp.flatten().tolist() == expected
