"""Invariants the fast paths of intq/bfp/packing rely on (fewer passes, checks folded into the
statistics): each test fails if a shortcut changes a result or drops a check."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.bfp import BFPQuantized, bfp_quantize, fake_quant_bfp
from lowbit.formats.intq import IntQuantized, fake_quant_int, int_scale_zero
from lowbit.formats.packing import pack_bits


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_power_of_two_reciprocal_is_exact_for_every_shared_exponent():
    # fake_quant_bfp multiplies by 1 / 2**-E instead of decoding the exponent code
    e = torch.arange(-127, 128, dtype=torch.int32)
    assert torch.equal(
        _bits(torch.reciprocal(torch.pow(2.0, -e))), _bits(torch.ldexp(torch.ones(255), e))
    )


@pytest.mark.parametrize("rule", ["floor", "fit"])
def test_bfp_fake_equals_packed_bitwise_over_the_whole_exponent_range(rule):
    # one block per row, magnitudes 2**-150 .. 2**127, plus zero, subnormal and NaN/Inf blocks
    g = torch.Generator().manual_seed(0)
    scales = torch.ldexp(torch.ones(280, 1), torch.arange(-150, 130).unsqueeze(1).int())
    x = torch.randn(280, 16, generator=g) * scales
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 0] = float("-inf")
    fake = fake_quant_bfp(x, 4, 16, exponent_rule=rule)
    packed = BFPQuantized.from_float(x, 4, 16, exponent_rule=rule).dequantize()
    assert torch.equal(_bits(fake), _bits(packed))  # NaN and the sign of zero included
    assert fake[1].isnan().all() and fake[2].isnan().all() and not fake[3:].isnan().any()
    _, codes = bfp_quantize(x, 4, 16, exponent_rule=rule)
    assert codes[0].item() == 0 and codes[1].item() == 255 and codes[2].item() == 255


def test_bfp_fake_has_no_negative_zero():
    x = torch.tensor([[1.0, -0.01, -0.0, 0.01]])  # -0.01 rounds to mantissa -0
    out = fake_quant_bfp(x, 4, 4)
    assert not torch.signbit(out[out == 0]).any()


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(symmetric=False),
        dict(scale_rule="signed_max"),
        dict(mse_search=True),
        dict(axis=None),
        dict(group_size=4),
        dict(axis=0, symmetric=False),
        dict(clip_ratio=0.9),
    ],
    ids=str,
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_rejected_by_every_statistics_path(kw, bad):
    x = torch.randn(8, 16)
    x[5, 9] = bad
    for call in (
        lambda: fake_quant_int(x, 4, **kw),
        lambda: IntQuantized.from_float(x, 4, **kw),
        lambda: int_scale_zero(x, 4, **kw),
    ):
        with pytest.raises(LowbitError, match="NaN or Inf"):
            call()


def test_finite_range_that_overflows_is_not_mistaken_for_inf():
    # hi - lo overflows fp32 for an asymmetric scale; the input is finite, so no error
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0]])
    scale, zero = int_scale_zero(x, 4, symmetric=False)
    assert torch.isinf(scale).all() and zero is not None


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 64])
def test_pack_without_range_check_matches_checked(bits, n):
    codes = torch.randint(0, 2**bits, (3, n), generator=torch.Generator().manual_seed(bits))
    for dtype in (torch.uint8, torch.int64):
        c = codes.to(dtype)
        checked = pack_bits(c, bits)
        assert torch.equal(pack_bits(c, bits, check_range=False), checked)
        assert checked.data_ptr() != c.data_ptr()  # never a view of the input


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [1, 2, 4, 7, 8])
def test_unsigned_code_conversion_covers_the_full_code_range(bits, symmetric):
    if symmetric and bits == 1:
        pytest.skip("symmetric needs 2 bits")
    # a ramp clipped to half its range hits every code, both ends saturated
    x = torch.linspace(-1.0, 1.0, 2**bits * 8).reshape(1, -1)
    packed = IntQuantized.from_float(x, bits, symmetric=symmetric, clip_ratio=0.5)
    codes = packed.codes().to(torch.int16)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    assert codes.min().item() == lo and codes.max().item() == hi
    assert len(codes.unique()) == hi - lo + 1
    fake = fake_quant_int(x, bits, symmetric=symmetric, clip_ratio=0.5)
    assert torch.equal(packed.dequantize(), fake)
