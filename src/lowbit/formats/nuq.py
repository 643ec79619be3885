"""Non-uniform quantization (NUQ): nearest entry of a codebook after per-vector normalization.

Normalization (KVQuant, Hooper et al., 2024): along ``axis`` (the reduction axis, as in
:mod:`lowbit.formats.intq`; keys per channel = ``axis=-2`` over tokens, values per token =
``axis=-1``), each vector is mapped to ``[-1, 1]``: ``"minmax"`` uses ``center = (max + min) / 2``,
``half_range = (max - min) / 2``; ``"absmax"`` uses ``center = 0``, ``half_range = max|x|``;
``None`` skips it (codebook in the data's units). A zero half range becomes 1.

Codebook: ``[K]`` (per tensor or per layer) or ``[C, K]`` per channel, ``C`` being the length of
``codebook_axis`` of ``x``; ``K`` a power of two up to 256, entries sorted ascending. A value
goes to the nearest entry; a value exactly between two entries goes to the lower one.
Dequantized value: ``codebook[idx] * half_range + center`` in fp32.

Codebooks are fitted by weighted k-means in 1-D (:func:`fit_codebook`, Lloyd-Max with per-sample
weights such as Fisher information; KVQuant's sensitivity-weighted nuqX) or taken fixed
(:func:`normal_float_codebook`, QLoRA's NF4 construction). NaN/Inf in ``x``, empty or integer
tensors raise :class:`~lowbit.errors.LowbitError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.packing import pack_bits, unpack_bits

__all__ = [
    "fit_codebook",
    "normal_float_codebook",
    "nuq_normalize",
    "nuq_quantize",
    "nuq_dequantize",
    "fake_quant_nuq",
    "NUQQuantized",
]

_NORMS = ("minmax", "absmax", None)


def _check_x(x: Tensor, name: str = "x") -> None:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise LowbitError(
            f"{name} must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}"
        )
    if x.numel() == 0 or x.dim() == 0:
        raise LowbitError(f"{name} is empty or 0-d (shape {tuple(x.shape)})")
    if not bool(torch.isfinite(x).all()):
        raise LowbitError(f"{name} contains NaN or Inf; a codebook has no entry for them")


def _check_codebook(codebook: Tensor) -> int:
    if not isinstance(codebook, Tensor) or codebook.dim() not in (1, 2):
        raise LowbitError("codebook must be a [K] or [C, K] float tensor")
    k = codebook.shape[-1]
    if k < 2 or k > 256 or k & (k - 1):
        raise LowbitError(f"codebook size K must be a power of two in 2..256, got {k}")
    if bool((codebook.diff(dim=-1) < 0).any()):
        raise LowbitError("codebook entries must be sorted ascending along the last axis")
    return int(math.log2(k))


def normal_float_codebook(bits: int = 4, offset: float = 0.9677083) -> Tensor:
    """NF codebook (QLoRA): ``2**(b-1)`` positive and ``2**(b-1) - 1`` negative normal
    quantiles at probabilities evenly spaced in ``[0.5, offset]``, plus an exact 0, scaled to
    ``[-1, 1]``. ``bits=4`` gives NF4. Returns fp32 ``[2**bits]``, ascending."""
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise LowbitError(f"bits must be an integer in 2..8, got {bits!r}")
    half = 2 ** (bits - 1)
    probs_pos = torch.linspace(offset, 0.5, half + 1, dtype=torch.float64)[:-1]
    probs_neg = torch.linspace(offset, 0.5, half, dtype=torch.float64)[:-1]
    pos = torch.special.ndtri(probs_pos)
    neg = -torch.special.ndtri(probs_neg)
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg])
    values = values / values.abs().max()
    return values.sort().values.float()


def _weighted_quantiles(x_sorted: Tensor, w_sorted: Tensor, probs: Tensor) -> Tensor:
    cum = torch.cumsum(w_sorted, 0)
    cum = cum / cum[-1]
    idx = torch.searchsorted(cum, probs.to(cum.dtype)).clamp_(max=x_sorted.numel() - 1)
    return x_sorted[idx]


def fit_codebook(
    samples: Tensor,
    n_levels: int,
    weights: Tensor | None = None,
    *,
    max_iter: int = 100,
    tol: float = 1e-7,
    pin_ends: bool = False,
    init: Tensor | None = None,
) -> Tensor:
    """Weighted 1-D k-means (Lloyd-Max) codebook.

    Minimises ``sum_i w_i (x_i - c[a(i)])**2`` over ``n_levels`` centroids, starting from
    ``init`` or, by default, the weighted quantiles at ``(j + 0.5) / n_levels``. Each step
    assigns samples to the nearest centroid (midpoint boundaries, ties to the lower one) and
    moves each centroid to the weighted mean of its samples; a centroid with no weight moves
    into the cell with the largest error (:func:`_reseed`), so no step raises the objective.
    Stops after ``max_iter`` steps or when no centroid moves more than ``tol`` times the data
    range. Lloyd finds a local minimum only: under heavy-tailed weights the quantile start can
    end worse than a plain grid, and starting from that grid (``init``, its ends pinned where
    ``pin_ends`` pins them) ends no worse.

    Args:
        samples: float tensor, any shape (flattened), finite.
        n_levels: number of centroids ``K`` (2..65536).
        weights: non-negative tensor of ``samples``' shape (e.g. Fisher information), or None.
        pin_ends: keep the first and last centroid at the smallest and largest sample (only
            the inner ones move), e.g. for data clamped to a range whose ends must stay exact.
        init: ``[n_levels]`` ascending starting centroids (None: the weighted quantiles).

    Returns:
        fp32 ``[K]`` ascending (duplicates possible if the data has fewer distinct values).
    """
    _check_x(samples, "samples")
    if not isinstance(n_levels, int) or not 2 <= n_levels <= 65536:
        raise LowbitError(f"n_levels must be an integer in 2..65536, got {n_levels!r}")
    x = samples.reshape(-1).double()
    if weights is None:
        w = torch.ones_like(x)
    else:
        if weights.shape != samples.shape:
            raise LowbitError(
                f"weights shape {tuple(weights.shape)} != samples shape {tuple(samples.shape)}"
            )
        w = weights.reshape(-1).double()
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or float(w.sum()) <= 0:
            raise LowbitError("weights must be finite, non-negative and not all zero")
    x_sorted, order = torch.sort(x)  # [N]
    w_sorted = w[order]
    if init is None:
        probs = (torch.arange(n_levels, dtype=torch.float64, device=x.device) + 0.5) / n_levels
        centroids = _weighted_quantiles(x_sorted, w_sorted, probs)  # [K]
    else:
        if init.shape != (n_levels,) or bool((init.diff() < 0).any()):
            raise LowbitError(f"init must be {n_levels} ascending centroids")
        centroids = init.to(x).clone()
    ends = x_sorted[[0, -1]]
    if pin_ends:
        centroids[[0, -1]] = ends
    span = float(x_sorted[-1] - x_sorted[0]) or 1.0
    # samples are sorted, so each cluster is a contiguous run: use prefix sums, O(K log N) a step
    zero = torch.zeros(1, dtype=torch.float64, device=x.device)
    cum_w = torch.cat([zero, torch.cumsum(w_sorted, 0)])  # [N+1]
    cum_wx = torch.cat([zero, torch.cumsum(w_sorted * x_sorted, 0)])  # [N+1]
    cum_wxx = torch.cat([zero, torch.cumsum(w_sorted * x_sorted.square(), 0)])  # [N+1]
    n = torch.tensor([x_sorted.numel()], device=x.device)
    for _ in range(max_iter):
        bounds = (centroids[1:] + centroids[:-1]) / 2  # [K-1]
        cuts = torch.searchsorted(x_sorted, bounds, right=True)  # x <= bound → lower cluster
        edges = torch.cat([n * 0, cuts, n])  # [K+1]
        mass = cum_w[edges[1:]] - cum_w[edges[:-1]]  # [K]
        moment = cum_wx[edges[1:]] - cum_wx[edges[:-1]]
        updated = torch.where(mass > 0, moment / mass.clamp_min(1e-300), centroids)
        if pin_ends:
            updated[[0, -1]] = ends
        dead = mass <= 0
        if pin_ends:
            dead[[0, -1]] = False
        if bool(dead.any()):
            second = cum_wxx[edges[1:]] - cum_wxx[edges[:-1]]
            _reseed(updated, dead, mass, moment, second)
        updated = updated.sort().values
        moved = float((updated - centroids).abs().max())
        centroids = updated
        if moved <= tol * span:
            break
    return centroids.float()


def _reseed(centroids: Tensor, dead: Tensor, mass: Tensor, moment: Tensor, second: Tensor) -> None:
    """Move each dead centroid (no weight in its cell) in place to one standard deviation
    above the mean of a live cell, the cells with the largest weighted squared error first, so
    the next step splits them. A centroid that served no sample can go anywhere without raising
    the objective; where no cell has any error left it stays."""
    safe = mass.clamp_min(1e-300)
    error = (second - moment.square() / safe).clamp_min(0).masked_fill(mass <= 0, 0)  # [K]
    top = error.topk(int(dead.sum()))
    dead_index = dead.nonzero()[:, 0]
    for index, cell, cell_error in zip(dead_index, top.indices, top.values, strict=True):
        if cell_error > 0:
            centroids[index] = moment[cell] / safe[cell] + (cell_error / safe[cell]).sqrt()


_STAT_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}


def nuq_normalize(
    x: Tensor,
    axis: int | None = -1,
    normalize: str | None = "minmax",
    stat_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Per-vector ``(center, half_range)`` along ``axis`` (keepdim, fp32 holding values rounded
    to ``stat_dtype``, the dtype they are stored in). See module doc."""
    if stat_dtype not in _STAT_BITS:
        raise LowbitError(f"stat_dtype must be float32, float16 or bfloat16, got {stat_dtype}")
    if normalize not in _NORMS:
        raise LowbitError(f"normalize must be one of {_NORMS}, got {normalize!r}")
    xf = x.float()
    dims = tuple(range(x.dim())) if axis is None else (axis,)
    if normalize is None:
        ones = torch.ones([1] * x.dim(), device=x.device)
        return torch.zeros_like(ones), ones
    if normalize == "absmax":
        half = xf.abs().amax(dim=dims, keepdim=True)
        center = torch.zeros_like(half)
    else:
        hi, lo = xf.amax(dim=dims, keepdim=True), xf.amin(dim=dims, keepdim=True)
        half, center = (hi - lo) / 2, (hi + lo) / 2
    center, half = center.to(stat_dtype).float(), half.to(stat_dtype).float()
    return center, torch.where(half == 0, torch.ones_like(half), half)


def _nearest(xn: Tensor, codebook: Tensor, codebook_axis: int) -> Tensor:
    """Index of the nearest codebook entry (ties → lower) for normalized fp32 ``xn``."""
    bounds = (codebook[..., 1:] + codebook[..., :-1]) / 2  # [K-1] or [C, K-1]
    if codebook.dim() == 1:
        return torch.bucketize(xn, bounds, right=False)
    ax = codebook_axis % xn.dim()
    if xn.shape[ax] != codebook.shape[0]:
        raise LowbitError(
            f"per-channel codebook has {codebook.shape[0]} rows but axis {codebook_axis} of x has "
            f"{xn.shape[ax]} entries"
        )
    moved = xn.movedim(ax, 0)  # [C, ...]
    flat = moved.reshape(moved.shape[0], -1).contiguous()  # [C, M]
    idx = torch.searchsorted(bounds.contiguous(), flat, right=False)  # [C, M]
    return idx.reshape(moved.shape).movedim(0, ax)


def _lookup(idx: Tensor, codebook: Tensor, codebook_axis: int) -> Tensor:
    if codebook.dim() == 1:
        return codebook[idx]
    ax = codebook_axis % idx.dim()
    moved = idx.movedim(ax, 0)  # [C, ...]
    flat = moved.reshape(moved.shape[0], -1)
    vals = torch.gather(codebook, 1, flat)  # [C, M]
    return vals.reshape(moved.shape).movedim(0, ax)


def nuq_quantize(
    x: Tensor,
    codebook: Tensor,
    *,
    axis: int | None = -1,
    normalize: str | None = "minmax",
    codebook_axis: int = -1,
    stat_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """Codebook indices of ``x``.

    Args:
        x: float tensor, any shape, finite.
        codebook: ``[K]`` or ``[C, K]`` ascending (see module doc).
        axis: normalization reduction axis (None = per tensor).
        normalize: ``"minmax"``, ``"absmax"`` or None.
        codebook_axis: for a ``[C, K]`` codebook, the axis of ``x`` of length ``C``.
        stat_dtype: storage dtype of the normalization stats (they are rounded to it).

    Returns:
        ``(idx, center, half_range)``: uint8 indices of ``x``'s shape, and fp32 keepdim stats.
    """
    _check_x(x)
    _check_codebook(codebook)
    center, half = nuq_normalize(x, axis, normalize, stat_dtype)
    xn = (x.float() - center) / half
    idx = _nearest(xn, codebook.float().to(x.device), codebook_axis)
    return idx.to(torch.uint8), center, half


def nuq_dequantize(
    idx: Tensor, codebook: Tensor, center: Tensor, half_range: Tensor, *, codebook_axis: int = -1
) -> Tensor:
    """fp32 ``codebook[idx] * half_range + center``."""
    return _lookup(idx.long(), codebook.float(), codebook_axis) * half_range + center


def fake_quant_nuq(
    x: Tensor,
    codebook: Tensor,
    *,
    axis: int | None = -1,
    normalize: str | None = "minmax",
    codebook_axis: int = -1,
    stat_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """NUQ quantize then dequantize; same shape and dtype as ``x``; equals
    ``NUQQuantized.from_float(...).dequantize()`` bit for bit."""
    idx, center, half = nuq_quantize(
        x,
        codebook,
        axis=axis,
        normalize=normalize,
        codebook_axis=codebook_axis,
        stat_dtype=stat_dtype,
    )
    return nuq_dequantize(idx, codebook, center, half, codebook_axis=codebook_axis).to(x.dtype)


@dataclass
class NUQQuantized:
    """Packed NUQ tensor: ``log2(K)``-bit indices as a uint8 stream (row-major), the codebook
    and the per-vector normalization stats."""

    qdata: Tensor
    codebook: Tensor
    center: Tensor
    half_range: Tensor
    normalize: str | None
    codebook_axis: int
    shape: torch.Size
    dtype: torch.dtype
    stat_dtype: torch.dtype = torch.float32

    @classmethod
    def from_float(
        cls,
        x: Tensor,
        codebook: Tensor,
        *,
        axis: int | None = -1,
        normalize: str | None = "minmax",
        codebook_axis: int = -1,
        stat_dtype: torch.dtype = torch.float32,
    ) -> NUQQuantized:
        """Quantize and pack (arguments as for :func:`nuq_quantize`)."""
        idx, center, half = nuq_quantize(
            x,
            codebook,
            axis=axis,
            normalize=normalize,
            codebook_axis=codebook_axis,
            stat_dtype=stat_dtype,
        )
        bits = _check_codebook(codebook)
        return cls(
            qdata=pack_bits(idx.reshape(-1), bits),
            codebook=codebook.float(),
            center=center,
            half_range=half,
            normalize=normalize,
            codebook_axis=codebook_axis,
            shape=x.shape,
            dtype=x.dtype,
            stat_dtype=stat_dtype,
        )

    @property
    def bits(self) -> int:
        return int(math.log2(self.codebook.shape[-1]))

    def indices(self) -> Tensor:
        return unpack_bits(self.qdata, self.bits, math.prod(self.shape)).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        out = nuq_dequantize(
            self.indices(),
            self.codebook,
            self.center,
            self.half_range,
            codebook_axis=self.codebook_axis,
        )
        return out.to(self.dtype if dtype is None else dtype)

    def storage_bits(self, include_codebook: bool = True) -> int:
        """Index bits + normalization stats (``stat_dtype`` bits each: two per vector for
        minmax, one for absmax, none for None) + the fp32 codebook (32 bits per entry) unless it
        is shared and accounted elsewhere (``include_codebook=False``)."""
        total = math.prod(self.shape) * self.bits
        n_stats = {"minmax": 2, "absmax": 1, None: 0}[self.normalize]
        total += n_stats * self.half_range.numel() * _STAT_BITS[self.stat_dtype]
        if include_codebook:
            total += self.codebook.numel() * 32
        return total

    def bits_per_element(self, include_codebook: bool = True) -> float:
        return self.storage_bits(include_codebook) / math.prod(self.shape)
