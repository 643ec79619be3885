"""Intra-matrix 2/4-bit mixed precision with 2-order scales, exclusive fp16 outliers and a
memory-aligned layout (Li et al., 2024, "2/4/16-bit in a weight matrix").

A weight ``W [N, K]`` (N output rows, K input columns) is stored as follows.

* **Groups.** Column group ``g`` is the ``GROUP = 16`` input channels ``[16g, 16g + 16)`` of
  every row (the paper's g1). A group is 2-bit or 4-bit for the whole matrix: the choice is per
  input-channel group (eq. 9's sensitivity, made by :mod:`lowbit.algorithms.mixed`). When K
  is not a multiple of 16 the last group is padded: its missing columns hold the row's zero
  point (they decode to 0) and the kernels mask their activations.
* **First order** (per row and group, eqs. 2-5): asymmetric codes ``q`` in ``[0, 2**b - 1]``,
  an integer zero ``z`` of ``b`` bits and a scale ``s``: ``w = (q - z) * s``. The range always
  includes 0 (so ``z`` is a code and a code decodes to exactly 0).
* **Second order** (eqs. 6-7, 10): the scales of one column group are quantized again along
  the output channels in groups of ``g2`` rows (default 16) to ``SCALE_BITS = 4`` bits:
  ``s = (c - z2) * s2`` with a 4-bit code ``c``, an fp16 scale ``s2`` and an integer zero
  ``z2`` stored in an fp16 slot ("zero padding": eq. 10 counts ``N_s`` bits for it, the slot
  holds 16 so that ``(s2, z2)`` is one aligned 32-bit pair). ``s2 >= hi / 2000`` keeps
  ``|z2| <= 2048`` (exact in fp16), and ``c > z2`` keeps every scale positive. ``(c - z2) *
  s2`` is exact in fp32 (an 11-bit integer times an fp16), so every path decodes the same
  scale bit for bit. The 4-bit groups' scales get the same second order in their own groups.
* **Scale clipping.** 2-bit groups are stored in triplets. A triplet's three 2-bit zeros and
  three scale codes fit one 16-bit word: the first code in 4 bits, the other two in 3 bits,
  which index :data:`CLIP_LEVELS` (eight of the sixteen 4-bit codes). The triplet position
  with the 4-bit code is the algorithm's choice (its most sensitive 2-bit groups).
* **Exclusive outliers.** A few weights of 2-bit groups only are kept exactly in fp16 in CSR
  (:class:`~lowbit.formats.sparse.CSRMatrix`, SpQR's 32-bit column/value words). Their dense
  code is the zero point, so ``W = dense + sparse`` with nothing counted twice.

**Aligned layout** (the paper's §3.3, "Memory Alignment"). A *lane* is 32 bits: the 16 codes of one
2-bit group (code ``j`` in bits ``2j``), or half of a 4-bit group (8 codes, code ``j`` in bits
``4j``). Each row is a sequence of 128-bit words ``primary [N, U, 4]`` int32 in three segments:

* ``A`` (``ua`` words): lanes 0-2 a triplet of 2-bit groups, lane 3 codes 0-7 of one 4-bit
  group; codes 8-15 of that group are the word's entry in the second matrix ``secondary [N,
  ua]`` int32. At 25 % 4-bit every word is of this kind, as in the paper.
* ``B`` (``ub`` words): four 2-bit lanes (the 2-bit groups beyond ``3 ua``).
* ``C`` (``uc`` words): two whole 4-bit groups (the 4-bit groups beyond ``ua``).

``ua = min(n4, ceil(n2 / 3))``, ``ub = ceil((n2 - 3 ua) / 4)``, ``uc = ceil((n4 - ua) / 2)``
for ``n2`` 2-bit and ``n4`` 4-bit groups. The 2-bit groups fill 2-bit *slots* ``p = 0, 1, ...``
(segment A's lanes, then B's), the 4-bit groups 4-bit slots (A's words, then C's halves);
``order [P2 + P4]`` int16 names each slot's column group (-1 for a padding slot, whose codes,
zeros and statistics are 0, so it decodes to 0). Statistics per slot: ``stats2 [N, T3]`` int16
(triplet ``t`` = 2-bit slots ``3t..3t+2``: bits 0-5 the zeros, 6-9 the first scale code, 10-12
and 13-15 the clipped ones), ``stats4 [N, P4]`` uint8 (zero in bits 0-3, scale code in 4-7),
``second2 [R, P2, 2]`` and ``second4 [R, P4, 2]`` fp16 ``(s2, z2)`` with ``R = ceil(N / g2)``.

Every stored bit is in these tensors; :meth:`MixedQuantized.storage_bits` counts them, and
:meth:`MixedQuantized.bits_breakdown` sets them beside eq. 10's terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.sparse import CSRMatrix

__all__ = [
    "GROUP",
    "SCALE_BITS",
    "CLIP_LEVELS",
    "Segments",
    "segments",
    "MixedStats",
    "MixedQuantized",
    "first_order_range",
    "second_order_quantize",
    "decode_scales",
    "triplet_order",
    "mixed_statistics",
    "group_statistics",
    "clipped_groups",
    "mixed_rtn",
]

GROUP = 16  #: input channels per first-order group (g1); a 2-bit group is one 32-bit lane
SCALE_BITS = 4  #: N_s, bits of a second-order scale code
#: the 4-bit scale codes a clipped (3-bit) code can stand for: the odd ones, so the largest
#: scale of a second-order group (code 15) is kept and no scale is lowered by more than one
#: step (a lowered scale clamps the group's largest weights)
CLIP_LEVELS = (1, 3, 5, 7, 9, 11, 13, 15)
_Z2_LIMIT = 2000.0  # s2 >= hi / _Z2_LIMIT keeps |z2| <= 2048, exact in fp16
_TINY = torch.finfo(torch.float32).tiny
_FP16_TINY = 2.0**-24


# ----------------------------------------------------------------------------- layout sizes


@dataclass(frozen=True)
class Segments:
    """Word counts of the aligned layout's three segments (module doc)."""

    n2: int  # real 2-bit groups
    n4: int  # real 4-bit groups
    ua: int  # words: a triplet of 2-bit groups + half a 4-bit group (other half: secondary)
    ub: int  # words: four 2-bit groups
    uc: int  # words: two 4-bit groups

    @property
    def words(self) -> int:
        """128-bit primary words per row."""
        return self.ua + self.ub + self.uc

    @property
    def slots2(self) -> int:
        """2-bit slots (P2), padding included."""
        return 3 * self.ua + 4 * self.ub

    @property
    def slots4(self) -> int:
        """4-bit slots (P4), padding included."""
        return self.ua + 2 * self.uc

    @property
    def triplets(self) -> int:
        """16-bit first-order statistics words of the 2-bit slots per row (T3)."""
        return math.ceil(self.slots2 / 3)


def segments(n2: int, n4: int) -> Segments:
    """The aligned layout of ``n2`` 2-bit and ``n4`` 4-bit groups (module doc)."""
    if n2 < 0 or n4 < 0 or n2 + n4 == 0:
        raise LowbitError(f"a mixed layout needs groups, not n2={n2}, n4={n4}")
    ua = min(n4, math.ceil(n2 / 3))
    ub = math.ceil(max(0, n2 - 3 * ua) / 4)
    uc = math.ceil((n4 - ua) / 2)
    return Segments(n2, n4, ua, ub, uc)


# ----------------------------------------------------------------------------- statistics


def first_order_range(
    groups: Tensor,
    bits: int,
    outliers: Tensor | None = None,
    *,
    mse_clip: bool = False,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[Tensor, Tensor]:
    """Unquantized first-order scale and lower bound of each row group.

    Args:
        groups: ``[N, n, 16]`` fp32 weights of ``n`` column groups.
        bits: code width (2 or 4).
        outliers: ``[N, n, 16]`` bool, weights left out of the range (kept apart in fp16).
        mse_clip: shrink the range by ``1 - i / grid`` (``i < max_shrink * grid``) where that
            lowers the group's squared rounding error (outliers excluded).

    Returns:
        ``(scale, lo)`` fp32 ``[N, n]``: ``scale = (hi - lo) / (2**bits - 1)`` over the range
        ``[min(lo, 0), max(hi, 0)]`` (times the chosen shrink); an empty range gets the
        smallest normal scale.
    """
    qmax = 2**bits - 1
    keep = None if outliers is None else ~outliers
    inf = torch.tensor(float("inf"), device=groups.device)
    lo = groups if keep is None else torch.where(keep, groups, inf)
    hi = groups if keep is None else torch.where(keep, groups, -inf)
    lo = lo.amin(-1).clamp(max=0.0)  # [N, n]
    hi = hi.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / qmax).clamp_min(_TINY)
    if not mse_clip:
        return scale, lo
    best_err = _rounding_error(groups, scale, lo, qmax, keep)
    best_scale, best_lo = scale, lo
    for i in range(1, int(max_shrink * grid)):
        shrink = 1.0 - i / grid
        s, low = (scale * shrink).clamp_min(_TINY), lo * shrink
        err = _rounding_error(groups, s, low, qmax, keep)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, s, best_scale)
        best_lo = torch.where(better, low, best_lo)
    return best_scale, best_lo


def _rounding_error(groups, scale, lo, qmax, keep) -> Tensor:
    """Sum of squared rounding errors per row group ``[N, n]`` with these statistics."""
    zero = torch.round(-lo / scale).clamp(0, qmax).unsqueeze(-1)  # [N, n, 1]
    s = scale.unsqueeze(-1)
    q = (torch.round(groups / s) + zero).clamp(0, qmax)
    err = ((q - zero) * s - groups).square()
    if keep is not None:
        err = err * keep
    return err.sum(-1)


def second_order_quantize(
    scale: Tensor, g2: int, clipped: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize positive first-order scales along the rows (module doc, "Second order").

    Args:
        scale: ``[N, n]`` fp32 positive scales (one column per group).
        g2: rows per second-order group.
        clipped: ``[n]`` bool, columns whose codes are restricted to :data:`CLIP_LEVELS`.

    Returns:
        ``(codes uint8 [N, n], s2 fp16 [R, n], z2 fp16 [R, n])`` with ``R = ceil(N / g2)``;
        ``decode_scales(codes, s2, z2, g2)`` gives the scales used.
    """
    n_rows, n = scale.shape
    r = math.ceil(n_rows / g2)
    pad = r * g2 - n_rows
    padded = torch.cat([scale, scale[-1:].expand(pad, n)]) if pad else scale  # [R*g2, n]
    blocks = padded.view(r, g2, n)
    lo, hi = blocks.amin(1), blocks.amax(1)  # [R, n]
    qmax = 2**SCALE_BITS - 1
    s2 = torch.maximum((hi - lo) / qmax, hi / _Z2_LIMIT).clamp_min(_FP16_TINY)
    s2 = s2.to(torch.float16).float().clamp_min(_FP16_TINY)  # what is stored
    z2 = torch.round(-lo / s2)  # integers in [-2048, 0]
    s2_rows = s2.repeat_interleave(g2, 0)[:n_rows]  # [N, n]
    z2_rows = z2.repeat_interleave(g2, 0)[:n_rows]
    real = scale / s2_rows + z2_rows  # the code that would decode to the scale exactly
    floor = (z2_rows + 1).clamp(min=0)  # c > z2: every decoded scale is positive
    codes = torch.maximum(torch.round(real).clamp(max=qmax), floor)
    if clipped is not None and bool(clipped.any()):
        levels = torch.tensor(CLIP_LEVELS, dtype=torch.float32, device=scale.device).flip(0)
        dist = (levels - real[:, clipped].unsqueeze(-1)).abs()  # [N, c, 8], largest first
        dist = torch.where(levels > z2_rows[:, clipped].unsqueeze(-1), dist, float("inf"))
        codes[:, clipped] = levels[dist.argmin(-1)]  # the first minimum: ties go up
    return codes.to(torch.uint8), s2.to(torch.float16), z2.to(torch.float16)


def decode_scales(codes: Tensor, s2: Tensor, z2: Tensor, g2: int) -> Tensor:
    """``(c - z2) * s2`` per row, fp32 ``[N, n]`` (exact: an 11-bit integer times an fp16)."""
    n_rows = codes.shape[0]
    s2_rows = s2.float().repeat_interleave(g2, 0)[:n_rows]
    z2_rows = z2.float().repeat_interleave(g2, 0)[:n_rows]
    return (codes.float() - z2_rows) * s2_rows


def triplet_order(groups2: Tensor, priority: Tensor | None = None) -> Tensor:
    """Which 2-bit group goes in each 2-bit slot: with ``priority`` ``[n2]`` the highest third
    takes the triplets' first positions (the 4-bit scale codes), the next third the second
    positions, the rest the third; else column order. Returns ``[n2]`` long group indices."""
    if priority is None:
        return groups2.clone()
    n2 = groups2.numel()
    ranked = groups2[torch.argsort(priority, descending=True, stable=True)]
    position = torch.arange(n2, device=groups2.device) % 3
    slots = torch.argsort(position, stable=True)  # slots of position 0 first, then 1, then 2
    order = torch.empty_like(groups2)
    order[slots] = ranked
    return order


@dataclass
class MixedStats:
    """Statistics of a mixed weight per row and column group, and the slot order.

    Attributes:
        is4: ``[G]`` bool, 4-bit column groups.
        order2, order4: ``[n2]``, ``[n4]`` long, the column group of each real 2-bit / 4-bit
            slot (slot order; padding slots come after them).
        code: ``[N, G]`` uint8 4-bit-grid scale codes (clip levels where clipped).
        zero: ``[N, G]`` fp32 integer zeros.
        s2, z2: ``[R, G]`` fp16 second-order scale and integer zero of each group's scales.
        scale: ``[N, G]`` fp32 decoded scales, ``decode_scales(code, s2, z2, g2)``.
        g2: rows per second-order group.
    """

    is4: Tensor
    order2: Tensor
    order4: Tensor
    code: Tensor
    zero: Tensor
    s2: Tensor
    z2: Tensor
    scale: Tensor
    g2: int

    @property
    def bits(self) -> Tensor:
        """``[G]`` code width of each column group."""
        return torch.where(self.is4, 4, 2)

    def qmax(self) -> Tensor:
        """``[G]`` fp32 largest code of each column group."""
        return torch.where(self.is4, 15.0, 3.0)

    def clipped(self) -> Tensor:
        """``[G]`` bool, the groups whose scale code is clipped (triplet positions 1 and 2)."""
        return clipped_groups(self.order2, self.is4.numel())


def clipped_groups(order2: Tensor, groups: int) -> Tensor:
    """``[groups]`` bool: the 2-bit groups at triplet positions 1 and 2 of ``order2``."""
    out = torch.zeros(groups, dtype=torch.bool, device=order2.device)
    out[order2] = torch.arange(order2.numel(), device=order2.device) % 3 != 0
    return out


def _check_weight(weight: Tensor) -> None:
    if not isinstance(weight, Tensor) or not weight.dtype.is_floating_point:
        raise LowbitError(
            f"the weight must be a float tensor, got {getattr(weight, 'dtype', weight)}"
        )
    if weight.dim() != 2 or weight.numel() == 0:
        raise LowbitError(
            f"the weight must be a non-empty [out, in] matrix, got {tuple(weight.shape)}"
        )
    if not (math.isfinite(weight.amin()) and math.isfinite(weight.amax())):
        raise LowbitError("the weight contains NaN or Inf; integer codes have no value for them")


def _padded_groups(weight: Tensor) -> Tensor:
    """``[N, K]`` -> ``[N, G, 16]`` fp32, the last group padded with zeros."""
    n, k = weight.shape
    g = math.ceil(k / GROUP)
    out = weight.new_zeros(n, g * GROUP, dtype=torch.float32)
    out[:, :k] = weight.float()
    return out.view(n, g, GROUP)


def _padded_mask(mask: Tensor | None, k: int) -> Tensor | None:
    if mask is None:
        return None
    n = mask.shape[0]
    g = math.ceil(k / GROUP)
    out = torch.zeros(n, g * GROUP, dtype=torch.bool, device=mask.device)
    out[:, :k] = mask
    return out.view(n, g, GROUP)


def group_statistics(
    groups: Tensor,
    bits: int,
    outliers: Tensor | None,
    g2: int,
    clipped: Tensor | None = None,
    mse_clip: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """First and second order of ``n`` column groups of one width.

    Args:
        groups: ``[N, n, 16]`` fp32 weights.
        bits: 2 or 4.
        outliers: ``[N, n, 16]`` bool, left out of the ranges, or None.
        g2: rows per second-order group.
        clipped: ``[n]`` bool, groups with clipped scale codes.
        mse_clip: see :func:`first_order_range`.

    Returns:
        ``(code uint8 [N, n], zero fp32 [N, n], s2 fp16 [R, n], z2 fp16 [R, n], scale fp32
        [N, n])``. Groups are independent: a slice of the groups gives the slice's statistics.
    """
    s, lo = first_order_range(groups, bits, outliers, mse_clip=mse_clip)
    code, s2, z2 = second_order_quantize(s, g2, clipped)
    scale = decode_scales(code, s2, z2, g2)  # [N, n]
    zero = torch.round(-lo / scale).clamp(0, 2**bits - 1)
    return code, zero, s2, z2, scale


def mixed_statistics(
    weight: Tensor,
    is4: Tensor,
    outliers: Tensor | None = None,
    *,
    g2: int = 16,
    mse_clip: bool = False,
    priority: Tensor | None = None,
) -> MixedStats:
    """The first- and second-order statistics of ``weight`` in the mixed format.

    Args:
        weight: ``[N, K]`` float weight.
        is4: ``[G]`` bool (``G = ceil(K / 16)``), the 4-bit column groups.
        outliers: ``[N, K]`` bool, weights kept in fp16 (only in 2-bit groups); they are left
            out of their group's range.
        g2: rows per second-order group.
        mse_clip: search a shrunk range per row group (:func:`first_order_range`).
        priority: ``[G]`` sensitivity of each column group; the most sensitive 2-bit groups get
            the 4-bit scale codes of the triplets (:func:`triplet_order`). None: column order.
    """
    order2, order4, mask = _check_mixed(weight, is4, outliers, g2, priority)
    n = weight.shape[0]
    g = is4.numel()
    groups = _padded_groups(weight)  # [N, G, 16]
    clipped = clipped_groups(order2, g)
    code = torch.empty(n, g, dtype=torch.uint8, device=weight.device)
    zero, scale = torch.empty(n, g, device=weight.device), torch.empty(n, g, device=weight.device)
    r = math.ceil(n / g2)
    s2 = torch.empty(r, g, dtype=torch.float16, device=weight.device)
    z2 = torch.empty_like(s2)
    for bits, ids in ((2, ~is4), (4, is4)):
        if bool(ids.any()):
            sub = None if mask is None else mask[:, ids]
            parts = group_statistics(groups[:, ids], bits, sub, g2, clipped[ids], mse_clip)
            code[:, ids], zero[:, ids], s2[:, ids], z2[:, ids], scale[:, ids] = parts
    return MixedStats(is4.clone(), order2, order4, code, zero, s2, z2, scale, g2)


def _check_mixed(weight, is4, outliers, g2, priority):
    """Checks shared by the static and the GPTQ-time statistics -> (order2, order4, padded
    outlier mask)."""
    _check_weight(weight)
    k = weight.shape[1]
    g = math.ceil(k / GROUP)
    if not isinstance(is4, Tensor) or is4.shape != (g,) or is4.dtype != torch.bool:
        raise LowbitError(f"is4 must be a [{g}] bool tensor (one flag per 16 input channels)")
    if isinstance(g2, bool) or not isinstance(g2, int) or g2 < 1:
        raise LowbitError(f"g2 must be a positive integer, not {g2!r}")
    mask = _padded_mask(outliers, k)
    if mask is not None and bool(mask[:, is4].any()):
        raise LowbitError("outliers must lie in 2-bit groups only (exclusive 2-bit outliers)")
    ids = torch.arange(g, device=weight.device)
    groups2, groups4 = ids[~is4], ids[is4]
    order2 = triplet_order(groups2, None if priority is None else priority[groups2])
    return order2, groups4.clone(), mask


def mixed_rtn(
    weight: Tensor, stats: MixedStats, outliers: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Round-to-nearest codes of ``weight`` with ``stats``.

    Returns:
        ``(codes uint8 [N, 16 G], outlier values fp32 [N, K])``: outliers take the zero point's
        code (they decode to 0) and keep their fp16-rounded value in the second tensor (0
        elsewhere).
    """
    n, k = weight.shape
    groups = _padded_groups(weight)  # [N, G, 16]
    s, z = stats.scale.unsqueeze(-1), stats.zero.unsqueeze(-1)  # [N, G, 1]
    qmax = stats.qmax().view(1, -1, 1)
    q = torch.minimum((torch.round(groups * torch.reciprocal(s)) + z).clamp_min(0), qmax)
    q = q.view(n, -1)
    q[:, k:] = stats.zero.repeat_interleave(GROUP, 1)[:, k:]  # padding decodes to 0
    sparse = torch.zeros(n, k, device=weight.device)
    if outliers is not None:
        q[:, :k] = torch.where(outliers, stats.zero.repeat_interleave(GROUP, 1)[:, :k], q[:, :k])
        sparse = torch.where(outliers, weight.float().half().float(), sparse)
    return q.to(torch.uint8), sparse


# ----------------------------------------------------------------------------- packing helpers


def _to_int32(words: Tensor) -> Tensor:
    """int64 holding uint32 bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _from_int32(words: Tensor) -> Tensor:
    return words.to(torch.int64) & 0xFFFFFFFF


def _pack_lane(codes: Tensor, bits: int) -> Tensor:
    """``[..., 32 // bits]`` codes -> ``[...]`` int64 lanes, code ``j`` in bits ``j * bits``."""
    shifts = torch.arange(codes.shape[-1], device=codes.device, dtype=torch.int64) * bits
    return (codes.to(torch.int64) << shifts).sum(-1)


def _unpack_lane(lanes: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`_pack_lane`: ``[...]`` int64 -> ``[..., 32 // bits]`` uint8."""
    shifts = torch.arange(32 // bits, device=lanes.device, dtype=torch.int64) * bits
    return ((lanes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def _clip_index(codes: Tensor) -> Tensor:
    """4-bit-grid codes that are clip levels -> their 3-bit index."""
    return (codes.to(torch.int64) - CLIP_LEVELS[0]) // 2  # the levels are 1, 3, ..., 15


def _clip_level(index: Tensor) -> Tensor:
    return index * 2 + CLIP_LEVELS[0]


def _pad_cols(t: Tensor, width: int) -> Tensor:
    """Zero-pad the last dimension of ``t`` to ``width``."""
    if t.shape[-1] == width:
        return t
    out = t.new_zeros(*t.shape[:-1], width)
    out[..., : t.shape[-1]] = t
    return out


# ----------------------------------------------------------------------------- the container


@dataclass
class MixedQuantized:
    """A packed mixed 2/4-bit weight with 2-order scales and exclusive fp16 outliers.

    Fields are the stored tensors of the aligned layout (module doc) and the outlier CSR;
    ``shape`` is ``[N, K]``, ``dtype`` the float dtype the weight stands for, ``g2`` the rows
    per second-order group. Build with :meth:`from_parts`; :meth:`unpack` gives codes and
    statistics back bit for bit.
    """

    primary: Tensor  # [N, 4 U] int32
    secondary: Tensor  # [N, ua] int32
    stats2: Tensor  # [N, T3] int16
    stats4: Tensor  # [N, P4] uint8
    second2: Tensor  # [R, P2, 2] fp16
    second4: Tensor  # [R, P4, 2] fp16
    order: Tensor  # [P2 + P4] int16
    outliers: CSRMatrix
    shape: torch.Size
    dtype: torch.dtype
    g2: int
    n4: int

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_parts(
        cls,
        codes: Tensor,
        stats: MixedStats,
        sparse: Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
    ) -> MixedQuantized:
        """Pack codes ``[N, 16 G]`` (uint8, column order), statistics and the fp32 outlier
        matrix ``[N, K]`` (0 where no outlier) into the aligned layout."""
        n, k = shape
        g = math.ceil(k / GROUP)
        if codes.shape != (n, g * GROUP) or sparse.shape != (n, k):
            raise LowbitError(f"codes [{n}, {g * GROUP}] and sparse [{n}, {k}] expected")
        seg = segments(stats.order2.numel(), stats.order4.numel())
        p2, p4 = seg.slots2, seg.slots4
        groups = codes.view(n, g, GROUP).to(torch.int64)
        lanes2 = _pad_cols(_pack_lane(groups[:, stats.order2], 2), p2)  # [N, P2]
        halves = groups[:, stats.order4].view(n, -1, 2, 8)  # [N, n4, half, 8]
        half4 = _pack_lane(halves, 4)  # [N, n4, 2]
        lo4 = _pad_cols(half4[..., 0], p4)  # [N, P4]
        hi4 = _pad_cols(half4[..., 1], p4)
        primary = codes.new_zeros(n, seg.words, 4, dtype=torch.int64)
        ua, ub = seg.ua, seg.ub
        primary[:, :ua, :3] = lanes2[:, : 3 * ua].view(n, ua, 3)
        primary[:, :ua, 3] = lo4[:, :ua]
        primary[:, ua : ua + ub, :] = lanes2[:, 3 * ua :].view(n, ub, 4)
        c_halves = torch.stack([lo4[:, ua:], hi4[:, ua:]], -1)  # [N, 2 uc, 2]
        primary[:, ua + ub :, :] = c_halves.reshape(n, seg.uc, 4)
        secondary = hi4[:, :ua]

        t3 = seg.triplets
        o2, o4 = stats.order2, stats.order4
        zero2 = _pad_cols(stats.zero[:, o2].to(torch.int64), 3 * t3).view(n, t3, 3)
        code2 = _pad_cols(stats.code[:, o2].to(torch.int64), 3 * t3).view(n, t3, 3)
        pads = torch.arange(3 * t3, device=codes.device) >= seg.n2
        code2 = torch.where(pads.view(1, t3, 3), CLIP_LEVELS[0], code2)  # index 0 if clipped
        if bool(((code2[..., 1:] - CLIP_LEVELS[0]) % 2 != 0).any()):
            raise LowbitError("a clipped scale code is not one of CLIP_LEVELS")
        word = zero2[..., 0] | zero2[..., 1] << 2 | zero2[..., 2] << 4 | code2[..., 0] << 6
        word |= _clip_index(code2[..., 1]) << 10 | _clip_index(code2[..., 2]) << 13
        stats2 = torch.where(word >= 2**15, word - 2**16, word).to(torch.int16)
        byte = stats.zero[:, o4].to(torch.int64) | stats.code[:, o4].to(torch.int64) << 4
        stats4 = _pad_cols(byte, p4).to(torch.uint8)
        second2 = _pad_cols(torch.stack([stats.s2[:, o2], stats.z2[:, o2]], 1), p2)
        second4 = _pad_cols(torch.stack([stats.s2[:, o4], stats.z2[:, o4]], 1), p4)
        second2, second4 = second2.transpose(1, 2), second4.transpose(1, 2)  # [R, P, 2]
        order = torch.full((p2 + p4,), -1, dtype=torch.int64, device=codes.device)
        order[: seg.n2] = stats.order2
        order[p2 : p2 + seg.n4] = stats.order4
        return cls(
            primary=_to_int32(primary.view(n, -1)),
            secondary=_to_int32(secondary),
            stats2=stats2,
            stats4=stats4,
            second2=second2.contiguous().to(torch.float16),
            second4=second4.contiguous().to(torch.float16),
            order=order.to(torch.int16),
            outliers=CSRMatrix.from_dense(sparse, sparse != 0),
            shape=torch.Size(shape),
            dtype=dtype,
            g2=stats.g2,
            n4=seg.n4,
        )

    # -- layout ---------------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return math.ceil(self.shape[1] / GROUP)

    @property
    def segments(self) -> Segments:
        return segments(self.groups - self.n4, self.n4)

    def unpack(self) -> tuple[Tensor, MixedStats, Tensor]:
        """``(codes [N, 16 G] uint8, statistics, outliers fp32 [N, K])``, the inverse of
        :meth:`from_parts` bit for bit."""
        n, k = self.shape
        g, seg, device = self.groups, self.segments, self.primary.device
        ua, ub, uc = seg.ua, seg.ub, seg.uc
        p2 = seg.slots2
        primary = _from_int32(self.primary).view(n, seg.words, 4)
        lanes2 = torch.cat(
            [primary[:, :ua, :3].reshape(n, 3 * ua), primary[:, ua : ua + ub].reshape(n, 4 * ub)],
            1,
        )  # [N, P2]
        c_halves = primary[:, ua + ub :].reshape(n, 2 * uc, 2)
        lo4 = torch.cat([primary[:, :ua, 3], c_halves[..., 0]], 1)  # [N, P4]
        hi4 = torch.cat([_from_int32(self.secondary), c_halves[..., 1]], 1)
        order = self.order.to(torch.int64)
        order2, order4 = order[: seg.n2], order[p2 : p2 + seg.n4]
        codes = torch.zeros(n, g, GROUP, dtype=torch.uint8, device=device)
        codes[:, order2] = _unpack_lane(lanes2[:, : seg.n2], 2)
        halves = torch.stack([lo4[:, : seg.n4], hi4[:, : seg.n4]], -1)  # [N, n4, 2]
        codes[:, order4] = _unpack_lane(halves, 4).reshape(n, seg.n4, GROUP)

        word = self.stats2.to(torch.int64) & 0xFFFF  # [N, T3]
        zero2 = torch.stack([(word >> (2 * i)) & 3 for i in range(3)], -1).view(n, -1)
        code2 = torch.stack(
            [(word >> 6) & 15, _clip_level((word >> 10) & 7), _clip_level((word >> 13) & 7)], -1
        ).view(n, -1)
        byte = self.stats4.to(torch.int64)
        r = self.second2.shape[0]
        code = torch.zeros(n, g, dtype=torch.uint8, device=device)
        zero = torch.zeros(n, g, device=device)
        s2 = torch.zeros(r, g, dtype=torch.float16, device=device)
        z2 = torch.zeros_like(s2)
        code[:, order2], code[:, order4] = (
            code2[:, : seg.n2].to(torch.uint8),
            (byte[:, : seg.n4] >> 4).to(torch.uint8),
        )
        zero[:, order2], zero[:, order4] = (
            zero2[:, : seg.n2].float(),
            (byte[:, : seg.n4] & 15).float(),
        )
        s2[:, order2], z2[:, order2] = self.second2[:, : seg.n2, 0], self.second2[:, : seg.n2, 1]
        s2[:, order4], z2[:, order4] = self.second4[:, : seg.n4, 0], self.second4[:, : seg.n4, 1]
        is4 = torch.zeros(g, dtype=torch.bool, device=device)
        is4[order4] = True
        scale = decode_scales(code, s2, z2, self.g2)
        stats = MixedStats(is4, order2, order4, code, zero, s2, z2, scale, self.g2)
        return codes.view(n, g * GROUP), stats, self.outliers.to_dense()

    # -- the container protocol -------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``[N, K]`` weight in ``dtype`` (default: ``self.dtype``), decoded in fp32 straight
        from the stored tensors: ``(q - z) * s`` per slot, placed at its column group, plus
        the outliers (the same values as decoding :meth:`unpack`'s codes and statistics)."""
        n, k = self.shape
        seg, g = self.segments, self.groups
        ua, ub, uc = seg.ua, seg.ub, seg.uc
        words = self.primary.view(n, seg.words, 4)  # int32
        lanes2 = torch.cat(
            [words[:, :ua, :3].reshape(n, 3 * ua), words[:, ua : ua + ub].reshape(n, 4 * ub)], 1
        )[:, : seg.n2]  # [N, n2]
        halves = words[:, ua + ub :].reshape(n, 2 * uc, 2)
        lo4 = torch.cat([words[:, :ua, 3], halves[..., 0]], 1)[:, : seg.n4]  # [N, n4]
        hi4 = torch.cat([self.secondary, halves[..., 1]], 1)[:, : seg.n4]
        # arithmetic shifts of int32 keep the low bits right: the mask takes only those
        shifts2 = torch.arange(16, device=words.device, dtype=torch.int32) * 2
        shifts4 = torch.arange(8, device=words.device, dtype=torch.int32) * 4
        codes2 = (lanes2.unsqueeze(-1) >> shifts2) & 3  # [N, n2, 16]
        codes4 = torch.cat(
            [(lo4.unsqueeze(-1) >> shifts4) & 15, (hi4.unsqueeze(-1) >> shifts4) & 15], -1
        )  # [N, n4, 16]
        word = self.stats2.to(torch.int32) & 0xFFFF  # [N, T3]
        zero2 = torch.stack([(word >> (2 * i)) & 3 for i in range(3)], -1).view(n, -1)
        code2 = torch.stack(
            [(word >> 6) & 15, _clip_level((word >> 10) & 7), _clip_level((word >> 13) & 7)], -1
        ).view(n, -1)
        byte = self.stats4.to(torch.int32)[:, : seg.n4]
        scale2 = decode_scales(
            code2[:, : seg.n2], self.second2[:, : seg.n2, 0], self.second2[:, : seg.n2, 1],
            self.g2,
        )  # fmt: skip
        scale4 = decode_scales(
            byte >> 4, self.second4[:, : seg.n4, 0], self.second4[:, : seg.n4, 1], self.g2
        )
        dense = torch.zeros(n, g, GROUP, device=words.device)  # [N, G, 16]
        order = self.order.to(torch.int64)
        order2, order4 = order[: seg.n2], order[seg.slots2 : seg.slots2 + seg.n4]
        dense[:, order2] = (codes2.float() - zero2[:, : seg.n2, None].float()) * scale2[..., None]
        dense[:, order4] = (codes4.float() - (byte & 15)[..., None].float()) * scale4[..., None]
        out = dense.view(n, -1)[:, :k] + self.outliers.to_dense()
        return out.to(self.dtype if dtype is None else dtype)

    def stored_tensors(self) -> dict[str, Tensor]:
        """Every stored tensor by name (the packed module's buffers)."""
        return {
            "primary": self.primary,
            "secondary": self.secondary,
            "stats2": self.stats2,
            "stats4": self.stats4,
            "second2": self.second2,
            "second4": self.second4,
            "order": self.order,
            "row_ptr": self.outliers.row_ptr,
            "col_val": self.outliers.col_val,
        }

    def bits_breakdown(self) -> dict[str, int]:
        """Stored bits by part, from the stored tensors: 2-bit and 4-bit codes (padding lanes
        included), the 2-bit groups' clipped first-order statistics and second order, the
        4-bit groups' statistics, the group order, the outliers."""
        seg = self.segments
        n = self.shape[0]
        lanes4 = 2 * seg.slots4 * n  # 32-bit lanes of 4-bit codes (primary + secondary)
        lanes2 = seg.slots2 * n
        total_lanes = 4 * seg.words * n + seg.ua * n
        if lanes2 + lanes4 != total_lanes:  # pragma: no cover - layout invariant
            raise AssertionError("lane count mismatch")

        def bits(t: Tensor) -> int:
            return t.numel() * t.element_size() * 8

        return {
            "codes2": 32 * lanes2,
            "codes4": 32 * lanes4,
            "stats2": bits(self.stats2),
            "second2": bits(self.second2),
            "stats4": bits(self.stats4),
            "second4": bits(self.second4),
            "order": bits(self.order),
            "outliers": self.outliers.storage_bits(),
        }

    def storage_bits(self) -> int:
        """Every stored bit (the sum of :meth:`bits_breakdown`)."""
        return sum(self.bits_breakdown().values())

    def bits_per_element(self) -> float:
        return self.storage_bits() / math.prod(self.shape)

    def to(self, device: torch.device | str) -> MixedQuantized:
        """The same container with its tensors on ``device`` (itself when already there)."""
        device = torch.device(device)
        if self.primary.device == device:
            return self
        moved = {k: v.to(device) for k, v in self.stored_tensors().items()}
        outliers = CSRMatrix(moved.pop("row_ptr"), moved.pop("col_val"), self.outliers.shape)
        return replace(self, **moved, outliers=outliers)

    @property
    def outlier_count(self) -> int:
        return self.outliers.nnz
