"""Dense-and-sparse split and sparse outlier containers (CSR, CSC, PTCSR).

Every stored nonzero is one 32-bit word holding a 16-bit index (column for CSR/PTCSR, row for
CSC) and the fp16 bit pattern of the value, so outlier values are rounded to fp16 and matrices
are limited to 65536 columns (rows for CSC). By default the index is the high half and the value
the low half (KVQuant's layout); ``value_high=True`` swaps them: the value in the high half, the
column in the low half, the ``col_val`` word of Crnčević's SpQR inference kernel (master's
thesis, 2025, §3.4.2).
Exact zeros are never stored; values beyond the fp16 range raise
:class:`~lowbit.errors.LowbitError`.

* CSR: ``row_ptr`` int32 ``[rows + 1]`` + ``col_val`` int32 ``[nnz]``.
* CSC: ``col_ptr`` int32 ``[cols + 1]`` + ``row_val`` int32 ``[nnz]``.
* PTCSR (Crnčević, §3.4.3): rows are cut into tiles of 16; tile ``t`` with at most ``L_t``
  nonzeros per row stores ``16 * L_t`` words transposed, word ``tile_ptr[t] + i * 16 + r``
  being the ``i``-th nonzero of the tile's row ``r`` or a zero word (padding: column 0, +0.0,
  which no real nonzero can produce). ``tile_ptr`` int32 ``[n_tiles + 1]``; rows need not be a
  multiple of 16 (the last tile is partial; its missing rows are all padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from lowbit.errors import LowbitError

__all__ = [
    "split_outliers",
    "CSRMatrix",
    "CSCMatrix",
    "PTCSRMatrix",
    "pack_index_value",
    "unpack_index_value",
]

_FP16_MAX = 65504.0
TILE_ROWS = 16


def _check_matrix(x: Tensor) -> None:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise LowbitError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.numel() == 0:
        raise LowbitError(f"x must be a non-empty 2-d matrix, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise LowbitError("x contains NaN or Inf; split them out explicitly with a mask first")


def split_outliers(
    x: Tensor,
    *,
    threshold: float | Tensor | None = None,
    fraction: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Split ``x`` into a dense part and outliers.

    Exactly one selector: ``threshold`` (``|x| > threshold``; a scalar or a tensor broadcasting
    to ``x``, e.g. KVQuant's per-channel thresholds), ``fraction`` (the ``round(fraction *
    numel)`` largest magnitudes; ties broken by position) or a boolean ``mask``.

    Args:
        x: float matrix ``[rows, cols]``, finite.

    Returns:
        ``(dense, outlier_mask)``: ``dense`` is ``x`` with the outliers set to 0;
        ``x[outlier_mask]`` are the outliers (``x == dense + where(mask, x, 0)``).
    """
    _check_matrix(x)
    if sum(s is not None for s in (threshold, fraction, mask)) != 1:
        raise LowbitError("give exactly one of threshold, fraction or mask")
    if threshold is not None:
        if not bool((torch.as_tensor(threshold) >= 0).all()):
            raise LowbitError("threshold must be non-negative")
        sel = x.abs() > threshold
    elif fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise LowbitError(f"fraction must be in [0, 1], got {fraction!r}")
        k = round(fraction * x.numel())
        sel = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        if k:
            sel[x.abs().reshape(-1).topk(k).indices] = True
        sel = sel.view(x.shape)
    else:
        if mask.shape != x.shape or mask.dtype != torch.bool:
            raise LowbitError(f"mask must be a bool tensor of shape {tuple(x.shape)}")
        sel = mask
    return x.masked_fill(sel, 0.0), sel


def pack_index_value(index: Tensor, value: Tensor, *, value_high: bool = False) -> Tensor:
    """int32 words ``index << 16 | fp16_bits(value)`` (index in 0..65535), or with
    ``value_high`` ``fp16_bits(value) << 16 | index``."""
    if index.numel() and (int(index.min()) < 0 or int(index.max()) > 0xFFFF):
        raise LowbitError("sparse indices must fit in 16 bits (matrix side <= 65536)")
    if value.numel() and float(value.abs().max()) > _FP16_MAX:
        raise LowbitError(
            f"outlier values beyond the fp16 range (|v| > {_FP16_MAX}) cannot be stored"
        )
    bits = value.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    index = index.to(torch.int64)
    word = (bits << 16) | index if value_high else (index << 16) | bits
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_index_value(words: Tensor, *, value_high: bool = False) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack_index_value`: int64 indices and fp32 values."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    index, bits = (w & 0xFFFF, w >> 16) if value_high else (w >> 16, w & 0xFFFF)
    value = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.float16)
    return index, value.float()


def _entries(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Row-major (row, col, value) of the stored nonzeros."""
    _check_matrix(x)
    sel = x != 0 if mask is None else mask & (x != 0)
    rows, cols = sel.nonzero(as_tuple=True)
    return rows, cols, x[rows, cols]


def _ptr(counts_of: Tensor, n: int) -> Tensor:
    counts = torch.bincount(counts_of, minlength=n)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def _check_vector(x: Tensor, n: int) -> None:
    if x.dim() != 1 or x.shape[0] != n:
        raise LowbitError(f"x must be a vector of length {n}, got shape {tuple(x.shape)}")


class _SparseFromCOO:
    """What every sparse container derives from its (rows, cols, values) listing."""

    shape: tuple[int, int]

    def _coo(self) -> tuple[Tensor, Tensor, Tensor]:  # [nnz] rows, [nnz] cols, [nnz] fp32 values
        raise NotImplementedError

    def storage_bits(self) -> int:
        raise NotImplementedError

    def to_dense(self, dtype: torch.dtype = torch.float32) -> Tensor:
        rows, cols, vals = self._coo()
        out = torch.zeros(self.shape, device=vals.device)
        out[rows, cols] = vals
        return out.to(dtype)

    def matvec(self, x: Tensor) -> Tensor:
        """Reference ``S @ x`` with fp32 accumulation: ``[cols]`` → ``[rows]`` fp32."""
        _check_vector(x, self.shape[1])
        rows, cols, vals = self._coo()
        return torch.zeros(self.shape[0], device=x.device).index_add_(
            0, rows, vals * x.float()[cols]
        )

    def bits_per_element(self) -> float:
        return self.storage_bits() / math.prod(self.shape)


@dataclass
class CSRMatrix(_SparseFromCOO):
    """Compressed sparse rows with packed column/value words."""

    row_ptr: Tensor
    col_val: Tensor
    shape: tuple[int, int]
    value_high: bool = False

    @classmethod
    def from_dense(
        cls, x: Tensor, mask: Tensor | None = None, *, value_high: bool = False
    ) -> CSRMatrix:
        """Store the nonzeros of ``x`` (those under ``mask`` if given)."""
        rows, cols, vals = _entries(x, mask)
        words = pack_index_value(cols, vals, value_high=value_high)
        return cls(_ptr(rows, x.shape[0]), words, tuple(x.shape), value_high)

    @property
    def nnz(self) -> int:
        return self.col_val.numel()

    def _coo(self) -> tuple[Tensor, Tensor, Tensor]:
        counts = (self.row_ptr[1:] - self.row_ptr[:-1]).long()
        rows = torch.repeat_interleave(  # the length given: nothing read back from the GPU
            torch.arange(self.shape[0], device=counts.device), counts, output_size=self.nnz
        )
        cols, vals = unpack_index_value(self.col_val, value_high=self.value_high)
        return rows, cols, vals

    def storage_bits(self) -> int:
        """32 bits per nonzero + 32 bits per row pointer (``rows + 1`` of them)."""
        return 32 * (self.nnz + self.row_ptr.numel())


@dataclass
class CSCMatrix(_SparseFromCOO):
    """Compressed sparse columns with packed row/value words (KVQuant's layout for values)."""

    col_ptr: Tensor
    row_val: Tensor
    shape: tuple[int, int]

    @classmethod
    def from_dense(cls, x: Tensor, mask: Tensor | None = None) -> CSCMatrix:
        cols, rows, vals = _entries(x.t(), None if mask is None else mask.t())
        return cls(_ptr(cols, x.shape[1]), pack_index_value(rows, vals), tuple(x.shape))

    @property
    def nnz(self) -> int:
        return self.row_val.numel()

    def _coo(self) -> tuple[Tensor, Tensor, Tensor]:
        counts = (self.col_ptr[1:] - self.col_ptr[:-1]).long()
        cols = torch.repeat_interleave(
            torch.arange(self.shape[1], device=counts.device), counts, output_size=self.nnz
        )
        rows, vals = unpack_index_value(self.row_val)
        return rows, cols, vals

    def storage_bits(self) -> int:
        """32 bits per nonzero + 32 bits per column pointer."""
        return 32 * (self.nnz + self.col_ptr.numel())


@dataclass
class PTCSRMatrix(_SparseFromCOO):
    """Padded, transposed CSR per 16-row tile (see module doc)."""

    tile_ptr: Tensor
    col_val: Tensor
    shape: tuple[int, int]
    value_high: bool = False

    @classmethod
    def from_dense(
        cls, x: Tensor, mask: Tensor | None = None, *, value_high: bool = False
    ) -> PTCSRMatrix:
        rows, cols, vals = _entries(x, mask)
        n_rows = x.shape[0]
        n_tiles = math.ceil(n_rows / TILE_ROWS)
        words = pack_index_value(cols, vals, value_high=value_high).to(torch.int64)  # row-major
        per_row = torch.bincount(rows, minlength=n_rows)  # [rows]
        row_start = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)[:-1]])
        rank = torch.arange(rows.numel(), device=x.device) - row_start[rows]  # i within its row
        padded_rows = torch.zeros(n_tiles * TILE_ROWS, dtype=per_row.dtype, device=x.device)
        padded_rows[:n_rows] = per_row
        width = padded_rows.view(n_tiles, TILE_ROWS).amax(1)  # [tiles] L_t
        tile_ptr = torch.cat([width.new_zeros(1), (width * TILE_ROWS).cumsum(0)])
        col_val = torch.zeros(int(tile_ptr[-1]), dtype=torch.int64, device=x.device)
        tile = rows // TILE_ROWS
        col_val[tile_ptr[tile] + rank * TILE_ROWS + rows % TILE_ROWS] = words
        return cls(tile_ptr.to(torch.int32), col_val.to(torch.int32), tuple(x.shape), value_high)

    @cached_property
    def nnz(self) -> int:
        """The stored nonzeros (the words that are not padding), read back from the GPU once."""
        return int((self.col_val != 0).sum())

    def _coo(self) -> tuple[Tensor, Tensor, Tensor]:
        words = self.col_val.numel()
        widths = ((self.tile_ptr[1:] - self.tile_ptr[:-1]) // TILE_ROWS).long()  # [tiles]
        slot_tile = torch.repeat_interleave(  # [words]
            torch.arange(widths.numel(), device=widths.device), widths * TILE_ROWS,
            output_size=words,
        )  # fmt: skip
        offset = torch.arange(words, device=widths.device) - self.tile_ptr[slot_tile].long()
        rows = slot_tile * TILE_ROWS + offset % TILE_ROWS  # [words]
        # the nonzero words in slot order (padding words are exactly 0), selected by a stable
        # sort and the known count rather than a mask: nothing read back from the GPU per call
        keep = torch.argsort((self.col_val == 0).to(torch.uint8), stable=True)[: self.nnz]
        cols, vals = unpack_index_value(self.col_val[keep], value_high=self.value_high)
        return rows[keep], cols, vals

    def storage_bits(self) -> int:
        """32 bits per word (padding included) + 32 bits per tile pointer."""
        return 32 * (self.col_val.numel() + self.tile_ptr.numel())
