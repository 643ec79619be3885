"""SpQR weights (Dettmers et al., 2024): small-group codes with quantized statistics, plus
sparse outliers.

A weight ``W [out, in]`` is stored in the column order of an input permutation ``perm``
(GPTQ's act-order; column ``j`` of the stored matrix multiplies ``x[perm[j]]``) as
``W' = D' + S'``:

* ``D'``, the dense part: ``bits``-bit codes ``q`` (default 3) in groups of ``beta1`` columns
  (default 16). Each row of a group has a ``stat_bits``-bit scale code and zero code
  (default 3); those codes are themselves quantized per tile of ``beta2`` rows × one group (the
  16 × 16 tile) with fp16 second-order statistics ``q_ss, q_sz`` (scale and zero of the scales)
  and ``q_zs, q_zz`` (of the zeros). Dequantization (§2 of Crnčević's master's thesis on an
  SpQR inference kernel, 2025), every operation rounded to fp16 as his kernel's ``half2``
  arithmetic does::

      s = q_ss · (c_s − q_sz)      z = q_zs · (c_z − q_zz)      w = s · (q − z)

  First-order statistics are SpQR's min-max: ``scale = (max − min) / (2**bits − 1)``, a real
  zero ``−min / scale`` (then both quantized as above).
* ``S'``, the outliers: fp16 values in CSR or PTCSR (:mod:`lowbit.formats.sparse`) with Crnčević's
  ``col_val`` words (fp16 value in the high half, 16-bit column in the low half), in the
  stored (permuted) column order. An outlier's value is the residual ``w − D'`` rounded to fp16,
  so ``D' + S'`` is the weight up to one fp16 rounding of a small number.

The packed layout (Crnčević, §3.1, 3-bit codes and statistics, beta1 = beta2 = 16 only): one
64-bit word per tile row, the tiles of a row of tiles contiguous (``words [T, G * 16]`` int64,
word ``g * 16 + r`` of row ``t`` is row ``r`` of tile ``(t, g)``)::

    bits  0-2   scale code c_s          bits  3-5   zero code c_z
    bits  6-53  sixteen 3-bit codes (column i of the tile at 6 + 3 i)
    bits 54-61  8-bit chunk of the tile's 64-bit second-order word
    bits 62-63  zero (spare)

The second-order word is ``q_ss | q_zs << 16 | q_sz << 32 | q_zz << 48`` (fp16 bit patterns,
Crnčević's ``SecondOrder`` union); chunk ``c`` (its bits ``8c .. 8c+7``) is stored in rows
``2c`` and ``2c + 1``, so each half of a 16-lane group recovers the whole word by an OR over
three shuffles (lanes ``r ^ 2, r ^ 4, r ^ 8``). That is 4.0 bits per weight for the dense part
(the analytic count of the statistics, :func:`~lowbit.formats.accounting.spqr_bits`, is 3.625).

Shapes that are not multiples of 16 are padded to whole tiles: the last group has fewer real
columns and the last tile fewer real rows; their statistics come from the real entries only,
and the padding holds code 0 (and chunks of the real rows' statistics). A kernel multiplies the
padded columns by zero inputs and drops the padded rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.accounting import spqr_bits
from lowbit.formats.sparse import CSRMatrix, PTCSRMatrix

__all__ = [
    "TILE",
    "KERNEL_BITS",
    "MAX_WIDTH",
    "SpQRQuantized",
    "decode_fp16",
    "first_order_stats",
    "quantize_stats",
    "fill_degenerate",
    "weight_codes",
    "pack_words",
    "unpack_words",
    "second_order_by_shuffle",
    "make_outliers",
]

TILE = 16  # rows and columns of a tile in the packed layout
KERNEL_BITS = 3  # code and statistic width of the packed layout
CHUNK_SHIFT = 18 * KERNEL_BITS  # first bit of the second-order chunk (54)
MAX_WIDTH = 1 << 16  # 16-bit column indices (outlier words, input permutation)
_FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal)
_FP16_MAX = 65504.0
_SCALE_FLOOR = 2.0**-10  # a scale is at least max|w| / 1024, so |zero| <= 1024 + 2**bits


# ----------------------------------------------------------------------------- arithmetic


def decode_fp16(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """``fp16(scale · fp16(codes − zero))``: Crnčević's ``dequantize2`` in fp16 arithmetic.

    ``scale`` and ``zero`` are fp16 (or fp32 holding fp16 values) broadcasting to ``codes``.
    Each operation runs in fp32 and is rounded to fp16; that is the correctly rounded fp16
    result, since fp32 carries at least 2 · 11 + 2 significant bits (double rounding is then
    innocuous), so CPU, CUDA ``half2`` and Triton agree bit for bit.
    """
    diff = (codes.float() - zero.float()).half()
    return (scale.float() * diff.float()).half()


def first_order_stats(w: Tensor, keep: Tensor | None, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """SpQR's min-max statistics of each row of a group, over the kept entries.

    Args:
        w: ``[rows, g]`` fp32 weights of one group.
        keep: ``[rows, g]`` bool, the entries the statistics see (None = all).
        bits: code width.

    Returns:
        ``(scale, zero, degenerate)`` ``[rows]``: fp32 scale (at least ``max|w| / 1024`` so the
        zero stays in fp16 range), real zero ``−min / scale``, and the rows whose kept entries
        have no range (all equal, or none kept), whose statistics :func:`fill_degenerate`
        replaces.
    """
    maxq = 2**bits - 1
    if keep is None:
        lo, hi = torch.aminmax(w, dim=1)
    else:
        lo = torch.where(keep, w, torch.inf).amin(1)
        hi = torch.where(keep, w, -torch.inf).amax(1)
    degenerate = ~(hi > lo)  # equal, or no kept entry (inf > -inf is False only then... or NaN)
    lo = torch.where(degenerate, torch.zeros_like(lo), lo)
    hi = torch.where(degenerate, torch.zeros_like(hi), hi)
    floor = torch.maximum(lo.abs(), hi.abs()) * _SCALE_FLOOR
    scale = torch.maximum((hi - lo) / maxq, floor).clamp_min(1e-30)
    return scale, -lo / scale, degenerate


def _tiled(x: Tensor, beta2: int, fill: float) -> Tensor:
    """``[rows, cols]`` → ``[tiles, beta2, cols]``, the last tile padded with ``fill``."""
    rows = x.shape[0]
    tiles = math.ceil(rows / beta2)
    pad = torch.full((tiles * beta2 - rows, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad]).view(tiles, beta2, *x.shape[1:])


def fill_degenerate(
    scale: Tensor, zero: Tensor, degenerate: Tensor, value: Tensor, beta2: int
) -> tuple[Tensor, Tensor]:
    """Statistics for rows without a range, chosen inside their tile's range.

    A degenerate row (constant ``value``, or nothing kept) gets the smallest scale of the other
    rows of its tile of ``beta2`` rows and the zero that maps ``value`` to a code, clamped to
    the tile's zero range, so it never widens the second-order ranges (SpQR's ``±1`` range
    would). A tile with no regular row gets scale 1 and zero ``−value``.

    Args:
        scale, zero, degenerate: ``[rows, cols]`` from :func:`first_order_stats` (one column
            per group; tiles run along the rows).
        value: ``[rows, cols]`` fp32, the degenerate rows' constant (0 where nothing was kept).
    """
    if not bool(degenerate.any()):
        return scale, zero
    rows = scale.shape[0]
    regular = _tiled(~degenerate, beta2, False)  # [T, beta2, cols]
    s_min = torch.where(regular, _tiled(scale, beta2, 0.0), torch.inf).amin(1)  # [T, cols]
    z_lo = torch.where(regular, _tiled(zero, beta2, 0.0), torch.inf).amin(1)
    z_hi = torch.where(regular, _tiled(zero, beta2, 0.0), -torch.inf).amax(1)
    none = ~regular.any(1)  # [T, cols]
    s_min = torch.where(none, torch.ones_like(s_min), s_min)
    tile_of = torch.arange(rows, device=scale.device) // beta2
    s_fill = s_min[tile_of]  # [rows, cols]
    z_fill = -value / s_fill
    clamped = torch.minimum(torch.maximum(z_fill, z_lo[tile_of]), z_hi[tile_of])
    z_fill = torch.where(none[tile_of], z_fill, clamped)
    return torch.where(degenerate, s_fill, scale), torch.where(degenerate, z_fill, zero)


def quantize_stats(values: Tensor, stat_bits: int, beta2: int) -> tuple[Tensor, Tensor, Tensor]:
    """Second-order quantization of first-order scales or zeros.

    Per tile of ``beta2`` rows (and per column: one column per group), min-max asymmetric with
    a real zero: ``s2 = (max − min) / (2**stat_bits − 1)`` (at least ``max|v| / 1024``),
    ``z2 = −min / s2``, both stored in fp16; codes ``round(v / s2 + z2)`` with the stored values. A constant tile gets ``s2 = |v|``
    (1 for 0) and ``z2 = 1 − v / s2``, so code 1 decodes to ``v``.

    Args:
        values: ``[rows, cols]`` fp32, finite.

    Returns:
        ``(codes uint8 [rows, cols], s2 fp16 [tiles, cols], z2 fp16 [tiles, cols])``.
    """
    maxq = 2**stat_bits - 1
    rows = values.shape[0]
    v = _tiled(values, beta2, math.nan)  # [T, beta2, cols]
    lo = torch.where(v.isnan(), torch.inf, v).amin(1)  # [T, cols]
    hi = torch.where(v.isnan(), -torch.inf, v).amax(1)
    constant = ~(hi > lo)
    floor = torch.maximum(lo.abs(), hi.abs()) * _SCALE_FLOOR  # keeps |z2| <= 1024
    s2 = torch.where(constant, lo.abs(), torch.maximum((hi - lo) / maxq, floor))
    s2 = torch.where(s2 == 0, torch.ones_like(s2), s2)
    s2 = s2.clamp(_FP16_TINY, _FP16_MAX).half()
    z2 = torch.where(constant, 1.0 - lo / s2.float(), -lo / s2.float())
    if not bool(z2.abs().max() <= _FP16_MAX):
        raise LowbitError("SpQR statistics beyond the fp16 range; the weight is too large")
    z2 = z2.half()
    tile_of = torch.arange(rows, device=values.device) // beta2
    s2e, z2e = s2.float()[tile_of], z2.float()[tile_of]  # [rows, cols]
    codes = torch.round(values / s2e + z2e).clamp_(0, maxq).to(torch.uint8)
    return codes, s2, z2


def weight_codes(w: Tensor, scale16: Tensor, zero16: Tensor, bits: int) -> Tensor:
    """Codes ``clamp(round(w / s + z), 0, 2**bits − 1)`` (fp32) for the decoded fp16 statistics
    (a zero scale counts as the smallest fp32 normal, so no NaN arises)."""
    s = scale16.float().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / s + zero16.float()).clamp_(0, 2**bits - 1)


# ----------------------------------------------------------------------------- packed words


def _check_packed_format(bits: int, stat_bits: int, beta1: int, beta2: int) -> None:
    if bits != KERNEL_BITS or stat_bits != KERNEL_BITS:
        raise LowbitError(
            f"the packed SpQR layout holds {KERNEL_BITS}-bit codes and statistics, not "
            f"{bits}-bit codes with {stat_bits}-bit statistics"
        )
    if beta1 != TILE or beta2 != TILE:
        raise LowbitError(
            f"the packed SpQR layout has {TILE} x {TILE} tiles (beta1 = beta2 = {TILE}), not "
            f"beta1 = {beta1}, beta2 = {beta2}"
        )


def _half_bits(x: Tensor) -> Tensor:
    """fp16 → int64 bit patterns in 0..65535."""
    return x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _bits_half(x: Tensor) -> Tensor:
    """int64 bit patterns in 0..65535 → fp16."""
    return torch.where(x >= 1 << 15, x - (1 << 16), x).to(torch.int16).view(torch.float16)


def pack_words(codes: Tensor, scale_codes: Tensor, zero_codes: Tensor, second: Tensor) -> Tensor:
    """Crnčević's 64-bit tile-row words (see the module docstring).

    Args:
        codes: ``[out, in]`` uint8 3-bit codes (stored column order).
        scale_codes, zero_codes: ``[out, G]`` uint8 3-bit first-order codes, ``G = ceil(in /
            16)``.
        second: ``[T, G, 4]`` fp16 ``(q_ss, q_zs, q_sz, q_zz)`` per tile, ``T = ceil(out / 16)``.

    Returns:
        ``[T, G * 16]`` int64 words.
    """
    out_f, in_f = codes.shape
    tiles, groups = second.shape[:2]
    if tiles != math.ceil(out_f / TILE) or groups != math.ceil(in_f / TILE):
        raise LowbitError(
            f"second-order statistics of shape {tuple(second.shape)} do not fit a "
            f"{out_f} x {in_f} weight in {TILE} x {TILE} tiles"
        )
    rows, cols = tiles * TILE, groups * TILE
    c = torch.zeros(rows, cols, dtype=torch.int64, device=codes.device)
    c[:out_f, :in_f] = codes.to(torch.int64)
    c = c.view(tiles, TILE, groups, TILE)  # [t, r, g, i]
    shifts = 6 + KERNEL_BITS * torch.arange(TILE, device=codes.device)
    word = (c << shifts).sum(-1)  # [t, r, g]: disjoint bit fields, so sum == or
    sc = torch.zeros(rows, groups, dtype=torch.int64, device=codes.device)
    zc = torch.zeros_like(sc)
    sc[:out_f], zc[:out_f] = scale_codes.to(torch.int64), zero_codes.to(torch.int64)
    word |= sc.view(tiles, TILE, groups) | (zc.view(tiles, TILE, groups) << KERNEL_BITS)
    halves = _half_bits(second)  # [t, g, 4]
    chunk_of_row = torch.arange(TILE, device=codes.device) // 2  # [r]: chunk c = r // 2
    half = halves[:, :, chunk_of_row // 2]  # [t, g, r]
    chunk = (half >> (8 * (chunk_of_row % 2))) & 0xFF  # [t, g, r]
    word |= chunk.permute(0, 2, 1) << CHUNK_SHIFT
    return word.permute(0, 2, 1).reshape(tiles, groups * TILE).contiguous()  # [t, g * 16 + r]


def second_order_by_shuffle(words: Tensor) -> Tensor:
    """The second-order word every row recovers as the kernel does: its chunk shifted to
    ``8 · (r // 2)``, OR-ed with those of lanes ``r ^ 2``, ``r ^ 4``, ``r ^ 8``.

    Returns:
        ``[T, G * 16]`` int64, the 64-bit second-order word of each row's tile as seen by that
        row (bit 63 comes back as the sign bit of the int64).
    """
    tiles = words.shape[0]
    r = torch.arange(TILE, device=words.device)
    w = words.view(tiles, -1, TILE)  # [t, g, r]
    val = (w >> CHUNK_SHIFT) << (8 * (r // 2))  # spare bits 62-63 must be zero
    for lane_xor in (2, 4, 8):
        val = val | val[:, :, r ^ lane_xor]
    return val.view(tiles, -1)


def unpack_words(
    words: Tensor, out_features: int, in_features: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Inverse of :func:`pack_words`: ``(codes, scale_codes, zero_codes, second)``, padding
    dropped. The second-order halves are read from the chunks of rows 0, 2, ..., 14 (their
    copies in the odd rows, and the spare bits, are checked)."""
    tiles, width = words.shape
    groups = width // TILE
    if (
        tiles != math.ceil(out_features / TILE)
        or width != groups * TILE
        or (groups != math.ceil(in_features / TILE))
    ):
        raise LowbitError(
            f"packed SpQR words of shape {tuple(words.shape)} do not fit a {out_features} x "
            f"{in_features} weight"
        )
    w = words.view(tiles, groups, TILE).permute(0, 2, 1)  # [t, r, g]
    if bool(((w >> 62) != 0).any()):
        raise LowbitError("packed SpQR words have their spare bits 62-63 set; the data is damaged")
    chunk = (w >> CHUNK_SHIFT) & 0xFF  # [t, r, g]
    if not torch.equal(chunk[:, 0::2], chunk[:, 1::2]):
        raise LowbitError("packed SpQR words disagree in the repeated second-order chunks")
    even = chunk[:, 0::2].permute(0, 2, 1)  # [t, g, 8]: chunk c
    halves = even[..., 0::2] | (even[..., 1::2] << 8)  # [t, g, 4]
    second = _bits_half(halves)
    shifts = 6 + KERNEL_BITS * torch.arange(TILE, device=words.device)
    codes = (w.unsqueeze(-1) >> shifts) & 7  # [t, r, g, i]
    codes = codes.reshape(tiles * TILE, groups * TILE)[:out_features, :in_features]
    sc = (w & 7).reshape(tiles * TILE, groups)[:out_features]
    zc = ((w >> KERNEL_BITS) & 7).reshape(tiles * TILE, groups)[:out_features]
    return (
        codes.to(torch.uint8).contiguous(),
        sc.to(torch.uint8).contiguous(),
        zc.to(torch.uint8).contiguous(),
        second.contiguous(),
    )


# ----------------------------------------------------------------------------- outliers


def make_outliers(values: Tensor, mask: Tensor, sparse_format: str = "csr"):
    """Outlier container of ``values`` under ``mask`` (stored column order, Crnčević's words);
    exact zeros are not stored."""
    if values.shape[1] > MAX_WIDTH:
        raise LowbitError(
            f"SpQR outlier words hold 16-bit column indices, so a weight may have at most "
            f"{MAX_WIDTH} input columns, not {values.shape[1]}"
        )
    if sparse_format == "csr":
        return CSRMatrix.from_dense(values, mask, value_high=True)
    if sparse_format == "ptcsr":
        return PTCSRMatrix.from_dense(values, mask, value_high=True)
    raise LowbitError(f"SpQR outliers are stored as 'csr' or 'ptcsr', not {sparse_format!r}")


def _outliers_to(sparse, device: torch.device):
    if isinstance(sparse, CSRMatrix):
        return replace(sparse, row_ptr=sparse.row_ptr.to(device), col_val=sparse.col_val.to(device))
    return replace(sparse, tile_ptr=sparse.tile_ptr.to(device), col_val=sparse.col_val.to(device))


# ----------------------------------------------------------------------------- container


@dataclass
class SpQRQuantized:
    """An SpQR weight: codes, bi-level statistics, outliers, input permutation.

    Fields (stored column order, see the module docstring):
        codes: ``[out, in]`` uint8 ``bits``-bit codes.
        scale_codes, zero_codes: ``[out, G]`` uint8 ``stat_bits``-bit first-order codes,
            ``G = ceil(in / beta1)``.
        second: ``[T, G, 4]`` fp16 ``(q_ss, q_zs, q_sz, q_zz)``, ``T = ceil(out / beta2)``.
        outliers: :class:`CSRMatrix` or :class:`PTCSRMatrix` ``[out, in]`` with
            ``value_high=True`` words.
        perm: ``[in]`` int16 (16-bit patterns of 0..65535) or None for the identity.
        bits, stat_bits, beta1, beta2: the format.
        dtype: the float dtype the weight stands for.
    """

    codes: Tensor
    scale_codes: Tensor
    zero_codes: Tensor
    second: Tensor
    outliers: CSRMatrix | PTCSRMatrix
    perm: Tensor | None
    bits: int = KERNEL_BITS
    stat_bits: int = KERNEL_BITS
    beta1: int = TILE
    beta2: int = TILE
    dtype: torch.dtype = torch.float32

    # -- shape and format ----------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.codes.shape)

    @property
    def packable(self) -> bool:
        """Whether the packed layout (and its kernels) can hold this format."""
        return (self.bits, self.stat_bits, self.beta1, self.beta2) == (3, 3, TILE, TILE)

    @property
    def sparse_format(self) -> str:
        return "csr" if isinstance(self.outliers, CSRMatrix) else "ptcsr"

    @property
    def nnz(self) -> int:
        return self.outliers.nnz

    @property
    def outlier_fraction(self) -> float:
        return self.nnz / math.prod(self.shape)

    def perm_index(self) -> Tensor | None:
        """``[in]`` int64 input permutation (None for the identity)."""
        return None if self.perm is None else self.perm.to(torch.int64) & 0xFFFF

    def describe(self) -> str:
        sparse = f"{100 * self.outlier_fraction:.2f}% outliers {self.sparse_format}"
        return f"spqr w{self.bits} s{self.stat_bits} beta {self.beta1}/{self.beta2}, {sparse}" + (
            ", act-order" if self.perm is not None else ""
        )

    # -- faces ---------------------------------------------------------------------------------
    def first_order(self) -> tuple[Tensor, Tensor]:
        """Decoded fp16 first-order ``(scale, zero)`` ``[out, G]``."""
        tile_of = torch.arange(self.shape[0], device=self.codes.device) // self.beta2
        second = self.second[tile_of]  # [out, G, 4]
        scale = decode_fp16(self.scale_codes, second[..., 0], second[..., 2])
        zero = decode_fp16(self.zero_codes, second[..., 1], second[..., 3])
        return scale, zero

    def dense_permuted(self) -> Tensor:
        """``D'`` ``[out, in]`` fp16 in stored column order."""
        scale, zero = self.first_order()  # [out, G]
        group_of = torch.arange(self.shape[1], device=self.codes.device) // self.beta1
        return decode_fp16(self.codes, scale[:, group_of], zero[:, group_of])

    def dequantize_permuted(self) -> Tensor:
        """``D' + S'`` ``[out, in]`` fp32 in stored column order."""
        return self.dense_permuted().float() + self.outliers.to_dense(torch.float32)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``D' + S'`` ``[out, in]`` in the original column order, summed in fp32, cast once."""
        w = self.dequantize_permuted()
        perm = self.perm_index()
        if perm is not None:
            w = torch.empty_like(w).index_copy_(1, perm, w)  # w_orig[:, perm[j]] = w[:, j]
        return w.to(self.dtype if dtype is None else dtype)

    # -- packed layout -------------------------------------------------------------------------
    def words(self) -> Tensor:
        """The dense part as Crnčević's ``[T, G * 16]`` int64 words."""
        _check_packed_format(self.bits, self.stat_bits, self.beta1, self.beta2)
        return pack_words(self.codes, self.scale_codes, self.zero_codes, self.second)

    @classmethod
    def from_words(
        cls,
        words: Tensor,
        shape: tuple[int, int],
        outliers: CSRMatrix | PTCSRMatrix,
        perm: Tensor | None,
        dtype: torch.dtype = torch.float32,
    ) -> SpQRQuantized:
        """The container of packed words (and the outliers and permutation stored beside)."""
        codes, sc, zc, second = unpack_words(words, *shape)
        return cls(codes, sc, zc, second, outliers, perm, dtype=dtype)

    def with_sparse_format(self, sparse_format: str) -> SpQRQuantized:
        """The same weight with its outliers in ``"csr"`` or ``"ptcsr"``."""
        if sparse_format == self.sparse_format:
            return self
        dense = self.outliers.to_dense(torch.float32)
        return replace(self, outliers=make_outliers(dense, dense != 0, sparse_format))

    def to(self, device: torch.device | str) -> SpQRQuantized:
        device = torch.device(device)
        if self.codes.device == device:
            return self
        return replace(
            self,
            codes=self.codes.to(device),
            scale_codes=self.scale_codes.to(device),
            zero_codes=self.zero_codes.to(device),
            second=self.second.to(device),
            outliers=_outliers_to(self.outliers, device),
            perm=None if self.perm is None else self.perm.to(device),
        )

    # -- accounting ----------------------------------------------------------------------------
    def dense_bits(self) -> int:
        """Bits of the dense part: 64 per tile row in the packed layout, else codes at ``bits``,
        first-order codes at ``stat_bits`` and four fp16 per tile."""
        out_f, in_f = self.shape
        tiles, groups = self.second.shape[:2]
        if self.packable:
            return 64 * tiles * groups * TILE
        first = 2 * out_f * groups * self.stat_bits
        return out_f * in_f * self.bits + first + tiles * groups * 4 * 16

    def storage_bits(self) -> int:
        """Every stored bit: the dense part, the outlier container (words, offsets, padding)
        and 16 bits per input column for the permutation."""
        perm = 0 if self.perm is None else 16 * self.perm.numel()
        return self.dense_bits() + self.outliers.storage_bits() + perm

    def bits_per_element(self) -> float:
        return self.storage_bits() / math.prod(self.shape)

    def analytic_bits(self) -> float:
        """The paper's formula for the dense part (:func:`spqr_bits`, no outliers)."""
        return spqr_bits(self.bits, self.beta1, self.beta2, self.stat_bits)
