"""Uniform integer quantization: symmetric / asymmetric, per tensor, row, token or group.

Conventions (used everywhere in lowbit):

* ``axis`` is the axis along which values share statistics (the reduction axis). For a weight
  ``[out, in]``, ``axis=-1`` gives one scale per output row ("per channel"); for activations
  ``[batch, tokens, hidden]``, ``axis=-1`` is per token; for keys ``[.., tokens, head_dim]``,
  ``axis=-2`` is per channel. ``axis=None`` is per tensor. ``group_size`` splits ``axis`` into
  contiguous groups of that many elements (``None`` = the whole axis); it must divide the axis.
* Statistics have ``x``'s shape with ``axis`` replaced by ``n_groups`` (keepdim style; all ones
  for per tensor). Grouped, ``x.movedim(axis, -1).reshape(..., n_groups, group_size)`` lines up
  with ``scale.movedim(axis, -1).unsqueeze(-1)``. With ``group_size=None`` they broadcast
  against ``x`` directly, so a GPTQ column slice ``w[:, j:j+1]`` is quantized with
  ``scale[:, g:g+1]``.
* Symmetric (QuaRot convention): codes ``q`` in ``[-2**(b-1), 2**(b-1) - 1]``,
  ``scale = clip_ratio * max|x| / (2**(b-1) - 1)``, ``x ≈ q * scale``; ``zero`` is None.
* Symmetric with ``scale_rule="absmax_half"`` (compressed-tensors / llm-compressor): ``scale =
  clip_ratio * max|x| / (2**(b-1) - 1/2)``, a step ``1 / (2**b - 1)`` finer than ``absmax``.
  The largest magnitudes sit half a step beyond ``±(2**(b-1) - 1)`` and round to either
  neighbour (``-2**(b-1)`` is a code; ``+2**(b-1)`` clamps back), half a step off at most.
* Symmetric with ``scale_rule="signed_max"`` (llama.cpp Q4_0): ``scale = clip_ratio * x_ext /
  -(2**(b-1))`` where ``x_ext`` is the signed value of largest magnitude, so ``x_ext`` lands on
  code ``-2**(b-1)`` exactly and the other side reaches ``2**(b-1) - 1`` steps. The scale may
  be negative.
* Asymmetric (GPTQ convention): the range ``[min(x_min, 0), max(x_max, 0)] * clip_ratio`` maps
  to codes ``[0, 2**b - 1]``; ``scale = range / (2**b - 1)``, integer ``zero =
  round(-lo / scale)``, ``q = clamp(round(x / scale) + zero)``, ``x ≈ (q - zero) * scale``.
* Codes are chosen as ``x * (1 / scale)`` in fp32 (one reciprocal per group). Rounding is
  ``"half_even"`` (``torch.round``, default), ``"half_away"`` (C ``roundf``, llama.cpp Q8_0) or
  ``"half_up"`` (``floor(u + 0.5)`` on the unsigned code ``u = y + 2**(b-1)`` or ``y + zero``,
  llama.cpp Q4_0).
* A group whose statistics give a zero scale (all zeros) gets scale 1; a scale smaller in
  magnitude than the smallest normal fp32 is raised to it, so ``1 / scale`` is finite.
* ``scale_dtype`` is the dtype the scale is stored in; codes are chosen with the fp32 scale
  and the scale is then rounded to ``scale_dtype`` (the llama.cpp convention).
* Bad input raises :class:`~lowbit.errors.LowbitError`: bits outside 2..8 (symmetric) or 1..8
  (asymmetric), a group size that does not divide the axis, empty or non-float tensors, and
  NaN or Inf anywhere in ``x`` (an integer grid has no code for them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.packing import pack_bits, packed_words_per_row, unpack_bits

__all__ = [
    "int_scale_zero",
    "int_quantize_with",
    "int_dequantize_with",
    "fake_quant_int",
    "IntQuantized",
    "int_qrange",
]

_ROUNDINGS = ("half_even", "half_away", "half_up")
_SCALE_RULES = ("absmax", "absmax_half", "signed_max")
_TINY = torch.finfo(torch.float32).tiny
_STAT_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}


# ----------------------------------------------------------------------------- checks


def int_qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The code range ``(qmin, qmax)`` for ``bits`` (see module conventions)."""
    if symmetric:
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _check_bits(bits, symmetric: bool) -> None:
    low = 2 if symmetric else 1
    if not isinstance(bits, int) or isinstance(bits, bool) or not low <= bits <= 8:
        kind = "symmetric" if symmetric else "asymmetric"
        raise LowbitError(
            f"bits must be an integer in {low}..8 for {kind} quantization, got {bits!r}"
        )


def _check_float(x: Tensor, name: str = "x", *, finite: bool = True) -> None:
    if not isinstance(x, Tensor):
        raise LowbitError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise LowbitError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise LowbitError(f"{name} is empty (shape {tuple(x.shape)}); nothing to quantize")
    # amin/amax propagate NaN and are finite iff every element is: two vectorized passes,
    # several times cheaper than isfinite(x).all(), which materialises a bool tensor
    if finite and not (math.isfinite(x.amin()) and math.isfinite(x.amax())):
        raise LowbitError(f"{name} contains NaN or Inf; integer formats have no code for them")


def _check_options(clip_ratio: float, rounding: str, scale_rule: str, symmetric: bool) -> None:
    if not (0.0 < float(clip_ratio) <= 1.0):
        raise LowbitError(f"clip_ratio must be in (0, 1], got {clip_ratio!r}")
    if rounding not in _ROUNDINGS:
        raise LowbitError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if scale_rule not in _SCALE_RULES:
        raise LowbitError(f"scale_rule must be one of {_SCALE_RULES}, got {scale_rule!r}")
    if scale_rule != "absmax" and not symmetric:
        raise LowbitError(f"scale_rule={scale_rule!r} is a symmetric rule; pass symmetric=True")


# ----------------------------------------------------------------------------- group layout


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise LowbitError(f"axis={axis} is out of range for a {ndim}-d tensor")
    return axis % ndim


def _to_groups(x: Tensor, axis: int | None, group_size: int | None) -> Tensor:
    """x → [..., n_groups, group] with the statistics axis moved last."""
    if x.dim() == 0:
        raise LowbitError("x must have at least one dimension")
    if axis is None:
        if group_size is not None:
            raise LowbitError("group_size needs an axis; axis=None means one group per tensor")
        return x.reshape(1, 1, -1)  # [1, 1, numel]
    ax = _norm_axis(axis, x.dim())
    moved = x.movedim(ax, -1)  # [..., L]
    length = moved.shape[-1]
    g = length if group_size is None else group_size
    if not isinstance(g, int) or g < 1 or length % g:
        raise LowbitError(
            f"group_size={group_size!r} must be a positive integer dividing the axis length {length}"
        )
    return moved.reshape(*moved.shape[:-1], length // g, g)  # [..., G, g]


def _from_groups(grouped: Tensor, shape: torch.Size, axis: int | None) -> Tensor:
    """[..., n_groups, group] → the original layout of shape ``shape``."""
    if axis is None:
        return grouped.reshape(shape)
    ax = _norm_axis(axis, len(shape))
    moved_shape = list(shape)
    moved_shape.append(moved_shape.pop(ax))
    return grouped.reshape(moved_shape).movedim(-1, ax)


def _stat_to_public(stat: Tensor, ndim: int, axis: int | None) -> Tensor:
    """[..., G, 1] → x's shape with axis replaced by G (all ones for per tensor)."""
    if axis is None:
        return stat.reshape([1] * ndim)
    return stat.squeeze(-1).movedim(-1, _norm_axis(axis, ndim))


def _stat_to_groups(stat: Tensor, ndim: int, axis: int | None) -> Tensor:
    """Inverse of :func:`_stat_to_public`: → [..., G, 1]."""
    if axis is None:
        return stat.reshape(1, 1, 1)
    return stat.movedim(_norm_axis(axis, ndim), -1).unsqueeze(-1)


# ----------------------------------------------------------------------------- core math


def _group_range(xg: Tensor, symmetric: bool, scale_rule: str) -> tuple[Tensor, Tensor]:
    """The statistics of grouped fp32 values [..., G, g] that the scale is made from.

    Returns ``(lo, hi)`` [..., G, 1]: the group minimum and maximum, except for
    ``scale_rule="signed_max"``, where both are the signed value of largest magnitude. They are
    also ``x``'s NaN/Inf check (see :func:`_require_finite`), so there is no separate pass.
    """
    if scale_rule == "signed_max":
        idx = xg.abs().argmax(dim=-1, keepdim=True)  # a NaN counts as the largest
        lo = hi = xg.gather(-1, idx)  # [..., G, 1], signed
    elif symmetric:  # amin and amax are one vectorized pass each; abs().amax() is slower
        lo = xg.amin(dim=-1, keepdim=True)
        hi = xg.amax(dim=-1, keepdim=True)
    else:  # the zero point's sign of zero follows aminmax's choice between -0.0 and +0.0
        lo, hi = torch.aminmax(xg, dim=-1, keepdim=True)
    return lo, hi


def _require_finite(lo: Tensor, hi: Tensor) -> None:
    """Raise if the group statistics show a NaN or Inf in ``x``: min and max propagate NaN,
    and an Inf makes its group's ``lo`` or ``hi`` infinite."""
    if not (math.isfinite(lo.amin()) and math.isfinite(hi.amax())):
        raise LowbitError("x contains NaN or Inf; integer formats have no code for them")


def _scale_zero_from_range(
    lo: Tensor,
    hi: Tensor,
    bits: int,
    symmetric: bool,
    clip: float,
    scale_rule: str,
    include_zero: bool,
) -> tuple[Tensor, Tensor | None]:
    """Group statistics from :func:`_group_range` → scale, zero [..., G, 1] (fp32); raises on
    NaN/Inf. ``lo`` and ``hi`` are left unchanged.

    There is one statistic per group, so on large tensors the ops here are many small ones;
    they are kept few and in place, and the checks share one reduction.
    """
    qmin, qmax = int_qrange(bits, symmetric)
    if scale_rule == "signed_max":
        _require_finite(lo, hi)
        scale = hi * clip / float(qmin)  # may be negative
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        scale = torch.where(
            scale.abs() < _TINY, torch.copysign(torch.full_like(scale, _TINY), scale), scale
        )
        return scale, None
    if symmetric:
        scale = torch.maximum(hi, lo.neg())  # max|x|, exactly, for finite values
        if clip != 1.0:
            scale.mul_(clip)
    else:
        if include_zero:
            lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        if clip != 1.0:  # x * 1.0 == x: the multiply is skipped
            lo, hi = lo * clip, hi * clip
        scale = hi - lo
    scale.div_(qmax + 0.5 if scale_rule == "absmax_half" else float(qmax))  # >= 0
    smin, smax = torch.aminmax(scale)
    if not math.isfinite(smax):  # NaN/Inf in x, or a finite range that overflowed
        _require_finite(lo, hi)
    if smin < _TINY:  # an all-zero group gets scale 1, a subnormal one the smallest normal
        is_zero = scale == 0
        scale = scale.clamp_min_(_TINY).masked_fill_(is_zero, 1.0)
    if symmetric:
        return scale, None
    return scale, torch.div(lo, scale).neg_().round_().clamp_(0, qmax)  # round(-lo / scale)


def _round_(y: Tensor, rounding: str, offset: float) -> Tensor:
    """Round fp32 ``y`` to integers in place; ``offset`` is the unsigned-code offset for
    ``half_up``."""
    if rounding == "half_even":
        return y.round_()
    if rounding == "half_away":
        whole = torch.trunc(y)
        # whole + trunc(2 * (y - whole)); exact: y - trunc(y) is exact in fp
        return y.sub_(whole).mul_(2.0).trunc_().add_(whole)
    return y.add_(offset + 0.5).floor_().sub_(offset)


def _codes(
    xg: Tensor, scale: Tensor, zero: Tensor | None, bits: int, symmetric: bool, rounding: str
) -> Tensor:
    """fp32 values and broadcastable fp32 stats → fp32 integer-valued codes (clamped), in one
    new tensor updated in place."""
    qmin, qmax = int_qrange(bits, symmetric)
    q = torch.mul(xg, torch.reciprocal(scale))  # the only full-size allocation
    if zero is None:
        _round_(q, rounding, float(-qmin))
    elif rounding == "half_up":
        q.add_(zero).add_(0.5).floor_()
    else:
        _round_(q, rounding, 0.0).add_(zero)
    return q.clamp_(qmin, qmax)


def _decode_(q: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    """fp32 codes and stats → fp32 values in place: ``q * scale`` or ``(q - zero) * scale``."""
    if zero is None:
        return q.mul_(scale)
    return q.sub_(zero).mul_(scale)


def _decode(q: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    """fp32 codes and stats → fp32 values: ``q * scale`` or ``(q - zero) * scale``."""
    if zero is None:
        return q * scale
    return (q - zero) * scale


def _unsigned_codes(q: Tensor, bits: int, symmetric: bool) -> Tensor:
    """fp32 integer-valued codes in ``int_qrange(bits, symmetric)`` → uint8 ``q + 2**(b-1)``
    (symmetric) or ``q``. Goes through int8, whose conversion from fp32 is several times faster
    than uint8's; ``q`` may be overwritten."""
    if bits == 8 and not symmetric:
        q = q.sub_(128.0)  # exact: small integers; [0, 255] → [-128, 127]
    u = q.to(torch.int8).view(torch.uint8)  # two's complement: q mod 256
    if bits == 8:
        return u.bitwise_xor_(0x80)  # + 128 mod 256
    return u.add_(2 ** (bits - 1)) if symmetric else u


def _mse_scale_zero(
    xg: Tensor,
    bits: int,
    symmetric: bool,
    clip_ratio: float,
    scale_rule: str,
    rounding: str,
    grid: int,
    max_shrink: float,
    norm: float,
) -> tuple[Tensor, Tensor | None]:
    """Per group, pick the shrink factor p in {1, 1 - 1/grid, ...} minimising sum |err|^norm."""
    lo, hi = _group_range(xg, symmetric, scale_rule)
    best_scale, best_zero = _scale_zero_from_range(
        lo, hi, bits, symmetric, clip_ratio, scale_rule, True
    )
    best_err = _group_err(xg, best_scale, best_zero, bits, symmetric, rounding, norm)
    for i in range(1, int(max_shrink * grid)):
        shrink = 1.0 - i / grid
        scale, zero = _scale_zero_from_range(
            lo, hi, bits, symmetric, clip_ratio * shrink, scale_rule, True
        )
        err = _group_err(xg, scale, zero, bits, symmetric, rounding, norm)
        better = err < best_err  # [..., G, 1]; ties keep the larger clip
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _group_err(xg, scale, zero, bits, symmetric, rounding, norm) -> Tensor:
    err = _decode_(_codes(xg, scale, zero, bits, symmetric, rounding), scale, zero).sub_(xg)
    return err.abs_().pow_(norm).sum(-1, keepdim=True)  # [..., G, 1]


def _grouped_stats(
    xg: Tensor,
    bits: int,
    symmetric: bool,
    clip_ratio: float,
    mse_search: bool,
    scale_rule: str,
    rounding: str,
    mse_grid: int,
    mse_max_shrink: float,
    mse_norm: float,
) -> tuple[Tensor, Tensor | None]:
    if mse_search:
        return _mse_scale_zero(
            xg,
            bits,
            symmetric,
            clip_ratio,
            scale_rule,
            rounding,
            mse_grid,
            mse_max_shrink,
            mse_norm,
        )
    lo, hi = _group_range(xg, symmetric, scale_rule)
    return _scale_zero_from_range(lo, hi, bits, symmetric, clip_ratio, scale_rule, True)


# ----------------------------------------------------------------------------- public functions


def int_scale_zero(
    x: Tensor,
    bits: int,
    *,
    symmetric: bool = True,
    axis: int | None = -1,
    group_size: int | None = None,
    clip_ratio: float = 1.0,
    mse_search: bool = False,
    scale_rule: str = "absmax",
    rounding: str = "half_even",
    mse_grid: int = 100,
    mse_max_shrink: float = 0.8,
    mse_norm: float = 2.0,
) -> tuple[Tensor, Tensor | None]:
    """Scale and zero point for groups of ``group_size`` along ``axis``.

    Args:
        x: float tensor, any shape, finite.
        bits: code width (2..8 symmetric, 1..8 asymmetric).
        symmetric, axis, group_size, scale_rule, rounding: see module conventions.
        clip_ratio: fraction of the range kept (values beyond are clamped).
        mse_search: per group, search shrink factors ``1, 1 - 1/mse_grid, ...`` down to
            ``1 - mse_max_shrink`` (exclusive) on top of ``clip_ratio`` and keep the one with the
            smallest ``sum |x - dequant(quant(x))|**mse_norm`` (GPTQ's grid search).

    Returns:
        ``(scale, zero)``, fp32, of shape ``x.shape`` with ``axis`` replaced by ``n_groups``
        (all ones when ``axis=None``); ``zero`` holds integers and is None when symmetric.
    """
    _check_bits(bits, symmetric)
    _check_float(x, finite=False)  # NaN/Inf: checked on the group statistics
    _check_options(clip_ratio, rounding, scale_rule, symmetric)
    xg = _to_groups(x.float(), axis, group_size)  # [..., G, g]
    scale, zero = _grouped_stats(
        xg,
        bits,
        symmetric,
        clip_ratio,
        mse_search,
        scale_rule,
        rounding,
        mse_grid,
        mse_max_shrink,
        mse_norm,
    )
    scale = _stat_to_public(scale, x.dim(), axis)
    zero = None if zero is None else _stat_to_public(zero, x.dim(), axis)
    return scale, zero


def _align_stats(x_shape, scale, zero, axis, group_size):
    """Public-layout stats → a function mapping tensors to the grouped layout, plus stats."""
    ndim = len(x_shape)
    if group_size is None and axis is not None:
        # already broadcastable against x (e.g. a GPTQ column slice); check it is
        shape = torch.broadcast_shapes(tuple(x_shape), tuple(scale.shape))
        if tuple(shape) != tuple(x_shape):
            raise LowbitError(
                f"scale of shape {tuple(scale.shape)} does not broadcast to x of shape {tuple(x_shape)}"
            )
        return None, scale, zero
    return (
        "grouped",
        _stat_to_groups(scale, ndim, axis),
        (None if zero is None else _stat_to_groups(zero, ndim, axis)),
    )


def int_quantize_with(
    x: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    bits: int,
    *,
    symmetric: bool = True,
    axis: int | None = -1,
    group_size: int | None = None,
    rounding: str = "half_even",
) -> Tensor:
    """Integer codes of ``x`` for given statistics.

    Args:
        x: float tensor ``[...]``.
        scale, zero: as returned by :func:`int_scale_zero` for the same ``axis``/``group_size``;
            with ``group_size=None`` anything that broadcasts to ``x`` (e.g. ``[rows, 1]`` for
            a column slice ``[rows, 1]``).
        bits, symmetric, axis, group_size, rounding: see module conventions.

    Returns:
        codes with ``x``'s shape: int8 in ``[-2**(b-1), 2**(b-1)-1]`` when symmetric, uint8 in
        ``[0, 2**b - 1]`` otherwise.
    """
    _check_bits(bits, symmetric)
    _check_float(x)
    if rounding not in _ROUNDINGS:
        raise LowbitError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if symmetric != (zero is None):
        raise LowbitError("zero must be None exactly when symmetric=True")
    mode, s, z = _align_stats(
        x.shape, scale.float(), None if zero is None else zero.float(), axis, group_size
    )
    if mode is None:
        q = _codes(x.float(), s, z, bits, symmetric, rounding)
    else:
        xg = _to_groups(x.float(), axis, group_size)
        q = _from_groups(_codes(xg, s, z, bits, symmetric, rounding), x.shape, axis)
    return q.to(torch.int8 if symmetric else torch.uint8)


def int_dequantize_with(
    q: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    *,
    symmetric: bool = True,
    axis: int | None = -1,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Values from codes: ``q * scale`` (symmetric) or ``(q - zero) * scale``, computed in fp32.

    Args:
        q: integer codes ``[...]`` from :func:`int_quantize_with`.
        scale, zero, symmetric, axis, group_size: as for :func:`int_quantize_with`.
        dtype: output dtype (the fp32 result is cast once).

    Returns:
        tensor of ``q``'s shape and dtype ``dtype``.
    """
    if symmetric != (zero is None):
        raise LowbitError("zero must be None exactly when symmetric=True")
    mode, s, z = _align_stats(
        q.shape, scale.float(), None if zero is None else zero.float(), axis, group_size
    )
    if mode is None:
        out = _decode(q.float(), s, z)
    else:
        qg = _to_groups(q.float(), axis, group_size)
        out = _from_groups(_decode(qg, s, z), q.shape, axis)
    return out.to(dtype)


def _round_stat(stat: Tensor, scale_dtype: torch.dtype) -> Tensor:
    if scale_dtype not in _STAT_BITS:
        raise LowbitError(f"scale_dtype must be float32, float16 or bfloat16, got {scale_dtype}")
    return stat if scale_dtype == torch.float32 else stat.to(scale_dtype).float()


def fake_quant_int(
    x: Tensor,
    bits: int,
    *,
    symmetric: bool = True,
    axis: int | None = -1,
    group_size: int | None = None,
    clip_ratio: float = 1.0,
    mse_search: bool = False,
    scale_rule: str = "absmax",
    rounding: str = "half_even",
    scale_dtype: torch.dtype = torch.float32,
    scale_bits: int | None = None,
    scale_group: int | None = None,
) -> Tensor:
    """Quantize then dequantize ``x``; equals ``IntQuantized.from_float(...).dequantize()`` bit
    for bit. Output has ``x``'s shape and dtype. Arguments as for :meth:`IntQuantized.from_float`.
    """
    if scale_bits is not None:
        return IntQuantized.from_float(
            x, bits, symmetric=symmetric, axis=axis, group_size=group_size, clip_ratio=clip_ratio,
            mse_search=mse_search, scale_rule=scale_rule, rounding=rounding,
            scale_dtype=scale_dtype, scale_bits=scale_bits, scale_group=scale_group,
        ).dequantize()  # fmt: skip
    _check_bits(bits, symmetric)
    _check_float(x, finite=False)  # NaN/Inf: checked on the group statistics
    _check_options(clip_ratio, rounding, scale_rule, symmetric)
    xg = _to_groups(x.float(), axis, group_size)  # [..., G, g]
    scale, zero = _grouped_stats(
        xg, bits, symmetric, clip_ratio, mse_search, scale_rule, rounding, 100, 0.8, 2.0
    )
    q = _codes(xg, scale, zero, bits, symmetric, rounding)  # [..., G, g]
    out = _decode_(q, _round_stat(scale, scale_dtype), zero)
    return _from_groups(out, x.shape, axis).to(x.dtype)


# ----------------------------------------------------------------------------- packed container


@dataclass
class IntQuantized:
    """A packed integer-quantized tensor.

    Fields:
        qdata: uint8 bit stream of the unsigned codes (``q + 2**(b-1)`` when symmetric), the
            tensor flattened in row-major order (see :mod:`lowbit.formats.packing`).
        scale: fp32 first-order scales, public stats layout (x's shape, axis → n_groups), the
            values exactly as used (already rounded to ``scale_dtype`` / double-dequantized).
        zero: fp32 zero points (same layout) or None when symmetric: integers counted at
            ``bits`` each, or, when ``zero_dtype`` is set, real values stored in that dtype.
        scale_q: when double-quantized, the second-order :class:`IntQuantized` of the scales
            (asymmetric, ``scale_bits`` bits, groups of ``scale_group`` along the other axis of
            a 2-d tensor, fp16 second-order scale and zero); else None.
    """

    qdata: Tensor
    scale: Tensor
    zero: Tensor | None
    bits: int
    symmetric: bool
    axis: int | None
    group_size: int | None
    shape: torch.Size
    dtype: torch.dtype
    scale_dtype: torch.dtype = torch.float32
    scale_q: IntQuantized | None = None
    zero_dtype: torch.dtype | None = None

    @classmethod
    def from_float(
        cls,
        x: Tensor,
        bits: int,
        *,
        symmetric: bool = True,
        axis: int | None = -1,
        group_size: int | None = None,
        clip_ratio: float = 1.0,
        mse_search: bool = False,
        scale_bits: int | None = None,
        scale_group: int | None = None,
        scale_rule: str = "absmax",
        rounding: str = "half_even",
        scale_dtype: torch.dtype = torch.float32,
    ) -> IntQuantized:
        """Quantize and pack ``x``.

        Args:
            x: float tensor, any shape (2-d when ``scale_bits`` is given).
            bits ... mse_search, scale_rule, rounding: see :func:`int_scale_zero`.
            scale_bits: if set, 2-order quantization (Li et al., 2024, eqs. 6-7): the first-order
                scales are quantized asymmetrically (min-max range) to ``scale_bits`` bits in
                groups of ``scale_group`` along the other axis, with fp16 second-order scales and
                fp16 real-valued zeros (see :func:`_quantize_scales`). Codes of ``x`` are then
                chosen with the dequantized scales.
            scale_group: group size of the second-order statistics (None = whole axis).
            scale_dtype: storage dtype of the (first-order, or second-order if double) scales.
        """
        _check_bits(bits, symmetric)
        _check_float(x, finite=False)  # NaN/Inf: checked on the group statistics
        _check_options(clip_ratio, rounding, scale_rule, symmetric)
        _round_stat(torch.zeros(1), scale_dtype)
        xg = _to_groups(x.float(), axis, group_size)  # [..., G, g]
        scale, zero = _grouped_stats(
            xg, bits, symmetric, clip_ratio, mse_search, scale_rule, rounding, 100, 0.8, 2.0
        )
        scale_q = None
        if scale_bits is not None:
            if x.dim() != 2 or axis is None:
                raise LowbitError("scale_bits (2-order quantization) needs a 2-d x and an axis")
            if scale_rule == "signed_max":
                raise LowbitError("scale_bits needs positive scales; use scale_rule='absmax'")
            public = _stat_to_public(scale, 2, axis)  # [rows, G] or [G, cols]
            other = 1 - _norm_axis(axis, 2)
            scale_q = _quantize_scales(public, scale_bits, other, scale_group, torch.float16)
            scale = _stat_to_groups(scale_q.dequantize().clamp_min(_TINY), 2, axis)
            if not symmetric:  # zero point re-derived for the scale actually used
                lo = (xg.amin(-1, keepdim=True).clamp(max=0.0)) * clip_ratio
                zero = torch.round(-lo / scale).clamp_(0, 2**bits - 1)
            q = _codes(xg, scale, zero, bits, symmetric, rounding)
            stored_scale = scale
        else:
            q = _codes(xg, scale, zero, bits, symmetric, rounding)  # [..., G, g]
            stored_scale = _round_stat(scale, scale_dtype)
        unsigned = _unsigned_codes(_from_groups(q, x.shape, axis), bits, symmetric)
        return cls(
            qdata=pack_bits(unsigned.reshape(-1), bits, check_range=False),
            scale=_stat_to_public(stored_scale, x.dim(), axis),
            zero=None if zero is None else _stat_to_public(zero, x.dim(), axis),
            bits=bits,
            symmetric=symmetric,
            axis=axis,
            group_size=group_size,
            shape=x.shape,
            dtype=x.dtype,
            scale_dtype=torch.float16 if scale_bits is not None else scale_dtype,
            scale_q=scale_q,
        )

    def to(self, device: torch.device | str) -> IntQuantized:
        """The same container with its tensors on ``device`` (itself when already there)."""
        device = torch.device(device)
        if self.qdata.device == device:
            return self
        return replace(
            self,
            qdata=self.qdata.to(device),
            scale=self.scale.to(device),
            zero=None if self.zero is None else self.zero.to(device),
            scale_q=None if self.scale_q is None else self.scale_q.to(device),
        )

    def codes(self) -> Tensor:
        """Signed (symmetric, int8) or unsigned (uint8) codes with the original shape."""
        n = math.prod(self.shape)
        unsigned = unpack_bits(self.qdata, self.bits, n).reshape(self.shape)
        if self.symmetric:
            return (unsigned.to(torch.int16) - 2 ** (self.bits - 1)).to(torch.int8)
        return unsigned

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """Values of shape ``shape`` and dtype ``dtype`` (default: the input's dtype)."""
        return int_dequantize_with(
            self.codes(),
            self.scale,
            self.zero,
            symmetric=self.symmetric,
            axis=self.axis,
            group_size=self.group_size if self.axis is not None else None,
            dtype=self.dtype if dtype is None else dtype,
        )

    def storage_bits(self) -> int:
        """Exact storage in bits: codes (unpadded, ``numel * bits``) + every statistic.

        First-order scales count ``scale_dtype`` bits each, integer zeros ``bits`` each; with
        2-order quantization the first-order scales count as the nested container's storage.
        """
        n = math.prod(self.shape)
        total = n * self.bits
        n_stats = self.scale.numel()
        if self.scale_q is not None:
            total += self.scale_q.storage_bits()
        else:
            total += n_stats * _STAT_BITS[self.scale_dtype]
        if self.zero is not None:
            zero_bits = self.bits if self.zero_dtype is None else _STAT_BITS[self.zero_dtype]
            total += n_stats * zero_bits
        return total

    def packed_bytes(self) -> int:
        """Bytes held by ``qdata`` (the code stream padded to whole bytes)."""
        return packed_words_per_row(math.prod(self.shape), self.bits) if self.shape else 0

    def bits_per_element(self) -> float:
        """``storage_bits() / numel``."""
        return self.storage_bits() / math.prod(self.shape)


def _quantize_scales(
    scale: Tensor, scale_bits: int, axis: int, scale_group: int | None, stat_dtype: torch.dtype
) -> IntQuantized:
    """Second-order quantization of positive first-order scales.

    Min-max asymmetric: ``s2 = (hi - lo) / (2**scale_bits - 1)``, a real-valued zero ``z2 =
    -lo / s2`` (the scales never include 0, so an integer zero in ``[0, 2**b - 1]`` cannot
    express their range), codes ``round(scale / s2 + z2)``; ``s2`` and ``z2`` are stored as
    ``stat_dtype`` (SpQR's fp16 second-order statistics).
    """
    _check_bits(scale_bits, False)
    qmax = 2**scale_bits - 1
    sg = _to_groups(scale, axis, scale_group)  # [..., G2, g2]
    lo, hi = torch.aminmax(sg, dim=-1, keepdim=True)  # [..., G2, 1]
    s2 = (hi - lo) / qmax
    s2 = torch.where(s2 == 0, hi.clamp_min(_TINY), s2)  # constant group: code 1 gives it back
    z2 = torch.where(hi == lo, torch.zeros_like(lo), -lo / s2)
    q = torch.round(sg * torch.reciprocal(s2) + z2).clamp_(0, qmax)
    unsigned = _from_groups(q, scale.shape, axis).to(torch.uint8)
    return IntQuantized(
        qdata=pack_bits(unsigned.reshape(-1), scale_bits),
        scale=_stat_to_public(_round_stat(s2, stat_dtype), scale.dim(), axis),
        zero=_stat_to_public(_round_stat(z2, stat_dtype), scale.dim(), axis),
        bits=scale_bits,
        symmetric=False,
        axis=axis,
        group_size=scale_group,
        shape=scale.shape,
        dtype=torch.float32,
        scale_dtype=stat_dtype,
        zero_dtype=stat_dtype,
    )
