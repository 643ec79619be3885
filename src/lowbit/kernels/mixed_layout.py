"""What the mixed 2/4-bit kernels read, and their pure-torch reference (no Triton here).

The kernels read the stored tensors of :class:`~lowbit.formats.mixed.MixedQuantized` as they
are (the aligned layout is the checkpoint's layout and the kernels'), plus two small derived
tables: the first input column of each 2-bit and 4-bit slot (``col2 [P2]``, ``col4 [P4]``
int32, from the stored group order; a padding slot points at column ``K``, which the kernels
mask) and the longest outlier row (the fused outlier loop's trip count).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.mixed import GROUP, MixedQuantized

__all__ = ["prepare_mixed", "mixed_reference", "MixedOperands"]

MixedOperands = dict  # name -> tensor (and a few ints), see prepare_mixed


def prepare_mixed(weight: MixedQuantized) -> dict:
    """The operands of :func:`lowbit.kernels.mixed_gemv.mixed_gemv` for ``weight``: its stored
    tensors (views), ``col2``/``col4`` int32 and ``max_row_nnz``."""
    n, k = weight.shape
    seg = weight.segments
    order = weight.order.to(torch.int32)
    # a padding slot names column K (masked), or column 0 when K is a multiple of 16 so the
    # M = 1 kernel's activation loads need no mask (the slot's codes and statistics are 0)
    pad = 0 if k % GROUP == 0 else k
    cols = torch.where(order >= 0, order * GROUP, torch.full_like(order, pad))
    counts = weight.outliers.row_ptr[1:] - weight.outliers.row_ptr[:-1]
    return {
        "primary": _nonempty(weight.primary),
        "secondary": _nonempty(weight.secondary),
        "stats2": _nonempty(weight.stats2),
        "stats4": _nonempty(weight.stats4),
        "second2": _nonempty(_pair_words(weight.second2)),
        "second4": _nonempty(_pair_words(weight.second4)),
        "col2": _nonempty(cols[: seg.slots2].contiguous()),
        "col4": _nonempty(cols[seg.slots2 :].contiguous()),
        "row_ptr": weight.outliers.row_ptr,
        "col_val": _nonempty(weight.outliers.col_val),
        "max_row_nnz": int(counts.max()) if n else 0,
        "even_cols": k % GROUP == 0,
        "shape": (n, k),
        "segments": seg,
        "g2": weight.g2,
        "weight": weight,  # the reference a tuning candidate is checked against
    }


def _pair_words(pairs: Tensor) -> Tensor:
    """The ``(s2, z2)`` fp16 pairs ``[R, P, 2]`` as one int32 word each, ``[R, P]``
    (little-endian: s2 low). Through ``[R, 2 P]``: a view of the pairs' dimension as int32 is
    refused when ``P`` is 1 (its stride is then 1, not 2)."""
    r, p, _ = pairs.shape
    return pairs.reshape(r, 2 * p).view(torch.int32)


def _nonempty(t: Tensor) -> Tensor:
    """``t``, or one zero element of its dtype when it is empty (a segment the layout does not
    use: the kernels mask every access to it, but a launch needs a real pointer)."""
    if t.numel():
        return t
    return torch.zeros((1,) * max(t.dim(), 1), dtype=t.dtype, device=t.device)


def mixed_reference(
    x: Tensor, weight: MixedQuantized, bias: Tensor | None = None, *, outliers: bool = True
) -> Tensor:
    """``x [M, K] @ Wᵀ + bias`` with ``W`` decoded from the stored tensors in fp32 (every
    scale ``(c - z2) * s2``, every weight ``(q - z) * s``, plus the fp16 outliers unless
    ``outliers=False``), one fp32 matmul, one rounding to ``x``'s dtype.

    Memory traffic of the kernels it stands for, at M = 1: every stored tensor once (codes,
    16-bit triplet statistics, 8-bit 4-bit-group statistics, second-order pairs, outlier
    words), ``x`` from cache, ``N`` outputs written.
    """
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise LowbitError(f"x must be [M, {weight.shape[1]}], got {tuple(x.shape)}")
    w = weight.dequantize(torch.float32)  # [N, K]
    if not outliers:
        w = w - weight.outliers.to_dense()
    out = x.float() @ w.T  # [M, N]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
