"""GEMV with asynchronous dequantization for mixed 2/4-bit weights (seed 002, Algorithm 1).

``x [M, K] @ Wᵀ`` for M <= 16 with ``W`` in the aligned layout of
:mod:`lowbit.formats.mixed`; the torch reference is
:func:`lowbit.kernels.mixed_layout.mixed_reference`. Memory traffic at M = 1: every stored
tensor once (a 128-bit word of codes per unit and row, its 32-bit second half of a 4-bit group,
a 16-bit triplet of clipped first-order statistics, a byte of 4-bit-group statistics, the
fp16 second-order pairs shared by ``g2`` rows, the outlier words), ``x`` from cache, ``N``
outputs.

One program owns ``BLOCK_N`` rows and, per split of K, a range of *tiles* of ``T`` words in
each segment of the layout (A: triplet + half 4-bit group, B: four 2-bit groups, C: two 4-bit
groups). Per tile it

1. loads the ``[BLOCK_N, 4 T]`` int32 words as one contiguous block (each row's 128-bit words
   whole: the aligned vector loads of the seed) and splits them into their four lanes, plus
   the second matrix's lane in segment A;
2. loads the first-order statistics and the second-order ``(s2, z2)`` of the tile's groups and
   dequantizes the scales, ``s = (c - z2) * s2`` (the 2nd-order dequantization);
3. decodes each lane's codes (shift, mask, the exponent trick ``code | 0x4B000000``) and sums
   ``code * x`` per group, unscaled; at M = 1 as FMAs into ``[BLOCK_N, T]`` partial sums, then
   ``acc += s * (Σ code x - z Σ x)`` once per group; at 2 <= M <= 16 the decoded weights
   ``(code - z) * s`` go through ``tl.dot`` with the tile's activations (``T`` groups deep).

**Asynchronous** (``ASYNC=True``, Algorithm 1): the loop is software-pipelined by hand: the
words *and* statistics of tile ``i + 1`` are loaded at the top of iteration ``i``, before the
scales of tile ``i`` are dequantized and its codes decoded, so the second-order dequantization
of a group's scales runs while the next weights are in flight. **Synchronous**
(``ASYNC=False``): each tile loads its words, decodes them into the unscaled per-group sums,
and only then (after a ``tl.debug_barrier``, which nothing is moved across) loads its
statistics and dequantizes its scales: the dataflow the seed measures against. The two compute
the same sums in the same order (bit-identical outputs); only the schedule differs. At M > 1
both take the asynchronous schedule (the dot needs the scales before it).

Outliers (``FUSE_OUTLIERS``): the first split of each row block walks its rows' CSR words
(``MAX_ROW_NNZ`` iterations, the longest row rounded up to a power of two) and adds
``value * x[col]``; unfused, a separate Triton SpMV over the same CSR adds them afterwards.

Split-K as in :mod:`lowbit.kernels.int_gemv`: fp32 partials ``[SPLIT_K, M, N]`` summed by
torch (deterministic); launch configurations are timed per shape on a GPU (never under the
interpreter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from lowbit.errors import LowbitError

__all__ = ["mixed_gemv", "outlier_spmv", "MAX_ROWS"]

MAX_ROWS = 16
INTERPRET = bool(triton.knobs.runtime.interpret)
TUNE = os.environ.get("LOWBIT_TRITON_TUNE", "1") != "0"


@triton.jit
def _codes(lane, shift: tl.constexpr, mask: tl.constexpr):
    """fp32 codes of one slot of a ``[BLOCK_N, T]`` uint32 lane block (exact)."""
    bits = ((lane >> shift) & mask) | 0x4B000000  # float bits of 2**23 + code
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _split_words(words, BLOCK_N: tl.constexpr, T: tl.constexpr):
    """``[BLOCK_N, 4 T]`` int32 (each row's 128-bit words whole) -> four ``[BLOCK_N, T]``
    uint32 lanes."""
    w = tl.reshape(words.to(tl.uint32, bitcast=True), (BLOCK_N, T, 2, 2))
    even, odd = tl.split(w)  # lanes (0, 2), (1, 3)
    l0, l2 = tl.split(even)
    l1, l3 = tl.split(odd)
    return l0, l1, l2, l3


@triton.jit
def _load_words(ptr, offs_n, mask_n, stride, first_word, tile, count, stop, T: tl.constexpr):
    """Words ``first_word + tile * T + [0, T)`` of each row (those below ``count`` in the
    segment, none when ``tile >= stop``) as one ``[BLOCK_N, 4 T]`` block."""
    offs = tl.arange(0, 4 * T)
    # block-shaped tests only: Triton 3.9's interpreter widens bool & scalar to int32
    valid = ((tile * T + offs // 4) < count) & ((offs * 0 + tile) < stop)
    ptrs = ptr + offs_n[:, None] * stride + ((first_word + tile * T) * 4 + offs)[None, :]
    return tl.load(ptrs, mask=mask_n[:, None] & valid[None, :], other=0)


@triton.jit
def _scale(code, second_ptr, rows, stride_r, slot, mask):
    """``(c - z2) * s2`` fp32 ``[BLOCK_N, T]`` from 4-bit-grid codes and the slots' fp16
    second-order pairs (exact)."""
    ptrs = second_ptr + rows[:, None] * stride_r + (slot * 2)[None, :]
    s2 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z2 = tl.load(ptrs + 1, mask=mask, other=0.0).to(tl.float32)
    return (code.to(tl.float32) - z2) * s2


@triton.jit
def _triplet_stats(word, pos):
    """Zero and 4-bit-grid scale code at triplet position ``pos`` of 16-bit words."""
    zero = ((word >> (2 * pos)) & 3).to(tl.float32)
    full = (word >> 6) & 15
    clipped = ((word >> (7 + 3 * pos)) & 7) * 2 + 1  # positions 1, 2: bits 10-12, 13-15
    return zero, tl.where(pos == 0, full, clipped)


@triton.jit
def _xsum(x_ptr, cols, K, WIDTH: tl.constexpr, OFFSET: tl.constexpr):
    """``Σ_j x[cols + OFFSET + j]`` over ``j < WIDTH`` (M = 1), ``[T]`` fp32."""
    total = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        c = cols + OFFSET + j
        total += tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
    return total


@triton.jit
def _dot_lane(lane, x_ptr, cols, K, BITS: tl.constexpr, OFFSET: tl.constexpr):
    """``Σ_j code_j * x[cols + OFFSET + j]`` over the ``32 // BITS`` codes of a lane (M = 1),
    ``[BLOCK_N, T]`` fp32, unscaled."""
    part = tl.zeros(lane.shape, dtype=tl.float32)
    for j in tl.static_range(32 // BITS):
        c = cols + OFFSET + j
        x = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)  # [T]
        part += _codes(lane, j * BITS, (1 << BITS) - 1) * x[None, :]
    return part


@triton.jit
def _mma_lane(acc, lane, zero, scale, x_ptr, cols, K, stride_xm, offs_m, mask_m,
              BITS: tl.constexpr, OFFSET: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``acc += ((code - z) * s) @ x`` over the lane's codes (2 <= M <= 16), the ``T`` groups
    of the tile as the dot's depth. ``acc [BLOCK_N, BLOCK_M]``."""
    for j in tl.static_range(32 // BITS):
        c = cols + OFFSET + j  # [T]
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + c[None, :],
            mask=mask_m[:, None] & (c < K)[None, :],
            other=0.0,
        )  # [BLOCK_M, T]
        w = (_codes(lane, j * BITS, (1 << BITS) - 1) - zero) * scale  # [BLOCK_N, T] fp32
        if INTERPRET:  # the interpreter's low-precision dot is not exact: fp32 operands
            acc = tl.dot(w.to(x.dtype).to(tl.float32), tl.trans(x.to(tl.float32)), acc)
        else:
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    return acc


@triton.jit
def _mixed_gemv_kernel(
    x_ptr, primary_ptr, secondary_ptr, stats2_ptr, stats4_ptr, second2_ptr, second4_ptr,
    col2_ptr, col4_ptr, row_ptr_ptr, col_val_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_pn, stride_sn, stride_t2, stride_t4, stride_r2, stride_r4,
    stride_os, stride_om,
    UA: tl.constexpr, UB: tl.constexpr, UC: tl.constexpr,
    TILES_A: tl.constexpr, TILES_B: tl.constexpr, TILES_C: tl.constexpr,
    G2: tl.constexpr, T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ASYNC: tl.constexpr, FUSE_OUTLIERS: tl.constexpr, MAX_ROW_NNZ: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    rows = offs_n // G2  # second-order group of each row
    offs_t = tl.arange(0, T)  # [T]
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, T), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)

    # ---- segment A: a triplet of 2-bit groups + half a 4-bit group per word, the other half
    # in the second matrix
    first_a = pid_k * TILES_A
    stop_a = first_a + TILES_A
    nxt_words = _load_words(primary_ptr, offs_n, mask_n, stride_pn, 0, first_a, UA, stop_a, T)
    u = first_a * T + offs_t
    m2 = mask_n[:, None] & (u < UA)[None, :]
    nxt_sec = tl.load(secondary_ptr + offs_n[:, None] * stride_sn + u[None, :], mask=m2, other=0)
    nxt_t2 = tl.load(stats2_ptr + offs_n[:, None] * stride_t2 + u[None, :], mask=m2, other=0)
    nxt_t4 = tl.load(stats4_ptr + offs_n[:, None] * stride_t4 + u[None, :], mask=m2, other=0)
    for i in range(TILES_A):
        tile = first_a + i
        u = tile * T + offs_t  # [T] words of this tile
        valid = u < UA
        m2 = mask_n[:, None] & valid[None, :]
        if ASYNC:  # this tile's loads were issued last iteration; issue the next tile's now
            words, sec, t2, t4 = nxt_words, nxt_sec, nxt_t2, nxt_t4
            un = u + T
            mn = mask_n[:, None] & ((un < UA) & ((offs_t * 0 + tile + 1) < stop_a))[None, :]
            nxt_words = _load_words(primary_ptr, offs_n, mask_n, stride_pn, 0, tile + 1, UA,
                                    stop_a, T)  # fmt: skip
            nxt_sec = tl.load(
                secondary_ptr + offs_n[:, None] * stride_sn + un[None, :], mask=mn, other=0
            )
            nxt_t2 = tl.load(
                stats2_ptr + offs_n[:, None] * stride_t2 + un[None, :], mask=mn, other=0
            )
            nxt_t4 = tl.load(
                stats4_ptr + offs_n[:, None] * stride_t4 + un[None, :], mask=mn, other=0
            )
        else:
            words = _load_words(primary_ptr, offs_n, mask_n, stride_pn, 0, tile, UA, stop_a, T)
            sec = tl.load(
                secondary_ptr + offs_n[:, None] * stride_sn + u[None, :], mask=m2, other=0
            )
        l0, l1, l2, l3 = _split_words(words, BLOCK_N, T)
        sec = sec.to(tl.uint32, bitcast=True)
        col_a = tl.load(col2_ptr + 3 * u, mask=valid, other=K)
        col_b = tl.load(col2_ptr + 3 * u + 1, mask=valid, other=K)
        col_c = tl.load(col2_ptr + 3 * u + 2, mask=valid, other=K)
        col_4 = tl.load(col4_ptr + u, mask=valid, other=K)
        if BLOCK_M == 1:
            p0 = _dot_lane(l0, x_ptr, col_a, K, 2, 0)
            p1 = _dot_lane(l1, x_ptr, col_b, K, 2, 0)
            p2 = _dot_lane(l2, x_ptr, col_c, K, 2, 0)
            p4 = _dot_lane(l3, x_ptr, col_4, K, 4, 0) + _dot_lane(sec, x_ptr, col_4, K, 4, 8)
            if not ASYNC:  # the statistics only after the weights are consumed
                tl.debug_barrier()
                t2 = tl.load(
                    stats2_ptr + offs_n[:, None] * stride_t2 + u[None, :], mask=m2, other=0
                )
                t4 = tl.load(
                    stats4_ptr + offs_n[:, None] * stride_t4 + u[None, :], mask=m2, other=0
                )
        elif not ASYNC:
            t2 = tl.load(stats2_ptr + offs_n[:, None] * stride_t2 + u[None, :], mask=m2, other=0)
            t4 = tl.load(stats4_ptr + offs_n[:, None] * stride_t4 + u[None, :], mask=m2, other=0)
        t2 = t2.to(tl.int32) & 0xFFFF
        t4 = t4.to(tl.int32)
        z0, c0 = _triplet_stats(t2, 0)
        z1, c1 = _triplet_stats(t2, 1)
        z2, c2 = _triplet_stats(t2, 2)
        s0 = _scale(c0, second2_ptr, rows, stride_r2, 3 * u, m2)
        s1 = _scale(c1, second2_ptr, rows, stride_r2, 3 * u + 1, m2)
        s2 = _scale(c2, second2_ptr, rows, stride_r2, 3 * u + 2, m2)
        z4 = (t4 & 15).to(tl.float32)
        s4 = _scale(t4 >> 4, second4_ptr, rows, stride_r4, u, m2)
        if BLOCK_M == 1:
            acc += s0 * (p0 - z0 * _xsum(x_ptr, col_a, K, 16, 0)[None, :])
            acc += s1 * (p1 - z1 * _xsum(x_ptr, col_b, K, 16, 0)[None, :])
            acc += s2 * (p2 - z2 * _xsum(x_ptr, col_c, K, 16, 0)[None, :])
            acc += s4 * (p4 - z4 * _xsum(x_ptr, col_4, K, 16, 0)[None, :])
        else:
            acc = _mma_lane(
                acc, l0, z0, s0, x_ptr, col_a, K, stride_xm, offs_m, mask_m, 2, 0, INTERPRET
            )
            acc = _mma_lane(
                acc, l1, z1, s1, x_ptr, col_b, K, stride_xm, offs_m, mask_m, 2, 0, INTERPRET
            )
            acc = _mma_lane(
                acc, l2, z2, s2, x_ptr, col_c, K, stride_xm, offs_m, mask_m, 2, 0, INTERPRET
            )
            acc = _mma_lane(
                acc, l3, z4, s4, x_ptr, col_4, K, stride_xm, offs_m, mask_m, 4, 0, INTERPRET
            )
            acc = _mma_lane(
                acc, sec, z4, s4, x_ptr, col_4, K, stride_xm, offs_m, mask_m, 4, 8, INTERPRET
            )

    # ---- segment B: four 2-bit groups per word (2-bit slots 3 UA + 4 w + lane)
    first_b = pid_k * TILES_B
    for i in range(TILES_B):
        tile = first_b + i
        w = tile * T + offs_t
        valid = w < UB
        m2 = mask_n[:, None] & valid[None, :]
        words = _load_words(primary_ptr, offs_n, mask_n, stride_pn, UA, tile, UB, UB, T)
        l0, l1, l2, l3 = _split_words(words, BLOCK_N, T)
        slot = 3 * UA + 4 * w  # [T] slot of lane 0
        for lane in tl.static_range(4):
            if lane == 0:
                bits = l0
            elif lane == 1:
                bits = l1
            elif lane == 2:
                bits = l2
            else:
                bits = l3
            p = slot + lane
            col = tl.load(col2_ptr + p, mask=valid, other=K)
            if BLOCK_M == 1:
                part = _dot_lane(bits, x_ptr, col, K, 2, 0)
                if not ASYNC:
                    tl.debug_barrier()
            word = tl.load(
                stats2_ptr + offs_n[:, None] * stride_t2 + (p // 3)[None, :], mask=m2, other=0
            )
            zero, code = _triplet_stats(word.to(tl.int32) & 0xFFFF, (p % 3)[None, :])
            scale = _scale(code, second2_ptr, rows, stride_r2, p, m2)
            if BLOCK_M == 1:
                acc += scale * (part - zero * _xsum(x_ptr, col, K, 16, 0)[None, :])
            else:
                acc = _mma_lane(
                    acc,
                    bits,
                    zero,
                    scale,
                    x_ptr,
                    col,
                    K,
                    stride_xm,
                    offs_m,
                    mask_m,
                    2,
                    0,
                    INTERPRET,
                )

    # ---- segment C: two 4-bit groups per word (4-bit slots UA + 2 v + h)
    first_c = pid_k * TILES_C
    for i in range(TILES_C):
        tile = first_c + i
        v = tile * T + offs_t
        valid = v < UC
        m2 = mask_n[:, None] & valid[None, :]
        words = _load_words(primary_ptr, offs_n, mask_n, stride_pn, UA + UB, tile, UC, UC, T)
        l0, l1, l2, l3 = _split_words(words, BLOCK_N, T)
        for h in tl.static_range(2):
            if h == 0:
                lo = l0
                hi = l1
            else:
                lo = l2
                hi = l3
            p = UA + 2 * v + h
            col = tl.load(col4_ptr + p, mask=valid, other=K)
            if BLOCK_M == 1:
                part = _dot_lane(lo, x_ptr, col, K, 4, 0) + _dot_lane(hi, x_ptr, col, K, 4, 8)
                if not ASYNC:
                    tl.debug_barrier()
            t4 = tl.load(stats4_ptr + offs_n[:, None] * stride_t4 + p[None, :], mask=m2, other=0)
            t4 = t4.to(tl.int32)
            zero = (t4 & 15).to(tl.float32)
            scale = _scale(t4 >> 4, second4_ptr, rows, stride_r4, p, m2)
            if BLOCK_M == 1:
                acc += scale * (part - zero * _xsum(x_ptr, col, K, 16, 0)[None, :])
            else:
                acc = _mma_lane(
                    acc, lo, zero, scale, x_ptr, col, K, stride_xm, offs_m, mask_m, 4, 0, INTERPRET
                )
                acc = _mma_lane(
                    acc, hi, zero, scale, x_ptr, col, K, stride_xm, offs_m, mask_m, 4, 8, INTERPRET
                )

    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
    else:
        out = acc  # [BLOCK_N, BLOCK_M]
    if FUSE_OUTLIERS:  # the first split adds its rows' fp16 outliers
        first = (offs_n * 0 + pid_k) == 0  # block-shaped (see _load_words)
        out = _add_outliers(out, x_ptr, row_ptr_ptr, col_val_ptr, offs_n, mask_n & first,
                            offs_m, mask_m, stride_xm, MAX_ROW_NNZ)  # fmt: skip
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, out, mask=mask)  # fp32 partial sums


@triton.jit
def _add_outliers(out, x_ptr, row_ptr_ptr, col_val_ptr, offs_n, mask_n, offs_m, mask_m,
                  stride_xm, MAX_ROW_NNZ: tl.constexpr):  # fmt: skip
    """``out [BLOCK_N, BLOCK_M] += value * x[:, col]`` over the rows' CSR words (column in the
    high 16 bits, fp16 value in the low 16)."""
    start = tl.load(row_ptr_ptr + offs_n, mask=mask_n, other=0)
    end = tl.load(row_ptr_ptr + offs_n + 1, mask=mask_n, other=0)
    for e in range(MAX_ROW_NNZ):
        idx = start + e
        valid = mask_n & (idx < end)  # [BLOCK_N]
        word = tl.load(col_val_ptr + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
        col = (word >> 16).to(tl.int32)
        value = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + col[:, None],
            mask=valid[:, None] & mask_m[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_M]
        out += value[:, None] * x
    return out


@triton.jit
def _outlier_spmv_kernel(
    x_ptr, row_ptr_ptr, col_val_ptr, out_ptr, M, N, stride_xm, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MAX_ROW_NNZ: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    out = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    out = _add_outliers(out, x_ptr, row_ptr_ptr, col_val_ptr, offs_n, mask_n, offs_m, mask_m,
                        stride_xm, MAX_ROW_NNZ)  # fmt: skip
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], out,
             mask=mask_n[:, None] & mask_m[None, :])  # fmt: skip


def _nnz_bound(max_row_nnz: int) -> int:
    """The fused loop's trip count: the longest row rounded up to a power of two (few
    compiles across layers), 0 without outliers."""
    return 0 if max_row_nnz == 0 else triton.next_power_of_2(max_row_nnz)


def outlier_spmv(x: Tensor, ops: dict) -> Tensor:
    """``x [M, K] @ Sᵀ`` fp32 ``[M, N]`` for the CSR outliers ``S`` of ``ops`` (the unfused
    path: its own launch)."""
    m = x.shape[0]
    n = ops["shape"][0]
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    block_n = 32 if INTERPRET else 128
    _outlier_spmv_kernel[(triton.cdiv(n, block_n),)](
        x, ops["row_ptr"], ops["col_val"], out, m, n, x.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_M=triton.next_power_of_2(m),
        MAX_ROW_NNZ=_nnz_bound(ops["max_row_nnz"]),
    )  # fmt: skip
    return out


def _launch(x, ops, bias, config, asynchronous, fuse_outliers) -> Tensor:
    m, k = x.shape
    n = ops["shape"][0]
    seg = ops["segments"]
    block_m, block_n, tile, split_k, num_warps = config
    tiles = [triton.cdiv(c, tile) for c in (seg.ua, seg.ub, seg.uc)]
    split_k = max(1, min(split_k, max(tiles)))
    per_split = [triton.cdiv(t, split_k) for t in tiles]
    fuse = fuse_outliers and ops["max_row_nnz"] > 0
    separate = not fuse_outliers and ops["max_row_nnz"] > 0  # a second launch adds them
    # fp32 output unless the kernel's result is final, so the output is rounded once
    out_dtype = x.dtype if split_k == 1 and not separate else torch.float32
    out = torch.empty(split_k, m, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), split_k)
    _mixed_gemv_kernel[grid](
        x, ops["primary"], ops["secondary"], ops["stats2"], ops["stats4"], ops["second2"],
        ops["second4"], ops["col2"], ops["col4"], ops["row_ptr"], ops["col_val"],
        x if bias is None else bias, out,
        m, n, k,
        x.stride(0), ops["primary"].stride(0), max(1, ops["secondary"].stride(0)),
        max(1, ops["stats2"].stride(0)), max(1, ops["stats4"].stride(0)),
        ops["second2"].stride(0), ops["second4"].stride(0),
        out.stride(0), out.stride(1),
        UA=seg.ua, UB=seg.ub, UC=seg.uc,
        TILES_A=per_split[0], TILES_B=per_split[1], TILES_C=per_split[2],
        G2=ops["g2"], T=tile, BLOCK_M=block_m, BLOCK_N=block_n,
        ASYNC=asynchronous, FUSE_OUTLIERS=fuse, MAX_ROW_NNZ=_nnz_bound(ops["max_row_nnz"]),
        SPLIT_K=split_k, HAS_BIAS=bias is not None, INTERPRET=INTERPRET, num_warps=num_warps,
    )  # fmt: skip
    if split_k == 1 and not separate:
        return out[0]
    total = out.sum(0) if split_k > 1 else out[0]  # [M, N] fp32 (bias added when split_k 1)
    if separate:
        total += outlier_spmv(x, ops)
    if bias is not None and split_k > 1:
        total += bias.float()
    return total.to(x.dtype)


def _default_config(m: int, n: int, words: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, T, SPLIT_K, warps) without measuring: ~2 programs per H100 SM."""
    block_m = 1 if m == 1 else MAX_ROWS
    if INTERPRET:
        return block_m, 16, 16 if m > 1 else 4, 1, 4
    block_n, tile = 64, 16
    split_k = max(1, min(triton.cdiv(words, tile), triton.cdiv(264, triton.cdiv(n, block_n))))
    return block_m, block_n, tile, split_k, 4


def _candidates(m: int, n: int, words: int):
    def waves(block_n, tile):
        return max(1, min(triton.cdiv(words, tile), triton.cdiv(264, triton.cdiv(n, block_n))))

    block_m = 1 if m == 1 else MAX_ROWS
    for block_n, tile in ((64, 16), (128, 16), (32, 16), (64, 32)):
        yield block_m, block_n, tile, waves(block_n, tile), 4
    yield block_m, 64, 16, max(1, waves(64, 16) // 4), 4


_TUNED: dict[tuple, tuple[int, int, int, int, int]] = {}


def mixed_gemv(
    x: Tensor,
    ops: dict,
    bias: Tensor | None = None,
    *,
    asynchronous: bool = True,
    fuse_outliers: bool = True,
    config: tuple[int, int, int, int, int] | None = None,
    tune: bool = True,
) -> Tensor:
    """``x @ Wᵀ + bias`` for M <= 16 with ``W`` from :func:`prepare_mixed`'s operands.

    Args:
        x: ``[M, K]`` fp16/bf16, 1 <= M <= 16.
        ops: :func:`lowbit.kernels.mixed_layout.prepare_mixed` of the weight (on x's device).
        bias: ``[N]`` in x's dtype, or None.
        asynchronous: the software-pipelined schedule (module doc); False: synchronous.
        fuse_outliers: add the outliers inside the kernel; False: a separate SpMV launch.
        config: ``(BLOCK_M, BLOCK_N, T, SPLIT_K, num_warps)`` to force one configuration
            (``T``: words per tile, a power of two, at least 16 when BLOCK_M = 16).
        tune: on a GPU, time a few configurations once per shape and keep the fastest.

    Returns:
        ``[M, N]`` in x's dtype (fp32 accumulation).
    """
    n, k = ops["shape"]
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float16, torch.bfloat16):
        raise LowbitError(f"x must be [M, {k}] fp16 or bf16, got {tuple(x.shape)} {x.dtype}")
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise LowbitError(f"mixed_gemv takes 1 to {MAX_ROWS} rows, not {m}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise LowbitError(f"bias must be [{n}] {x.dtype}")
    if ops["primary"].device != x.device:
        raise LowbitError(f"the weight is on {ops['primary'].device} and x on {x.device}")
    if config is not None and (config[0] not in (1, MAX_ROWS) or config[0] < m):
        raise LowbitError(f"BLOCK_M must be 1 (M = 1) or {MAX_ROWS}, not {config[0]} for M={m}")
    if config is not None and config[0] > 1 and config[2] < 16:
        raise LowbitError("tiles of fewer than 16 words cannot feed tl.dot (BLOCK_M = 16)")
    x = x.contiguous()
    words = ops["segments"].words
    if config is None:
        key = (m == 1, n, k, ops["segments"], x.dtype, x.device, asynchronous, fuse_outliers)
        config = _TUNED.get(key)
        if config is None:
            config = _default_config(m, n, words)
            if tune and TUNE and not INTERPRET:
                config = _fastest(x, ops, bias, list(_candidates(m, n, words)), asynchronous,
                                  fuse_outliers)  # fmt: skip
            _TUNED[key] = config
    return _launch(x, ops, bias, config, asynchronous, fuse_outliers)


def _fastest(x, ops, bias, configs, asynchronous, fuse_outliers):
    import triton.testing

    best, best_ms = configs[0], float("inf")
    for config in configs:
        try:
            ms = triton.testing.do_bench(
                lambda c=config: _launch(x, ops, bias, c, asynchronous, fuse_outliers),
                warmup=5, rep=20,
            )  # fmt: skip
        except Exception:  # a configuration the compiler rejects (resources) is skipped
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return best
