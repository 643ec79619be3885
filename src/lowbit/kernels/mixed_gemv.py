"""GEMV with asynchronous dequantization for mixed 2/4-bit weights (Li et al., 2024, Algorithm 1).

``x [M, K] @ Wᵀ`` for M <= 16 with ``W`` in the aligned layout of
:mod:`lowbit.formats.mixed`; the torch reference is
:func:`lowbit.kernels.mixed_layout.mixed_reference`. Memory traffic at M = 1: every stored
tensor once (a 128-bit word of codes per unit and row, its 32-bit second half of a 4-bit group,
a 16-bit triplet of clipped first-order statistics, a byte of 4-bit-group statistics, the
fp16 second-order pairs shared by ``g2`` rows, the outlier words), ``x`` from cache, ``N``
outputs.

Each word of the layout covers column groups the stored group order scatters over K, so a
word's activations are gathered by the column table (``col2``, ``col4``).

**M = 1** (``_gemv1_kernel``, the paper's Algorithm 1 in Triton). Rows run across threads
(``BLOCK_N`` rows per program, several per thread), and each step walks two words of every row
of each segment (A: a triplet of 2-bit groups + half a 4-bit group, B: four 2-bit groups, C:
two 4-bit groups): two 16-byte loads per row (a full sector, each word's lanes in one
thread), split into its eight 32-bit lanes. The activations of a word's groups are the same
for every row, so they are loaded once for all of a thread's rows (16-byte vectors when K is a
multiple of 16), and a code costs a mask in place and an FMA into the row's unscaled group sum
(the masked code is a subnormal float, :func:`_group_sum`); the group's scale and zero are
applied once,
``acc += s * (Σ code x - z Σ x)``. The scale is the second-order dequantization ``s = (c - z2)
* s2`` of the group's 4-bit code (clipped codes decoded from 3 bits) and fp16 pair.

* **Asynchronous** (``ASYNC=True``): software-pipelined by hand. The words *and* first-order
  statistics of step ``i + 1`` are loaded at the top of step ``i``, before step ``i``'s scales
  are dequantized and its codes decoded, so the second-order dequantization of a group's
  scales runs while the next weights are in flight (the overlap of Algorithm 1's lines 12-15).
* **Synchronous** (``ASYNC=False``): each step loads its words, decodes them into the unscaled
  group sums and only then, after a ``tl.debug_barrier`` (nothing is scheduled across it),
  loads the statistics and dequantizes the scales: the dataflow the paper measures against.

Both compute the same sums in the same order, so their outputs are identical bit for bit; only
the schedule differs.

**2 <= M <= 16** (``_gemm16_kernel``): rows and ``T`` words per tile as a 2-D block; the
decoded weights ``(code - z) * s`` (scales dequantized first) go through ``tl.dot`` with the
tile's gathered activations, ``T`` groups deep, so decoding is paid once for all M rows. Its
``ASYNC`` flag prefetches the next tile's words and statistics likewise; synchronous, the
statistics load after a barrier behind the words.

Outliers (``FUSE_OUTLIERS``): the first split of each row block walks its rows' CSR words
(up to ``MAX_ROW_NNZ``, the longest row rounded up to a power of two, a few words of each row
an iteration) and adds ``value * x[col]``; unfused, a separate Triton SpMV over the same CSR
adds them afterwards.

Split-K as in :mod:`lowbit.kernels.int_gemv`: fp32 partials ``[SPLIT_K, M, N]`` summed by
the tile's last program (:mod:`lowbit.kernels.split_k`, deterministic); launch configurations
are timed per shape on a GPU (never under the interpreter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.kernels.mixed_layout import mixed_reference
from lowbit.kernels.split_k import split_buffers, store_output
from lowbit.kernels.triton_support import (
    cached_config,
    device_limits,
    resident_programs,
    split_for,
    tuned_config,
)

__all__ = ["mixed_gemv", "outlier_spmv", "MAX_ROWS"]

MAX_ROWS = 16
INTERPRET = bool(triton.knobs.runtime.interpret)
TUNE = os.environ.get("LOWBIT_TRITON_TUNE", "1") != "0"


# ----------------------------------------------------------------------------- shared helpers


@triton.jit
def _codes(lane, shift: tl.constexpr, mask: tl.constexpr):
    """fp32 codes of one slot of a uint32 lane block (exact)."""
    bits = ((lane >> shift) & mask) | 0x4B000000  # float bits of 2**23 + code
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _triplet_stats(word, pos):
    """Zero and 4-bit-grid scale code at triplet position ``pos`` of 16-bit words (int32)."""
    zero = ((word >> (2 * pos)) & 3).to(tl.float32)
    full = (word >> 6) & 15
    clipped = ((word >> (7 + 3 * pos)) & 7) * 2 + 1  # positions 1, 2: bits 10-12, 13-15
    return zero, tl.where(pos == 0, full, clipped)


@triton.jit
def _second(second_ptr, rows, stride_r, slot, mask, HALVES: tl.constexpr = False):
    """The fp16 ``(s2, z2)`` pair of ``slot`` for each row's second-order group, as fp32: one
    aligned 32-bit load per pair (the zero's 16-bit slot is what makes the pair a word).
    ``HALVES`` (compiled only): the word's halves named apart by inline PTX (no shift, no mask)."""
    pair = tl.load(second_ptr + rows * stride_r + slot, mask=mask, other=0)  # int32
    if HALVES:
        s2, z2 = tl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair], dtype=(tl.float16, tl.float16),
            is_pure=True, pack=1,
        )  # fmt: skip
        return s2.to(tl.float32), z2.to(tl.float32)
    pair = pair.to(tl.uint32, bitcast=True)
    s2 = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    z2 = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return s2, z2


@triton.jit
def _add_outliers(out, x_ptr, row_ptr_ptr, col_val_ptr, offs_n, mask_n, offs_m, mask_m,
                  stride_xm, MAX_ROW_NNZ: tl.constexpr):  # fmt: skip
    """``out [BLOCK_N, BLOCK_M] += value * x[:, col]`` over the rows' CSR words (column in the
    high 16 bits, fp16 value in the low 16), ``CHUNK`` words of each row an iteration: their
    loads, and the activations' that depend on them, are issued together (one word an
    iteration waited for two round trips per outlier in series)."""
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    CHUNK: tl.constexpr = max(1, min(MAX_ROW_NNZ, 4 // BLOCK_M))  # [BLOCK_N, CHUNK, BLOCK_M]
    offs_e = tl.arange(0, CHUNK)
    start = tl.load(row_ptr_ptr + offs_n, mask=mask_n, other=0)
    end = tl.load(row_ptr_ptr + offs_n + 1, mask=mask_n, other=0)
    for e in range(0, MAX_ROW_NNZ, CHUNK):
        idx = start[:, None] + e + offs_e[None, :]  # [BLOCK_N, CHUNK]
        valid = mask_n[:, None] & (idx < end[:, None])
        word = tl.load(col_val_ptr + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
        col = (word >> 16).to(tl.int32)
        value = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x = tl.load(
            x_ptr + offs_m[None, None, :] * stride_xm + col[:, :, None],
            mask=valid[:, :, None] & mask_m[None, None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, CHUNK, BLOCK_M]
        out += tl.sum(value[:, :, None] * x, axis=1)
    return out


# ----------------------------------------------------------------------------- M = 1


@triton.jit
def _split4(word, BLOCK_N: tl.constexpr):
    """``[BLOCK_N, 4]`` int32 (a 128-bit word per row, in one thread) -> its four uint32 lanes."""
    w = tl.reshape(word.to(tl.uint32, bitcast=True), (BLOCK_N, 2, 2))  # (lane // 2, lane % 2)
    even, odd = tl.split(w)  # lanes 0, 2 / 1, 3: [BLOCK_N, 2]
    l0, l2 = tl.split(even)
    l1, l3 = tl.split(odd)
    return l0, l1, l2, l3


@triton.jit
def _split8(words, BLOCK_N: tl.constexpr):
    """``[BLOCK_N, 4, 2]`` int32 (two 128-bit words per row, :func:`_load_word_pair`) -> the eight
    uint32 lanes, word 0's lanes 0-3 then word 1's."""
    w0, w1 = tl.split(words)
    a0, a1, a2, a3 = _split4(w0, BLOCK_N)
    b0, b1, b2, b3 = _split4(w1, BLOCK_N)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _load_word_pair(ptr, rows, stride, first, count):
    """Words ``first`` and ``first + 1`` of each row (those below ``count``) as one
    ``[BLOCK_N, 4, 2]`` block (lane, word): two 16-byte loads per row, each word's lanes in one
    thread (an ``[BLOCK_N, 8]`` load spread the lanes over threads, and the split moved them
    back with shuffles). ``rows`` are valid rows (clamped: no row mask)."""
    offs = tl.arange(0, 4)
    row = ptr + rows[:, None] * stride + offs[None, :]  # [BLOCK_N, 4]
    w0 = tl.load(row + first * 4, mask=((offs * 0 + first) < count)[None, :], other=0)
    w1 = tl.load(row + first * 4 + 4, mask=((offs * 0 + first + 1) < count)[None, :], other=0)
    return tl.join(w0, w1)


@triton.jit
def _load_pair(ptr, rows, stride, first, count, WIDTH: tl.constexpr):
    """Entries ``first * WIDTH + [0, 2 WIDTH)`` of each of ``rows`` (valid rows; ``WIDTH`` per
    word, words below ``count``) as one ``[BLOCK_N, 2 WIDTH]`` block."""
    offs = tl.arange(0, 2 * WIDTH)
    valid = (first + offs // WIDTH) < count
    ptrs = ptr + rows[:, None] * stride + (first * WIDTH + offs)[None, :]
    return tl.load(ptrs, mask=valid[None, :], other=0)


@triton.constexpr_function
def load_x8_asm(bf16: bool) -> str:
    """The PTX of :func:`_load_x8`: one 16-byte load from ``$8``, then ``$0..$7`` the eight
    activations in order, fp16 as the 16-bit halves of the four words (``=h``), bf16 widened to
    fp32 bits (``=r``): the low half shifted up, the high half masked in place."""
    if bf16:
        halves = [f"shl.b32 ${2 * i}, {r}, 16; and.b32 ${2 * i + 1}, {r}, 0xFFFF0000;"
                  for i, r in enumerate("abcd")]  # fmt: skip
    else:
        halves = [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, {r};" for i, r in enumerate("abcd")]
    return (
        "{ .reg .b32 a, b, c, d; ld.global.nc.v4.b32 {a, b, c, d}, [$8]; " + " ".join(halves) + " }"
    )


@triton.jit
def _load_x8(ptr):
    """Eight 16-bit activations at ``ptr`` (16-byte aligned) as eight scalars: one vector load
    by inline PTX (a ``tl.load`` of a vector spreads it over threads). fp16: each register's
    halves named apart (no shift to reach the high one; widened by the caller, one instruction
    each); bf16: widened to fp32 here, bf16 being fp32's upper half, by one shift (the low
    half) or one mask (the high half) each, where a conversion of a named half takes two."""
    if ptr.dtype.element_ty == tl.bfloat16:
        xs = tl.inline_asm_elementwise(
            load_x8_asm(True), "=r,=r,=r,=r,=r,=r,=r,=r,l", [ptr], dtype=(tl.float32,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        xs = tl.inline_asm_elementwise(
            load_x8_asm(False), "=h,=h,=h,=h,=h,=h,=h,=h,l", [ptr],
            dtype=(ptr.dtype.element_ty,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    return xs


@triton.jit
def _group_sum(lane, x_ptr, col, K, BITS: tl.constexpr, OFFSET: tl.constexpr,
               EVEN_K: tl.constexpr, SUB_X: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``(Σ_j code_j x[col + OFFSET + j], Σ_j x[...])`` over the lane's ``32 // BITS`` codes:
    ``[BLOCK_N]`` unscaled sums and a scalar (the activations are the same for every row).

    A code is masked in place, not shifted down: ``lane & (mask << s)`` read as a float is the
    subnormal ``code * 2**(s - 149)`` (exact while the code sits below bit 23, so the lane's upper
    half is shifted down once), and times ``x * 2**(SUB_X - s)`` (exact) it is the normal
    ``code * x * 2**(SUB_X - 149)``: one LOP3 and one FFMA per code. ``SUB_X`` is 100 for fp16 x
    (any fp16 is below 2**16) and 64 for bf16 (fp32's range: it overflows from 2**64 only);
    both sums come back scaled by ``2**(SUB_X - 149)`` (exact while they stay normal floats:
    true sums above 2**-77 for fp16, 2**-41 for bf16), which the caller undoes once. With
    ``EVEN_K`` (K a multiple of 16, x 16-byte aligned) the activation loads are unmasked: every
    column a group names is below K (padding slots name column 0 and hold zero codes), and
    compiled they are 16-byte vectors (group columns are multiples of 16), one per eight codes
    instead of a scalar load per code.
    """
    PER: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PER // 2
    upper = lane >> 16
    part = tl.zeros(lane.shape, dtype=tl.float32)
    xs = 0.0
    x_col = x_ptr + col  # one address; each code's x at a constant offset from it
    if EVEN_K and not INTERPRET:
        xv0 = _load_x8(x_col + OFFSET)  # x[col + OFFSET + 0..7]
        if PER > 8:
            xv1 = _load_x8(x_col + OFFSET + 8)
    for j in tl.static_range(PER):
        c = col + OFFSET + j
        if EVEN_K and not INTERPRET:
            if j < 8:
                x = xv0[j].to(tl.float32)
            else:
                x = xv1[j - 8].to(tl.float32)
        elif EVEN_K:
            x = tl.load(x_col + (OFFSET + j)).to(tl.float32)  # scalar
        else:
            x = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        xs += x
        if j < HALF:
            bits = lane & (((1 << BITS) - 1) << ((j % HALF) * BITS))
        else:
            bits = upper & (((1 << BITS) - 1) << ((j % HALF) * BITS))
        # code * 2**(s - 149) times x * 2**(SUB_X - s), exact
        part += bits.to(tl.float32, bitcast=True) * (x * (1.0 * (1 << (SUB_X - (j % HALF) * BITS))))
    xs = xs * (1.0 / (1 << (149 - SUB_X)))  # the sums' common scale, exact
    return part, xs


@triton.jit
def _columns_a(col2_ptr, col4_ptr, u0, count, PAD):
    """The first columns of segment A's words ``u0`` and ``u0 + 1`` (those below ``count``;
    ``PAD`` for the others): each word's three 2-bit groups' and its 4-bit group's, as an
    8-tuple of scalars. Loaded a step ahead with the words (ASYNC): loaded in the step, each
    column's load and then its activations' were two round trips in series."""
    cols = ()
    for h in tl.static_range(2):
        live = u0 + h < count
        for g in tl.static_range(3):
            cols = cols + (tl.load(col2_ptr + 3 * (u0 + h) + g, mask=live, other=PAD),)
        cols = cols + (tl.load(col4_ptr + u0 + h, mask=live, other=PAD),)
    return cols


@triton.jit
def _gemv1_kernel(
    x_ptr, primary_ptr, secondary_ptr, stats2_ptr, stats4_ptr, second2_ptr, second4_ptr,
    col2_ptr, col4_ptr, row_ptr_ptr, col_val_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    N, K,
    stride_pn, stride_sn, stride_t2, stride_t4, stride_r2, stride_r4, stride_ps,
    UA: tl.constexpr, UB: tl.constexpr, UC: tl.constexpr,
    STEPS_A: tl.constexpr, STEPS_B: tl.constexpr, STEPS_C: tl.constexpr,
    G2: tl.constexpr, BLOCK_N: tl.constexpr,
    ASYNC: tl.constexpr, FUSE_OUTLIERS: tl.constexpr, MAX_ROW_NNZ: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    # rows past N read row N - 1 (unmasked loads; their outputs are never stored)
    offs_row = tl.minimum(offs_n, N - 1)
    rows = offs_row // G2  # second-order group of each row
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # codes as subnormal floats, sums scaled by 2**(SUB_X - 149) (_group_sum)
    SUB_X: tl.constexpr = 100 if x_ptr.dtype.element_ty == tl.float16 else 64
    if EVEN_K:  # the column a dead word's activation loads name
        PAD = K * 0
    else:
        PAD = K

    # ---- segment A: word = a triplet of 2-bit groups + codes 0-7 of a 4-bit group, whose codes
    # 8-15 are the word's lane in the second matrix
    first = pid_k * STEPS_A * 2  # first word of this split
    nxt_w = _load_word_pair(primary_ptr, offs_row, stride_pn, first, UA)
    nxt_s = _load_pair(secondary_ptr, offs_row, stride_sn, first, UA, 1)
    nxt_t2 = _load_pair(stats2_ptr, offs_row, stride_t2, first, UA, 1)
    nxt_t4 = _load_pair(stats4_ptr, offs_row, stride_t4, first, UA, 1)
    nxt_cols = _columns_a(col2_ptr, col4_ptr, first, UA, PAD)
    for step in range(STEPS_A):
        u0 = first + 2 * step
        if ASYNC:  # this step's loads were issued one step ago; issue the next step's now
            words, sec, t2, t4, cols = nxt_w, nxt_s, nxt_t2, nxt_t4, nxt_cols
            more = UA * (step + 1 < STEPS_A)  # the next step is still this split's
            nxt_w = _load_word_pair(primary_ptr, offs_row, stride_pn, u0 + 2, more)
            nxt_s = _load_pair(secondary_ptr, offs_row, stride_sn, u0 + 2, more, 1)
            nxt_t2 = _load_pair(stats2_ptr, offs_row, stride_t2, u0 + 2, more, 1)
            nxt_t4 = _load_pair(stats4_ptr, offs_row, stride_t4, u0 + 2, more, 1)
            nxt_cols = _columns_a(col2_ptr, col4_ptr, u0 + 2, more, PAD)
        else:
            words = _load_word_pair(primary_ptr, offs_row, stride_pn, u0, UA)
            sec = _load_pair(secondary_ptr, offs_row, stride_sn, u0, UA, 1)
            cols = _columns_a(col2_ptr, col4_ptr, u0, UA, PAD)
        a0, a1, a2, a3, b0, b1, b2, b3 = _split8(words, BLOCK_N)
        sec_a, sec_b = tl.split(sec.to(tl.uint32, bitcast=True))
        for h in tl.static_range(2):
            u = u0 + h
            if h == 0:
                la, lb, lc, l4, ls = a0, a1, a2, a3, sec_a
            else:
                la, lb, lc, l4, ls = b0, b1, b2, b3, sec_b
            col_a, col_b, col_c, col_4 = (
                cols[4 * h],
                cols[4 * h + 1],
                cols[4 * h + 2],
                cols[4 * h + 3],
            )
            pa, xa = _group_sum(la, x_ptr, col_a, K, 2, 0, EVEN_K, SUB_X, INTERPRET)
            pb, xb = _group_sum(lb, x_ptr, col_b, K, 2, 0, EVEN_K, SUB_X, INTERPRET)
            pc, xc = _group_sum(lc, x_ptr, col_c, K, 2, 0, EVEN_K, SUB_X, INTERPRET)
            p4, x4 = _group_sum(l4, x_ptr, col_4, K, 4, 0, EVEN_K, SUB_X, INTERPRET)
            q4, y4 = _group_sum(ls, x_ptr, col_4, K, 4, 8, EVEN_K, SUB_X, INTERPRET)
            if h == 0:
                if not ASYNC:  # the statistics only once the weights are consumed
                    tl.debug_barrier()
                    t2 = _load_pair(stats2_ptr, offs_row, stride_t2, u0, UA, 1)
                    t4 = _load_pair(stats4_ptr, offs_row, stride_t4, u0, UA, 1)
                t2a, t2b = tl.split(t2.to(tl.int32) & 0xFFFF)
                t4a, t4b = tl.split(t4.to(tl.int32))
            if h == 0:
                word2, byte4 = t2a, t4a
            else:
                word2, byte4 = t2b, t4b
            m_u = (offs_n * 0 + u) < UA  # block-shaped (interpreter: bool & scalar)
            for lane in tl.static_range(3):
                zero, code = _triplet_stats(word2, lane)
                s2, z2 = _second(second2_ptr, rows, stride_r2, 3 * u + lane, m_u, not INTERPRET)
                scale = (code.to(tl.float32) - z2) * s2  # the 2nd-order dequantization
                if lane == 0:
                    acc += scale * (pa - zero * xa)
                elif lane == 1:
                    acc += scale * (pb - zero * xb)
                else:
                    acc += scale * (pc - zero * xc)
            s2, z2 = _second(second4_ptr, rows, stride_r4, u, m_u, not INTERPRET)
            scale = ((byte4 >> 4).to(tl.float32) - z2) * s2
            acc += scale * (p4 + q4 - (byte4 & 15).to(tl.float32) * (x4 + y4))

    # ---- segment B: four 2-bit groups per word (2-bit slots 3 UA + 4 w + lane)
    first_b = pid_k * STEPS_B * 2
    for step in range(STEPS_B):
        w0 = first_b + 2 * step
        words = _load_word_pair(primary_ptr, offs_row, stride_pn, UA + w0, UA + UB)
        lanes = _split8(words, BLOCK_N)
        for q in tl.static_range(8):
            w = w0 + q // 4
            p = 3 * UA + 4 * w + q % 4  # the lane's 2-bit slot
            live = w < UB
            col = tl.load(col2_ptr + p, mask=live, other=PAD)
            part, xs = _group_sum(lanes[q], x_ptr, col, K, 2, 0, EVEN_K, SUB_X, INTERPRET)
            if not ASYNC:
                tl.debug_barrier()
            m_u = (offs_n * 0 + w) < UB
            word = tl.load(stats2_ptr + offs_row * stride_t2 + p // 3, mask=m_u, other=0)
            zero, code = _triplet_stats(word.to(tl.int32) & 0xFFFF, p % 3)
            s2, z2 = _second(second2_ptr, rows, stride_r2, p, m_u, not INTERPRET)
            acc += (code.to(tl.float32) - z2) * s2 * (part - zero * xs)

    # ---- segment C: two 4-bit groups per word (4-bit slots UA + 2 v + half)
    first_c = pid_k * STEPS_C * 2
    for step in range(STEPS_C):
        v0 = first_c + 2 * step
        words = _load_word_pair(primary_ptr, offs_row, stride_pn, UA + UB + v0, UA + UB + UC)
        lanes = _split8(words, BLOCK_N)
        for q in tl.static_range(4):
            v = v0 + q // 2
            p = UA + 2 * v + q % 2  # the group's 4-bit slot
            live = v < UC
            col = tl.load(col4_ptr + p, mask=live, other=PAD)
            lo, xlo = _group_sum(lanes[2 * q], x_ptr, col, K, 4, 0, EVEN_K, SUB_X, INTERPRET)
            hi, xhi = _group_sum(lanes[2 * q + 1], x_ptr, col, K, 4, 8, EVEN_K, SUB_X, INTERPRET)
            if not ASYNC:
                tl.debug_barrier()
            m_u = (offs_n * 0 + v) < UC
            byte = tl.load(stats4_ptr + offs_row * stride_t4 + p, mask=m_u, other=0).to(tl.int32)
            s2, z2 = _second(second4_ptr, rows, stride_r4, p, m_u, not INTERPRET)
            scale = ((byte >> 4).to(tl.float32) - z2) * s2
            acc += scale * (lo + hi - (byte & 15).to(tl.float32) * (xlo + xhi))

    acc = acc * (1.0 * (1 << (149 - SUB_X)))  # the group sums' scale undone (exact)
    out = acc[:, None]  # [BLOCK_N, 1]
    if FUSE_OUTLIERS:  # the first split adds its rows' fp16 outliers
        first_split = (offs_n * 0 + pid_k) == 0  # block-shaped (interpreter: bool & scalar)
        zero_m = tl.arange(0, 1)
        out = _add_outliers(out, x_ptr, row_ptr_ptr, col_val_ptr, offs_n, mask_n & first_split,
                            zero_m, zero_m < 1, 0, MAX_ROW_NNZ)  # fmt: skip
    offs_out = offs_n[:, None]  # [BLOCK_N, 1]
    store_output(out_ptr + offs_out, part_ptr + offs_out, stride_ps, count_ptr, out,
                 mask_n[:, None], bias_ptr, offs_n, mask_n, HAS_BIAS, SPLIT_K,
                 INTERPRET)  # fmt: skip


# ----------------------------------------------------------------------------- 2 <= M <= 16


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
    s2, z2 = _second(second_ptr, rows[:, None], stride_r, slot[None, :], mask)
    return (code.to(tl.float32) - z2) * s2


@triton.jit
def _mma_lane(acc, lane, zero, scale, x_ptr, cols, K, stride_xm, offs_m, mask_m,
              BITS: tl.constexpr, OFFSET: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``acc += ((code - z) * s) @ x`` over the lane's codes, the ``T`` groups of the tile as
    the dot's depth. ``acc [BLOCK_N, BLOCK_M]``. The activations of four codes are loaded
    before the first of their dots: loaded code by code, each waited a round trip of its own
    behind the barriers of the dot before (the operands are staged in shared memory); eight
    at a time spilled the 32-row candidate's registers under Triton 3.6."""
    for j0 in tl.static_range(0, 32 // BITS, 4):
        xs = ()
        for j in tl.static_range(j0, j0 + 4):
            c = cols + OFFSET + j  # [T]
            xs = xs + (
                tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + c[None, :],
                    mask=mask_m[:, None] & (c < K)[None, :],
                    other=0.0,
                ),
            )  # [BLOCK_M, T]
        for j in tl.static_range(j0, j0 + 4):
            x = xs[j - j0]
            w = (_codes(lane, j * BITS, (1 << BITS) - 1) - zero) * scale  # [BLOCK_N, T] fp32
            if INTERPRET:  # the interpreter's low-precision dot is not exact: fp32 operands
                acc = tl.dot(w.to(x.dtype).to(tl.float32), tl.trans(x.to(tl.float32)), acc)
            else:
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    return acc


@triton.jit
def _gemm16_kernel(
    x_ptr, primary_ptr, secondary_ptr, stats2_ptr, stats4_ptr, second2_ptr, second4_ptr,
    col2_ptr, col4_ptr, row_ptr_ptr, col_val_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K,
    stride_xm, stride_pn, stride_sn, stride_t2, stride_t4, stride_r2, stride_r4,
    stride_ps, stride_om,
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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)

    # ---- segment A
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
            tl.debug_barrier()
            t2 = tl.load(stats2_ptr + offs_n[:, None] * stride_t2 + u[None, :], mask=m2, other=0)
            t4 = tl.load(stats4_ptr + offs_n[:, None] * stride_t4 + u[None, :], mask=m2, other=0)
        l0, l1, l2, l3 = _split_words(words, BLOCK_N, T)
        sec = sec.to(tl.uint32, bitcast=True)
        col_a = tl.load(col2_ptr + 3 * u, mask=valid, other=K)
        col_b = tl.load(col2_ptr + 3 * u + 1, mask=valid, other=K)
        col_c = tl.load(col2_ptr + 3 * u + 2, mask=valid, other=K)
        col_4 = tl.load(col4_ptr + u, mask=valid, other=K)
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
        for lane in tl.static_range(4):
            if lane == 0:
                bits = l0
            elif lane == 1:
                bits = l1
            elif lane == 2:
                bits = l2
            else:
                bits = l3
            p = 3 * UA + 4 * w + lane  # [T]
            col = tl.load(col2_ptr + p, mask=valid, other=K)
            if not ASYNC:
                tl.debug_barrier()
            word = tl.load(
                stats2_ptr + offs_n[:, None] * stride_t2 + (p // 3)[None, :], mask=m2, other=0
            )
            zero, code = _triplet_stats(word.to(tl.int32) & 0xFFFF, (p % 3)[None, :])
            scale = _scale(code, second2_ptr, rows, stride_r2, p, m2)
            acc = _mma_lane(
                acc, bits, zero, scale, x_ptr, col, K, stride_xm, offs_m, mask_m, 2, 0, INTERPRET
            )

    # ---- segment C: two 4-bit groups per word (4-bit slots UA + 2 v + half)
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
            if not ASYNC:
                tl.debug_barrier()
            t4 = tl.load(stats4_ptr + offs_n[:, None] * stride_t4 + p[None, :], mask=m2, other=0)
            t4 = t4.to(tl.int32)
            zero = (t4 & 15).to(tl.float32)
            scale = _scale(t4 >> 4, second4_ptr, rows, stride_r4, p, m2)
            acc = _mma_lane(
                acc, lo, zero, scale, x_ptr, col, K, stride_xm, offs_m, mask_m, 4, 0, INTERPRET
            )
            acc = _mma_lane(
                acc, hi, zero, scale, x_ptr, col, K, stride_xm, offs_m, mask_m, 4, 8, INTERPRET
            )

    out = acc  # [BLOCK_N, BLOCK_M]
    if FUSE_OUTLIERS:  # the first split adds its rows' fp16 outliers
        first_split = (offs_n * 0 + pid_k) == 0  # block-shaped (interpreter: bool & scalar)
        out = _add_outliers(out, x_ptr, row_ptr_ptr, col_val_ptr, offs_n, mask_n & first_split,
                            offs_m, mask_m, stride_xm, MAX_ROW_NNZ)  # fmt: skip
    offs_out = offs_m[None, :] * stride_om + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
    mask = mask_n[:, None] & mask_m[None, :]
    store_output(out_ptr + offs_out, part_ptr + offs_out, stride_ps, count_ptr, out, mask,
                 bias_ptr, offs_n, mask_n, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip


# ----------------------------------------------------------------------------- unfused outliers


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


# ----------------------------------------------------------------------------- launch


def _static_operands(ops: dict) -> tuple:
    """The weight's kernel arguments that no call changes (tensors, strides, the outlier loop's
    trip count), computed on the first launch and kept in ``ops``."""
    static = ops.get("launch_static")
    if static is None:
        tensors = (
            ops["primary"], ops["secondary"], ops["stats2"], ops["stats4"], ops["second2"],
            ops["second4"], ops["col2"], ops["col4"], ops["row_ptr"], ops["col_val"],
        )  # fmt: skip
        strides = (
            ops["primary"].stride(0), max(1, ops["secondary"].stride(0)),
            max(1, ops["stats2"].stride(0)), max(1, ops["stats4"].stride(0)),
            ops["second2"].stride(0), ops["second4"].stride(0),
        )  # fmt: skip
        static = ops["launch_static"] = (tensors, strides, _nnz_bound(ops["max_row_nnz"]))
    return static


def _launch(x, ops, bias, config, asynchronous, fuse_outliers, probe=False):
    """One launch (the product ``[M, N]``; unfused outliers add a second), or with ``probe``
    the compiled kernel only."""
    m, k = x.shape
    n = ops["shape"][0]
    seg = ops["segments"]
    block_m, block_n, tile, split_k, num_warps = config
    per_step = 2 if block_m == 1 else tile  # words per loop iteration
    steps = [-(-c // per_step) for c in (seg.ua, seg.ub, seg.uc)]
    split_k = max(1, min(split_k, max(steps)))
    per_split = [-(-t // split_k) for t in steps]
    fuse = fuse_outliers and ops["max_row_nnz"] > 0
    separate = not fuse_outliers and ops["max_row_nnz"] > 0  # a second launch adds them
    grid = (-(-n // block_n), split_k)
    out, partials, counters = split_buffers(
        x, split_k, n, grid[0], torch.float32 if separate else None
    )  # [M, N], [S, M, N], [tiles]
    tensors, strides, nnz_bound = _static_operands(ops)
    common = dict(
        UA=seg.ua, UB=seg.ub, UC=seg.uc, G2=ops["g2"], BLOCK_N=block_n, ASYNC=asynchronous,
        FUSE_OUTLIERS=fuse, MAX_ROW_NNZ=nnz_bound, SPLIT_K=split_k,
        HAS_BIAS=bias is not None, INTERPRET=INTERPRET, num_warps=num_warps, grid=grid,
        warmup=probe,
    )  # fmt: skip
    bias_arg = x if bias is None else bias
    split_stride = partials.numel() // split_k
    if block_m == 1:
        compiled = _gemv1_kernel.run(
            x, *tensors, bias_arg, out, partials, counters, n, k, *strides, split_stride,
            STEPS_A=per_split[0], STEPS_B=per_split[1], STEPS_C=per_split[2],
            EVEN_K=k % 16 == 0 and ops["even_cols"] and x.data_ptr() % 16 == 0, **common,
        )  # fmt: skip
    else:
        compiled = _gemm16_kernel.run(
            x, *tensors, bias_arg, out, partials, counters, m, n, k, x.stride(0), *strides,
            split_stride, out.stride(0),
            TILES_A=per_split[0], TILES_B=per_split[1], TILES_C=per_split[2], T=tile,
            BLOCK_M=block_m, **common,
        )  # fmt: skip
    if probe:
        return compiled
    if separate:  # the comparison path: fp32 product, then the outliers' own launch
        return (out + outlier_spmv(x, ops)).to(x.dtype)
    return out


def _candidates(m: int):
    """Block shapes ``(BLOCK_M, BLOCK_N, T, warps, split divisor)`` timed on a GPU, the default
    first (M = 1: four rows per thread of one warp); SPLIT_K is derived from the compiled
    kernel's occupancy (one wave), divided by the divisor. Every shape compiles for sm_90
    within its limits (tests/kernels/test_kernel_resources.py)."""
    if m == 1:
        yield from ((1, 128, 2, 1, 1), (1, 128, 2, 2, 1), (1, 256, 2, 4, 1), (1, 64, 2, 1, 1))
        yield 1, 128, 2, 1, 4
        return
    yield from ((MAX_ROWS, 64, 16, 4, 1), (MAX_ROWS, 32, 16, 4, 1), (MAX_ROWS, 128, 16, 8, 1))
    yield MAX_ROWS, 64, 16, 4, 4


def _config(x, ops, shape, asynchronous, fuse_outliers):
    """The launch configuration of a block shape, SPLIT_K filling one wave of the device, or
    why the shape cannot launch there."""
    n, words = ops["shape"][0], ops["segments"].words
    block_m, block_n, tile, warps, divisor = shape
    if INTERPRET:  # small blocks, one split: the interpreter runs programs one by one
        return (1, 16, 2, 1, 1) if block_m == 1 else (MAX_ROWS, 16, 16, 1, 4)
    programs = triton.cdiv(n, block_n)
    steps = triton.cdiv(words, 2 if block_m == 1 else tile)
    guess = (block_m, block_n, tile, split_for(programs, steps, 2 * device_limits(x.device).sms),
             warps)  # fmt: skip
    resident = resident_programs(
        lambda: _launch(x, ops, None, guess, asynchronous, fuse_outliers, probe=True), x.device
    )
    if isinstance(resident, str):
        return resident
    return block_m, block_n, tile, max(1, split_for(programs, steps, resident) // divisor), warps


#: |kernel - reference| <= TOL * max|reference| for a tuning candidate
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_TUNED: dict[tuple, tuple[int, int, int, int, int]] = {}


def _choose(x, ops, bias, asynchronous, fuse_outliers, tune):
    shapes = list(_candidates(x.shape[0]))
    if not (tune and TUNE and not INTERPRET):
        shapes = shapes[:1]
    return tuned_config(
        shapes, lambda s: _config(x, ops, s, asynchronous, fuse_outliers),
        lambda c: _launch(x, ops, bias, c, asynchronous, fuse_outliers),
        lambda: mixed_reference(x, ops["weight"], bias), TOL[x.dtype],
        compile_only=lambda c: _launch(x, ops, bias, c, asynchronous, fuse_outliers, probe=True),
    )  # fmt: skip


def mixed_gemv(
    x: Tensor,
    ops: dict,
    bias: Tensor | None = None,
    *,
    asynchronous: bool = True,
    fuse_outliers: bool = True,
    config: tuple[int, int, int, int, int] | None = None,
    tune: bool = True,
    check: bool = True,
) -> Tensor:
    """``x @ Wᵀ + bias`` for M <= 16 with ``W`` from :func:`prepare_mixed`'s operands.

    Args:
        x: ``[M, K]`` fp16/bf16, 1 <= M <= 16.
        ops: :func:`lowbit.kernels.mixed_layout.prepare_mixed` of the weight (on x's device).
        bias: ``[N]`` in x's dtype, or None.
        asynchronous: the software-pipelined schedule (module doc); False: synchronous.
        fuse_outliers: add the outliers inside the kernel; False: a separate SpMV launch.
        config: ``(BLOCK_M, BLOCK_N, T, SPLIT_K, num_warps)`` to force one configuration:
            BLOCK_M 1 (M = 1, ``T`` ignored: two words per step) or 16 (``T`` words per tile,
            a power of two of at least 16, the dot's depth).
        tune: on a GPU, time a few configurations once per shape and keep the fastest.
        check: validate the input and bias (False: the caller did, as the backend does).

    Returns:
        ``[M, N]`` in x's dtype (fp32 accumulation).
    """
    n, k = ops["shape"]
    m = x.shape[0]
    if check:
        _check(x, ops, bias, n, k)
    elif not 1 <= m <= MAX_ROWS:
        raise LowbitError(f"mixed_gemv takes 1 to {MAX_ROWS} rows, not {m}")
    if config is not None and (config[0] not in (1, MAX_ROWS) or config[0] < m):
        raise LowbitError(f"BLOCK_M must be 1 (M = 1) or {MAX_ROWS}, not {config[0]} for M={m}")
    if config is not None and config[0] > 1 and config[2] < 16:
        raise LowbitError("tiles of fewer than 16 words cannot feed tl.dot (BLOCK_M = 16)")
    if not x.is_contiguous():
        x = x.contiguous()
    if config is None:
        key = (m == 1, n, k, ops["segments"], x.dtype, x.device, asynchronous, fuse_outliers)
        config = cached_config(
            _TUNED, key, lambda: _choose(x, ops, bias, asynchronous, fuse_outliers, tune)
        )
    return _launch(x, ops, bias, config, asynchronous, fuse_outliers)


def _check(x: Tensor, ops: dict, bias: Tensor | None, n: int, k: int) -> None:
    """Refuse, in a sentence, an input or bias that does not fit the weight of ``ops``."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float16, torch.bfloat16):
        raise LowbitError(f"x must be [M, {k}] fp16 or bf16, got {tuple(x.shape)} {x.dtype}")
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise LowbitError(f"mixed_gemv takes 1 to {MAX_ROWS} rows, not {m}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise LowbitError(f"bias must be [{n}] {x.dtype}")
    if ops["primary"].device != x.device:
        raise LowbitError(f"the weight is on {ops['primary'].device} and x on {x.device}")
