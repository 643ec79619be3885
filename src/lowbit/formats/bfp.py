"""Block floating point (BFP) / microscaling integers (MXINT): one 8-bit shared exponent per block.

Format: blocks of ``block_size`` contiguous values along ``axis`` (``None`` = the whole axis;
it must divide the axis, so a block never straddles rows, tokens or — with ``axis=-1`` on
``[.., heads, head_dim]`` and a block dividing ``head_dim`` — attention heads). Each value is
``m * 2**E`` with a signed ``p``-bit mantissa ``m`` in ``[-(2**(p-1) - 1), 2**(p-1) - 1]``
(symmetric; the code ``-2**(p-1)`` is unused) and a shared exponent ``E``.

Shared exponent rule (``exponent_rule="floor"``, the OCP MX v1.0 reference for MXINT): with
``amax`` the block's largest magnitude, ``E = floor(log2(amax)) - (p - 2)``, i.e. the
mantissa is a fixed-point number with one integer bit and ``p - 2`` fraction bits scaled by
``2**floor(log2(amax))``. ``amax / 2**E`` lies in ``[2**(p-2), 2**(p-1))``, so the largest
value can round up to ``2**(p-1)`` and saturates to ``2**(p-1) - 1``.
``exponent_rule="fit"`` instead raises ``E`` by one when that happens (no saturation, at the
cost of one bit of resolution for the block). Mantissas are rounded half to even.

``E`` is stored as an 8-bit biased code ``E + 127`` in ``[0, 254]``, clamped to that range (so
an all-zero block, and FP32 subnormals below ``2**-127 * 2**(p-2)``, get ``E = -127``; tiny
subnormals then round to 0). Code 255 means NaN: a block holding any NaN or ±Inf decodes to NaN
in every element (integer mantissas cannot express Inf; this is OCP MX's conversion rule).

Members: BFP12 = ``(p=4)``, BFP16 = ``(p=8)`` (Trukhanov & Soloveychik, 2024; block size free,
e.g. 64); MXINT8 = ``(p=8, block 32)``, MXINT4 = ``(p=4, block 32)``: see :data:`BFP_FORMATS`.
Storage: ``p`` bits per element plus 8 bits per block (BFP12, block 64: 4.125 bits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.packing import pack_bits, unpack_bits

__all__ = ["BFP_FORMATS", "BFPQuantized", "bfp_quantize", "bfp_dequantize", "fake_quant_bfp"]

#: name → (mantissa_bits, block_size)
BFP_FORMATS = {
    "bfp12": (4, 64),
    "bfp16": (8, 64),
    "mxint8": (8, 32),
    "mxint4": (4, 32),
}

_EXP_BIAS = 127
_EXP_NAN = 255


def _check(x: Tensor, mantissa_bits: int, exponent_rule: str) -> None:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise LowbitError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.numel() == 0 or x.dim() == 0:
        raise LowbitError(f"x is empty or 0-d (shape {tuple(x.shape)}); nothing to quantize")
    if not isinstance(mantissa_bits, int) or not 2 <= mantissa_bits <= 8:
        raise LowbitError(f"mantissa_bits must be an integer in 2..8, got {mantissa_bits!r}")
    if exponent_rule not in ("floor", "fit"):
        raise LowbitError(f"exponent_rule must be 'floor' or 'fit', got {exponent_rule!r}")


def _blocks(x: Tensor, block_size: int | None, axis: int) -> Tensor:
    """x → [..., n_blocks, block] with ``axis`` moved last."""
    if not -x.dim() <= axis < x.dim():
        raise LowbitError(f"axis={axis} is out of range for a {x.dim()}-d tensor")
    moved = x.movedim(axis, -1)  # [..., L]
    length = moved.shape[-1]
    n = length if block_size is None else block_size
    if not isinstance(n, int) or n < 1 or length % n:
        raise LowbitError(
            f"block_size={block_size!r} must be a positive integer dividing the axis length {length}"
        )
    return moved.reshape(*moved.shape[:-1], length // n, n)


def _unblocks(xb: Tensor, shape: torch.Size, axis: int) -> Tensor:
    moved = list(shape)
    moved.append(moved.pop(axis % len(shape)))
    return xb.reshape(moved).movedim(-1, axis)


def _quantize_blocks(
    x: Tensor, mantissa_bits: int, block_size: int | None, axis: int, exponent_rule: str
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """x → fp32 integer-valued mantissas [..., B, n] (axis moved last), ``-E`` int32 [..., B],
    ``2**-E`` fp32 [..., B, 1] (exact), and the mask of NaN/Inf blocks [..., B] (None when there
    are none; their mantissas are 0)."""
    # one statistic per block: the ops on statistics are kept few
    _check(x, mantissa_bits, exponent_rule)
    xb = _blocks(x.float(), block_size, axis)  # [..., B, n]
    mmax = 2 ** (mantissa_bits - 1) - 1
    # max|x| as max(max x, -min x): two vectorized passes, no |x| temporary. NaN propagates,
    # an Inf gives inf, so a non-finite block has a non-finite amax.
    amax = torch.maximum(xb.amax(-1), xb.amin(-1).neg_())  # [..., B]
    bad = None if math.isfinite(amax.amax()) else ~torch.isfinite(amax)
    if bad is not None:  # their exponent and mantissas are overwritten below
        amax = amax.masked_fill_(bad, 0.0)
    # an all-zero block must get E = -127: as 2**-149 (the smallest subnormal, below every
    # nonzero |x|) its floor(log2) is -149, which the clamp below takes to -127
    amax = amax.clamp_min_(2.0**-149)
    _, exp2 = torch.frexp(amax)  # amax = f * 2**exp2, f in [0.5, 1)
    # -E = (p - 2) - floor(log2 amax) = (p - 1) - exp2, clamped to the 8-bit range
    neg_exp = torch.sub(mantissa_bits - 1, exp2).clamp_(-_EXP_BIAS, _EXP_BIAS)
    if exponent_rule == "fit":
        top = torch.round(torch.ldexp(amax, neg_exp))
        neg_exp = torch.where(top > mmax, neg_exp - 1, neg_exp).clamp_(-_EXP_BIAS, _EXP_BIAS)
    inv = torch.pow(2.0, neg_exp).unsqueeze(-1)  # [..., B, 1], exactly 2**-E
    mant = torch.mul(xb, inv).round_().clamp_(-mmax, mmax)  # [..., B, n]
    if bad is not None:
        mant = mant.masked_fill_(bad.unsqueeze(-1), 0.0)  # NaN/Inf blocks: m = 0
    return mant, neg_exp, inv, bad


def _exponent_codes(neg_exp: Tensor, bad: Tensor | None) -> Tensor:
    """``-E`` int32 [..., B] → biased uint8 codes ``E + 127`` (255 = NaN block)."""
    codes = torch.sub(_EXP_BIAS, neg_exp).to(torch.uint8)
    return codes if bad is None else codes.masked_fill_(bad, _EXP_NAN)


def bfp_quantize(
    x: Tensor,
    mantissa_bits: int,
    block_size: int | None,
    *,
    axis: int = -1,
    exponent_rule: str = "floor",
) -> tuple[Tensor, Tensor]:
    """Mantissas and shared-exponent codes.

    Args:
        x: float tensor, any shape.
        mantissa_bits: ``p``, 2..8 (sign included).
        block_size: values per block along ``axis`` (None = the whole axis).
        axis: the axis blocks run along.
        exponent_rule: ``"floor"`` (OCP MX) or ``"fit"`` (see module doc).

    Returns:
        ``(mantissas, exp_codes)``: int8 ``[..., n_blocks, block]`` (axis moved last) and
        uint8 ``[..., n_blocks]`` biased exponents (255 = NaN block).
    """
    mant, neg_exp, _, bad = _quantize_blocks(x, mantissa_bits, block_size, axis, exponent_rule)
    return mant.to(torch.int8), _exponent_codes(neg_exp, bad)


def _block_scales(exp_codes: Tensor) -> Tensor:
    """Biased exponent codes [..., B] → fp32 ``2**E`` [..., B, 1] (NaN for code 255)."""
    exp = exp_codes.to(torch.int32) - _EXP_BIAS  # [..., B]
    scale = torch.ldexp(torch.ones(exp.shape, device=exp_codes.device), exp)
    return scale.masked_fill_(exp_codes == _EXP_NAN, float("nan")).unsqueeze(-1)


def bfp_dequantize(mant: Tensor, exp_codes: Tensor) -> Tensor:
    """fp32 values ``[..., n_blocks, block]`` from :func:`bfp_quantize`'s outputs."""
    return mant.float() * _block_scales(exp_codes)


def fake_quant_bfp(
    x: Tensor,
    mantissa_bits: int,
    block_size: int | None,
    axis: int = -1,
    *,
    exponent_rule: str = "floor",
) -> Tensor:
    """BFP quantize then dequantize; same shape and dtype as ``x``; equals
    ``BFPQuantized.from_float(...).dequantize()`` bit for bit."""
    mant, _, inv, bad = _quantize_blocks(x, mantissa_bits, block_size, axis, exponent_rule)
    scale = torch.reciprocal(inv)  # 2**E, exact: E in [-127, 127] (tested for all of them)
    if bad is not None:
        scale = scale.masked_fill_(bad.unsqueeze(-1), float("nan"))
    # int8 mantissas have no -0: + 0.0 turns the -0.0 that rounding gives into +0.0
    out = mant.add_(0.0).mul_(scale)
    return _unblocks(out, x.shape, axis).to(x.dtype)


@dataclass
class BFPQuantized:
    """Packed BFP tensor.

    Fields:
        qdata: uint8 stream of ``p``-bit mantissas offset by ``2**(p-1)``, in the blocked layout
            ``[..., n_blocks, block]`` (axis moved last) flattened row-major.
        exponents: uint8 ``[..., n_blocks]`` biased shared exponents (255 = NaN block).
    """

    qdata: Tensor
    exponents: Tensor
    mantissa_bits: int
    block_size: int | None
    axis: int
    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def from_float(
        cls,
        x: Tensor,
        mantissa_bits: int,
        block_size: int | None,
        axis: int = -1,
        *,
        exponent_rule: str = "floor",
    ) -> BFPQuantized:
        """Quantize and pack ``x`` (arguments as for :func:`bfp_quantize`)."""
        mant, codes = bfp_quantize(
            x, mantissa_bits, block_size, axis=axis, exponent_rule=exponent_rule
        )
        # two's complement int8 viewed as uint8, plus 2**(p-1) mod 256: the offset code
        unsigned = mant.view(torch.uint8).add_(2 ** (mantissa_bits - 1)).reshape(-1)
        return cls(
            qdata=pack_bits(unsigned, mantissa_bits, check_range=False),
            exponents=codes,
            mantissa_bits=mantissa_bits,
            block_size=block_size,
            axis=axis,
            shape=x.shape,
            dtype=x.dtype,
        )

    def mantissas(self) -> Tensor:
        """int8 mantissas ``[..., n_blocks, block]``."""
        n = math.prod(self.shape)
        unsigned = unpack_bits(self.qdata, self.mantissa_bits, n).to(torch.int16)
        mant = (unsigned - 2 ** (self.mantissa_bits - 1)).to(torch.int8)
        return mant.reshape(*self.exponents.shape, -1)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """Values with the original shape; dtype defaults to the input's."""
        out = _unblocks(bfp_dequantize(self.mantissas(), self.exponents), self.shape, self.axis)
        return out.to(self.dtype if dtype is None else dtype)

    def storage_bits(self) -> int:
        """``numel * p`` mantissa bits + 8 bits per shared exponent."""
        return math.prod(self.shape) * self.mantissa_bits + 8 * self.exponents.numel()

    def bits_per_element(self) -> float:
        return self.storage_bits() / math.prod(self.shape)
