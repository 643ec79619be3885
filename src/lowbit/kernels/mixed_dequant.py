"""The weight of a mixed 2/4-bit layer decoded in one pass (Triton), for prefill.

Above 16 rows a mixed product is compute-bound: the ``triton`` backend decodes the weight once
and calls a dense GEMM. Decoding with torch ops (:meth:`MixedQuantized.dequantize
<lowbit.formats.mixed.MixedQuantized.dequantize>`, the reference) writes and reads a dozen
full-size intermediates (codes, zeros, scales, the outliers' dense matrix); this kernel reads
every stored tensor once and writes the ``[N, K]`` fp32 weight once. The outliers are then
added at their positions and the weight rounded once to the input's dtype: the reference's
weight bit for bit.

Each program decodes one 128-bit word of ``BLOCK_N`` rows: its lanes' groups (segment A: three
2-bit groups and half of a 4-bit group whose other half is the word's lane in ``secondary``;
B: four 2-bit groups; C: two 4-bit groups), each group's 16 weights ``(code - zero) * scale``
in fp32 (``scale = (c - z2) * s2``, the second-order dequantization) stored as 64 contiguous
bytes per row at the group's columns. A padding slot's columns are past ``K`` (nothing stored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lowbit.kernels.mixed_gemv import _second, _split4, _triplet_stats

__all__ = ["mixed_dequant"]

BLOCK_N = 64


@triton.jit
def _store_group(out_ptr, rows, mask_n, stride_on, col, K, lo, hi, zero, scale,
                 BITS: tl.constexpr):  # fmt: skip
    """``(code - zero) * scale`` of one group's 16 codes at columns ``col + [0, 16)`` of
    ``rows``: 2 bits, all 16 in ``lo``; 4 bits, codes 0-7 in ``lo`` and 8-15 in ``hi``
    (``[BLOCK_N]`` uint32 lanes; ``zero``, ``scale`` ``[BLOCK_N]`` fp32). ``col`` is 16 times
    a loaded group index, a multiple of 16 the compiler can see: 16-byte vector stores."""
    j = tl.arange(0, 16)  # [16]
    if BITS == 2:
        codes = (lo[:, None] >> (2 * j).to(tl.uint32)[None, :]) & 3  # [BLOCK_N, 16]
    else:
        src = tl.where((j < 8)[None, :], lo[:, None], hi[:, None])
        codes = (src >> (4 * (j % 8)).to(tl.uint32)[None, :]) & 15
    weights = (codes.to(tl.float32) - zero[:, None]) * scale[:, None]  # exact difference
    cols = col + j  # [16]; a padding slot's are all past K (masked)
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], weights,
             mask=mask_n[:, None] & (cols < K)[None, :])  # fmt: skip


@triton.jit
def _decode2(out_ptr, rows, row, mask_n, stats2_ptr, second2_ptr, group2_ptr, stride_t2,
             stride_r2, stride_on, K, G2: tl.constexpr, slot, bits):  # fmt: skip
    """2-bit slot ``slot`` of ``rows`` (its 16 codes in the ``[BLOCK_N]`` uint32 lane ``bits``;
    ``row``: the rows read, ``mask_n``: those stored): zero and scale code from the row's
    triplet, ``scale = (c - z2) * s2``, weights stored."""
    word = tl.load(stats2_ptr + row * stride_t2 + slot // 3).to(tl.int32) & 0xFFFF
    zero, code = _triplet_stats(word, slot % 3)
    s2, z2 = _second(second2_ptr, row // G2, stride_r2, slot, row >= 0)
    _store_group(out_ptr, rows, mask_n, stride_on, 16 * tl.load(group2_ptr + slot), K, bits,
                 bits, zero, (code.to(tl.float32) - z2) * s2, 2)  # fmt: skip


@triton.jit
def _decode4(out_ptr, rows, row, mask_n, stats4_ptr, second4_ptr, group4_ptr, stride_t4,
             stride_r4, stride_on, K, G2: tl.constexpr, slot, lo, hi):  # fmt: skip
    """4-bit slot ``slot`` of ``rows`` (codes 0-7 in the lane ``lo``, 8-15 in ``hi``; ``row``,
    ``mask_n`` as for :func:`_decode2`): zero and scale code from the row's byte,
    ``scale = (c - z2) * s2``, weights stored."""
    byte = tl.load(stats4_ptr + row * stride_t4 + slot).to(tl.int32)
    s2, z2 = _second(second4_ptr, row // G2, stride_r4, slot, row >= 0)
    scale = ((byte >> 4).to(tl.float32) - z2) * s2
    _store_group(out_ptr, rows, mask_n, stride_on, 16 * tl.load(group4_ptr + slot), K, lo, hi,
                 (byte & 15).to(tl.float32), scale, 4)  # fmt: skip


@triton.jit
def _mixed_dequant_kernel(
    primary_ptr, secondary_ptr, stats2_ptr, stats4_ptr, second2_ptr, second4_ptr, group2_ptr,
    group4_ptr, out_ptr,
    N, K, stride_pn, stride_sn, stride_t2, stride_t4, stride_r2, stride_r4, stride_on,
    UA: tl.constexpr, UB: tl.constexpr, G2: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    w = tl.program_id(1)  # the word: segment A below UA, B below UA + UB, else C
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row = tl.minimum(rows, N - 1)  # rows past N read row N - 1 (never stored)
    mask_n = rows < N
    lanes = _split4(tl.load(primary_ptr + row[:, None] * stride_pn + 4 * w
                            + tl.arange(0, 4)[None, :]), BLOCK_N)  # fmt: skip
    two = (out_ptr, rows, row, mask_n, stats2_ptr, second2_ptr, group2_ptr, stride_t2, stride_r2,
           stride_on, K, G2)  # fmt: skip
    four = (out_ptr, rows, row, mask_n, stats4_ptr, second4_ptr, group4_ptr, stride_t4,
            stride_r4, stride_on, K, G2)  # fmt: skip
    if w < UA:  # 2-bit slots 3w, 3w + 1, 3w + 2, and 4-bit slot w: lane 3 and secondary
        for lane in tl.static_range(3):
            _decode2(*two, 3 * w + lane, lanes[lane])
        high = tl.load(secondary_ptr + row * stride_sn + w).to(tl.uint32, bitcast=True)
        _decode4(*four, w, lanes[3], high)
    elif w < UA + UB:  # 2-bit slots 3 UA + 4 (w - UA) + lane
        for lane in tl.static_range(4):
            _decode2(*two, 3 * UA + 4 * (w - UA) + lane, lanes[lane])
    else:  # 4-bit slots UA + 2 (w - UA - UB) + half: lanes 0-1, then 2-3
        for half in tl.static_range(2):
            _decode4(*four, UA + 2 * (w - UA - UB) + half, lanes[2 * half], lanes[2 * half + 1])


def _slot_groups(ops: dict) -> tuple[Tensor, Tensor]:
    """The column group of each 2-bit and 4-bit slot (int32; a padding slot's is the first
    group past K: nothing stored), computed on the first call and kept in ``ops``."""
    groups = ops.get("dequant_groups")
    if groups is None:
        weight = ops["weight"]
        order = weight.order.to(torch.int32)
        table = torch.where(order >= 0, order, torch.full_like(order, weight.groups))
        slots2 = weight.segments.slots2
        groups = (table[:slots2].contiguous(), table[slots2:].contiguous())
        ops["dequant_groups"] = groups
    return groups


def mixed_dequant(ops: dict, dtype: torch.dtype, *, probe: bool = False) -> Tensor:
    """The ``[N, K]`` weight in ``dtype`` from :func:`~lowbit.kernels.mixed_layout.prepare_mixed`'s
    operands: the dense part decoded by the kernel in fp32, the outliers added in fp32, one
    rounding (``MixedQuantized.dequantize(dtype)`` bit for bit); with ``probe`` the compiled
    kernel only."""
    weight = ops["weight"]
    n, k = ops["shape"]
    seg = ops["segments"]
    group2, group4 = _slot_groups(ops)
    out = torch.empty(n, k, dtype=torch.float32, device=ops["primary"].device)  # [N, K]
    grid = (triton.cdiv(n, BLOCK_N), seg.words)
    compiled = _mixed_dequant_kernel.run(
        ops["primary"], ops["secondary"], ops["stats2"], ops["stats4"], ops["second2"],
        ops["second4"], group2, group4, out,
        n, k, ops["primary"].stride(0), max(1, ops["secondary"].stride(0)),
        max(1, ops["stats2"].stride(0)), max(1, ops["stats4"].stride(0)),
        ops["second2"].stride(0), ops["second4"].stride(0), out.stride(0),
        UA=seg.ua, UB=seg.ub, G2=ops["g2"], BLOCK_N=BLOCK_N, num_warps=4, grid=grid,
        warmup=probe,
    )  # fmt: skip
    if probe:
        return compiled
    rows, cols, values = weight.outliers._coo()  # [nnz] each, unique positions, fp32 values
    out[rows, cols] += values  # gather, add, scatter: nothing read back (CUDA-graph capture)
    return out.to(dtype)
