"""Fused dense-and-sparse SpQR products (Triton) on the packed words of Crnčević's SpQR
inference kernel (master's thesis, 2025), with the torch reference beside them.

``y = x_p @ D'ᵀ + x_p @ S'ᵀ + b`` where ``x_p = x[:, perm]`` (the stored column order),
``D'`` the packed 3-bit words (:mod:`lowbit.formats.spqr`) and ``S'`` the fp16 outliers in CSR
or PTCSR. One pass over the tiles: each program owns ``BLOCK_TR`` tile rows (16 output rows
each) and a range of tile columns; per chunk of ``BLOCK_G`` tiles it loads the ``[BLOCK_TR,
16, BLOCK_G]`` words once, rebuilds each tile's second-order statistics from the 8-bit chunks
(a sum over the tile's 16 rows of the even rows' chunks shifted into place: Crnčević's OR
shuffle), decodes each row's fp16 scale and zero, then the sixteen codes of every word, and
multiplies with the input gathered through ``perm``. Before the output is written, the same
program adds its rows' outliers (a share of them under split-K), so nothing but ``y`` (and
split-K partial sums) goes back to memory.

* ``BLOCK_M == 1`` (GEMV): per code ``q · x`` in fp32, summed per word; the scale and zero
  are applied once per word: ``s · (Σ q x − z · Σ x)``, exact algebra, fp32 rounding. A code is
  masked in place at its bit ``p``, never shifted down: the masked bits read as a float are the
  subnormal ``q · 2**(p − 149)`` (exact), times ``x · 2**(E − p)`` (exact) the normal
  ``q · x · 2**(E − 149)``: one and and one FMA per code; the sums keep that scale and the
  output is scaled back once. ``E`` is 100 for fp16 (every fp16 is below 2**16) and 64 for bf16
  (fp32's range: ``x · 2**64`` overflows only from 2**64); while the sums stay normal floats
  (true sums above 2**-77 and 2**-41) the result is the exponent-trick form's bit for bit,
  ``float(bits | 0x4B000000) − 2**23 = q · 2**p`` times ``x · 2**−p`` (one add more per code;
  ``subnormal=False`` in the launcher, for the tests).
* ``BLOCK_M == 16`` (2 <= M <= 16, the small batch; Crnčević's kernel loops over the rows one
  at a time): per code slot ``i`` of the words, the dequantized weights ``fp16(s · fp16(q −
  z))`` (the reference's weights bit for bit) of a ``[BLOCK_TR · 16, BLOCK_G]`` block go into
  one ``tl.dot`` with the ``[BLOCK_G, 16]`` inputs of the columns ``16 g + i``: decoding is paid
  once for all rows.

Launch configurations (``BLOCK_M``, ``BLOCK_TR``, ``BLOCK_G``, ``SPLIT_K``, warps) are timed on
the GPU's first call per shape among a few candidates and cached (``LOWBIT_TRITON_TUNE=0``: the
default, ``BLOCK_TR`` 8: 4.5 loop instructions per code in ``tools/kernel_sass.py --spqr``
at 64 registers, where ``BLOCK_TR`` 16's 4.0 take 117); never under the interpreter.

Memory traffic at M = 1: 8 bytes per 16 weights (4.0 bits per weight), 4 bytes per outlier plus
the row offsets, the input from cache, ``M · N`` outputs. Split-K: a grid of ``cdiv(N, 16 ·
BLOCK_TR) x SPLIT_K`` (:mod:`lowbit.kernels.split_k`). Outliers are split between the programs
of a row by slot index.

:func:`spqr_reference` (pure torch) is the oracle: the dense part decoded from the words in fp16
arithmetic, then ``x_p @ D'ᵀ`` and the outliers in fp32. :func:`spqr_dequantize_dense` is the
Triton decode of ``D'`` alone (the prefill path: decode, then a dense GEMM).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.sparse import CSRMatrix, PTCSRMatrix
from lowbit.formats.spqr import TILE, SpQRQuantized, unpack_words
from lowbit.kernels.triton_support import (
    cached_config,
    device_limits,
    resident_programs,
    split_for,
    tuned_config,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend explains itself; the reference needs no Triton
    triton = None

__all__ = [
    "spqr_reference",
    "spqr_gemv",
    "spqr_dequantize_dense",
    "sparse_operands",
    "MAX_ROWS",
]

#: largest M the fused kernel takes (tl.dot's narrow side)
MAX_ROWS = 16
_SPARSE_KIND = {None: 0, "csr": 1, "ptcsr": 2}


# ----------------------------------------------------------------------------- reference


def spqr_reference(
    x: Tensor, weight: SpQRQuantized, bias: Tensor | None = None, *, dense_only: bool = False
) -> Tensor:
    """``x @ W'ᵀ + b`` the way the kernels compute it, in fp32, cast to ``x``'s dtype.

    Args:
        x: ``[M, K]`` float input (original column order).
        weight: the SpQR weight (stored order, its ``perm`` gathers ``x``).
        bias: ``[N]`` or None.
        dense_only: leave the outliers out (what they cost is measured against this).

    Returns:
        ``[M, N]`` in ``x``'s dtype. Memory traffic: the words, the outliers and ``x`` once.
    """
    perm = weight.perm_index()
    xp = (x if perm is None else x[:, perm]).float()  # [M, K] stored order
    y = xp @ weight.dense_permuted().float().T  # [M, N]
    if not dense_only:
        y = y + xp @ weight.outliers.to_dense(torch.float32).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- Triton

if triton is not None:
    from lowbit.kernels.split_k import split_buffers, store_output

    INTERPRET = bool(triton.knobs.runtime.interpret)

    @triton.jit
    def _tile_statistics(lo, hi, offs_r):
        """Decoded fp16 scale and zero ``[TR, 16, G]`` of words split into ``lo``/``hi`` int32
        halves ``[TR, 16, G]``; ``offs_r`` ``[1, 16, 1]`` is the row within the tile."""
        chunk = (hi >> 22) & 0xFF  # bits 54-61
        r = offs_r
        even = (r & 1) == 0
        # rows 0-6 (even) hold the bytes of ss | zs << 16, rows 8-14 those of sz | zz << 16
        shift = 8 * ((r >> 1) & 3)
        low_part = tl.where(even & (r < 8), chunk << shift, 0)
        high_part = tl.where(even & (r >= 8), chunk << shift, 0)
        low_word = tl.sum(low_part, axis=1, keep_dims=True)  # [TR, 1, G] ss | zs << 16
        high_word = tl.sum(high_part, axis=1, keep_dims=True)  # sz | zz << 16
        q_ss = (low_word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        q_zs = ((low_word >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        q_sz = (high_word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        q_zz = ((high_word >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        code_s = (lo & 7).to(tl.float32)
        code_z = ((lo >> 3) & 7).to(tl.float32)
        # fp16(q_ss * fp16(c_s - q_sz)): each operation rounded to fp16, as Crnčević's half2
        scale = (q_ss * (code_s - q_sz).to(tl.float16).to(tl.float32)).to(tl.float16)
        zero = q_zs.to(tl.float32) * (code_z - q_zz.to(tl.float32)).to(tl.float16).to(tl.float32)
        return scale, zero.to(tl.float16)

    @triton.jit
    def _code(lo, hi, I: tl.constexpr):
        """Code ``I`` (0-15) of words split into int32 halves: bits ``6 + 3 I`` of the 64."""
        if I < 8:
            c = (lo >> (6 + 3 * I)) & 7
        elif I == 8:
            c = ((lo >> 30) & 3) | ((hi & 1) << 2)
        else:
            c = (hi >> (3 * I - 26)) & 7
        return c

    @triton.jit
    def _code_fp16(lo, hi, I: tl.constexpr):
        """Code ``I`` as an fp16 value, exactly: the bits ``code | 0x6400`` are ``1024 + code``
        (integer ops instead of a slow int-to-float conversion), minus 1024."""
        bits = (_code(lo, hi, I) | 0x6400).to(tl.int16)
        return bits.to(tl.float16, bitcast=True) - 1024.0

    @triton.jit
    def _gather_inputs(x_ptr, perm_ptr, first, K, stride_xm, offs_m, mask_m,
                       HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       INTERPRET: tl.constexpr):  # fmt: skip
        """The inputs of the 16 columns ``first + i`` (``first`` the stored columns of code 0:
        ``[1, 1, G]`` at M = 1, ``[G]`` for the 16-row kernel) as a 16-tuple of ``x[perm[k]]``
        (``[1, 1, G]``) or ``x[m, perm[k]]`` (``[G, BLOCK_M]``), 0 past K; all 16 entries of
        the permutation are loaded before any input. At M = 1 (K whole tiles) the entries come
        by four 16-byte loads: ptxas gave 16 scalar loads one register, and so issued each
        after the input load that needed the one before had its address."""
        srcs = ()
        if HAS_PERM and EVEN_K and BLOCK_M == 1 and not INTERPRET:
            # (held above the inputs' loads by a store that never runs as well, they saved two
            # more round trips a chunk, but Triton 3.9's ptxas then spilled a register)
            for q in tl.static_range(4):
                srcs = srcs + tl.inline_asm_elementwise(
                    "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                    [perm_ptr + first + 4 * q], dtype=(tl.int32,) * 4, is_pure=True, pack=1,
                )  # fmt: skip
        else:
            for i in tl.static_range(16):
                k = first + i
                if HAS_PERM and EVEN_K:
                    srcs = srcs + (tl.load(perm_ptr + k),)
                elif HAS_PERM:
                    srcs = srcs + (tl.load(perm_ptr + k, mask=k < K, other=0),)
                else:
                    srcs = srcs + (k,)
        xs = ()
        for i in tl.static_range(16):
            k_ok = first + i < K
            if BLOCK_M == 1:  # [1, 1, G]
                if EVEN_K:  # no padded columns (and every chunk whole): no masks
                    xs = xs + (tl.load(x_ptr + srcs[i]),)
                else:
                    xs = xs + (tl.load(x_ptr + srcs[i], mask=k_ok, other=0.0),)
            else:  # [G, BLOCK_M]
                ptrs = x_ptr + offs_m[None, :] * stride_xm + srcs[i][:, None]
                if EVEN_K:  # every column real: only the rows are masked
                    xs = xs + (tl.load(ptrs, mask=mask_m[None, :], other=0.0),)
                else:
                    xs = xs + (tl.load(ptrs, mask=k_ok[:, None] & mask_m[None, :], other=0.0),)
        return xs

    @triton.jit
    def _spqr_gemv_kernel(
        x_ptr, words_ptr, perm_ptr, sp_ptr_ptr, sp_val_ptr, bias_ptr, out_ptr, part_ptr,
        count_ptr,
        M, N, K,
        stride_xm, stride_wt, stride_ps, stride_om,
        N_TILES_G: tl.constexpr, SPLIT_K: tl.constexpr, CHUNKS_PER_SPLIT: tl.constexpr,
        HAS_PERM: tl.constexpr, SPARSE: tl.constexpr, HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_TR: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
        SUBNORMAL: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        MAGIC: tl.constexpr = 0x4B000000  # float bits of 2**23: (code | MAGIC) = 2**23 + code
        # SUBNORMAL: x is scaled by 2**(SUB_X - p), the sums by 2**(SUB_X - 149) (module doc)
        SUB_X: tl.constexpr = 100 if x_ptr.dtype.element_ty == tl.float16 else 64
        BLOCK_N: tl.constexpr = BLOCK_TR * 16
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_tr = pid_n * BLOCK_TR + tl.arange(0, BLOCK_TR)  # [TR]
        offs_r = tl.arange(0, 16)  # [16]
        offs_g = tl.arange(0, BLOCK_G)  # [G]
        offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        mask_m = offs_m < M
        r3 = offs_r[None, :, None]  # [1, 16, 1]
        offs_j = tl.arange(0, BLOCK_G * 16)  # [G * 16] a chunk's words of a tile row, g * 16 + r
        # whole tiles are loaded (padding rows too): every row's chunk is needed
        tile_ok = offs_tr[:, None] < tl.cdiv(N, 16)  # [TR, 1]
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_TR, 16, BLOCK_G), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in range(CHUNKS_PER_SPLIT):
            g_first = (pid_k * CHUNKS_PER_SPLIT + it) * BLOCK_G  # the chunk's first tile column
            g = g_first + offs_g  # [G] tile columns
            g3 = g[None, None, :]
            # each tile row's chunk is one contiguous run of words, loaded as such ([TR, G * 16]:
            # one contiguous dimension, so every Triton version lays the load out alike, a
            # thread's words in one tile column) and viewed as [TR, 16, G] (no data moves)
            j = g_first * 16 + offs_j  # [G * 16]
            w_ptrs = words_ptr + offs_tr[:, None] * stride_wt + j[None, :]  # [TR, G * 16]
            if EVEN_K:
                words = tl.load(w_ptrs, mask=tile_ok, other=0)  # int64
            else:
                words = tl.load(w_ptrs, mask=tile_ok & (j < N_TILES_G * 16)[None, :], other=0)
            words = tl.permute(tl.reshape(words, (BLOCK_TR, BLOCK_G, 16)), (0, 2, 1))
            lo = words.to(tl.int32)  # truncation: bits 0-31
            hi = (words >> 32).to(tl.int32)  # bits 32-63 (62-63 are zero)
            scale, zero = _tile_statistics(lo, hi, r3)  # [TR, 16, G] fp16
            # every column's input loaded before any code is decoded, the permutation's
            # entries first: loaded code by code, each of the 16 waited for its round trips in
            # turn (ptxas issues a load where the program has it, and an input's address needs
            # its entry; tools/kernel_sass.py --spqr, its round trips)
            first = g3 * 16 if BLOCK_M == 1 else g * 16  # [1, 1, G] or [G] stored columns
            xs = _gather_inputs(x_ptr, perm_ptr, first, K, stride_xm, offs_m, mask_m, HAS_PERM,
                                EVEN_K, BLOCK_M, INTERPRET)  # fmt: skip
            if BLOCK_M == 1:
                # inputs as [1, 1, G] tensors: loaded in the words' layout, no conversion
                partial = tl.zeros((BLOCK_TR, 16, BLOCK_G), dtype=tl.float32)
                sum_x = tl.zeros((1, 1, BLOCK_G), dtype=tl.float32)
                for i in tl.static_range(16):  # (summed first: every input is needed at once)
                    sum_x += xs[i].to(tl.float32)
                lo_15 = lo >> 15
                for i in tl.static_range(16):
                    xv = xs[i].to(tl.float32)  # [1, 1, G]
                    # code i masked in place at bit p: the float of its bits is code * 2**p
                    # with the exponent trick, the subnormal code * 2**(p - 149) without it;
                    # the input is scaled by up = 2**(SUB_X - p) or down = 2**-p (exact)
                    if i < 5:  # bits 6-20 of lo: 7 << p < 2**23
                        bits = lo & (7 << (6 + 3 * i))
                        up, down = 1.0 * (1 << (SUB_X - 6 - 3 * i)), 1.0 / (1 << (6 + 3 * i))
                    elif i < 8:  # bits 21-29: from lo >> 15
                        bits = lo_15 & (7 << (3 * i - 9))
                        up, down = 1.0 * (1 << (SUB_X + 9 - 3 * i)), 1.0 / (1 << (3 * i - 9))
                    elif i == 8:  # bits 30-32 straddle the halves
                        bits = ((lo >> 30) & 3) | ((hi & 1) << 2)
                        up, down = 1.0 * (1 << SUB_X), 1.0
                    else:  # bits 33-53: hi bits 1-21
                        bits = hi & (7 << (3 * i - 26))
                        up, down = 1.0 * (1 << (SUB_X + 26 - 3 * i)), 1.0 / (1 << (3 * i - 26))
                    if SUBNORMAL:  # code * 2**(p - 149) times x * 2**(SUB_X - p)
                        partial += bits.to(tl.float32, bitcast=True) * (xv * up)
                    else:  # (2**23 + code * 2**p) - 2**23 times x * 2**-p
                        q = (bits | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
                        partial += q * (xv * down)
                if SUBNORMAL:
                    sum_x = sum_x * (1.0 / (1 << (149 - SUB_X)))  # the partial sums' scale
                acc += scale.to(tl.float32) * (partial - zero.to(tl.float32) * sum_x)
            else:
                for i in tl.static_range(16):
                    xv = xs[i]  # [G, BLOCK_M]
                    w = _weight(lo, hi, scale, zero, i)  # [TR, 16, G]
                    w2 = tl.reshape(w, (BLOCK_N, BLOCK_G))
                    if INTERPRET:  # the interpreter's low-precision dot is wrong: exact fp32
                        acc = tl.dot(w2.to(tl.float32), xv.to(tl.float32), acc)
                    else:  # fp16 weights are exact in fp16; for bf16 inputs they are rounded
                        acc = tl.dot(w2.to(xv.dtype), xv, acc)  # [BLOCK_N, BLOCK_M]
        if BLOCK_M == 1:
            if SUBNORMAL:
                acc = acc * (1.0 * (1 << (149 - SUB_X)))  # the sums' scale undone (exact)
            out = tl.reshape(tl.sum(acc, axis=2), (BLOCK_N, 1))  # [BLOCK_N, 1]
        else:
            out = acc  # [BLOCK_N, BLOCK_M]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        mask_n = offs_n < N
        # ---- the outliers of these rows: slots pid_k, pid_k + SPLIT_K, ... of each row,
        # CHUNK of them an iteration (their loads, and the permutation's and the inputs' that
        # depend on them, issued together: one an iteration waited three round trips each)
        CHUNK: tl.constexpr = max(1, 4 // BLOCK_M)
        offs_e = tl.arange(0, CHUNK)[None, :]  # [1, CHUNK]
        if SPARSE == 1:  # CSR: row offsets per row
            start = tl.load(sp_ptr_ptr + offs_n, mask=mask_n, other=0)
            end = tl.load(sp_ptr_ptr + offs_n + 1, mask=mask_n, other=0)
            longest = tl.max(end - start, axis=0)
            for j in range(0, tl.cdiv(tl.cdiv(longest - pid_k, SPLIT_K), CHUNK)):
                slot = start[:, None] + pid_k + (j * CHUNK + offs_e) * SPLIT_K  # [BLOCK_N, CHUNK]
                ok = slot < end[:, None]
                word = tl.load(sp_val_ptr + slot, mask=ok, other=0)
                out += _outlier_product(word, ok, x_ptr, perm_ptr, stride_xm, offs_m, mask_m,
                                        HAS_PERM)  # fmt: skip
        elif SPARSE == 2:  # PTCSR: words of tile row t at tile_ptr[t] + i * 16 + r
            tile = offs_n // 16
            t_start = tl.load(sp_ptr_ptr + tile, mask=mask_n, other=0)
            t_end = tl.load(sp_ptr_ptr + tile + 1, mask=mask_n, other=0)
            width = (t_end - t_start) // 16  # [BLOCK_N]
            longest = tl.max(width, axis=0)
            for j in range(0, tl.cdiv(tl.cdiv(longest - pid_k, SPLIT_K), CHUNK)):
                i = pid_k + (j * CHUNK + offs_e) * SPLIT_K  # [1, CHUNK]
                ok = i < width[:, None]  # [BLOCK_N, CHUNK]
                slot = t_start[:, None] + i * 16 + (offs_n % 16)[:, None]
                word = tl.load(sp_val_ptr + slot, mask=ok, other=0)
                out += _outlier_product(word, ok, x_ptr, perm_ptr, stride_xm, offs_m, mask_m,
                                        HAS_PERM)  # fmt: skip
        offs_out = offs_m[None, :] * stride_om + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
        mask = mask_n[:, None] & mask_m[None, :]
        store_output(out_ptr + offs_out, part_ptr + offs_out, stride_ps, count_ptr, out, mask,
                     bias_ptr, offs_n, mask_n, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip

    @triton.jit
    def _outlier_product(word, ok, x_ptr, perm_ptr, stride_xm, offs_m, mask_m, HAS_PERM):
        """``sum_e value · x[:, perm[col]]`` ``[BLOCK_N, BLOCK_M]`` of col_val words
        ``[BLOCK_N, CHUNK]`` (fp16 value in the high half, column in the low half; padding
        words are 0)."""
        col = word & 0xFFFF
        value = ((word >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        src = tl.load(perm_ptr + col, mask=ok, other=0) if HAS_PERM else col
        ptrs = x_ptr + offs_m[None, None, :] * stride_xm + src[:, :, None]
        xv = tl.load(ptrs, mask=ok[:, :, None] & mask_m[None, None, :], other=0.0)
        return tl.sum(value.to(tl.float32)[:, :, None] * xv.to(tl.float32), axis=1)

    @triton.jit
    def _spqr_dense_kernel(
        words_ptr, out_ptr, N, K, stride_wt, stride_on,
        N_TILES_G: tl.constexpr, BLOCK_TR: tl.constexpr, BLOCK_G: tl.constexpr,
    ):  # fmt: skip
        """``D'`` in fp16, stored column order: out ``[N, K]``. Each thread writes the 16
        weights of each of its words as 32 contiguous bytes (two 16-byte stores), not as 16
        two-byte stores to 16 columns."""
        pid_n = tl.program_id(0)
        pid_g = tl.program_id(1)
        offs_tr = pid_n * BLOCK_TR + tl.arange(0, BLOCK_TR)
        offs_r = tl.arange(0, 16)
        g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
        r3 = offs_r[None, :, None]
        g3 = g[None, None, :]
        w_ptrs = words_ptr + offs_tr[:, None, None] * stride_wt + g3 * 16 + r3
        tile_ok = offs_tr[:, None, None] < tl.cdiv(N, 16)  # whole tiles: every row's chunk
        words = tl.load(w_ptrs, mask=tile_ok & (g3 < N_TILES_G), other=0)
        lo = words.to(tl.int32)
        hi = (words >> 32).to(tl.int32)
        scale, zero = _tile_statistics(lo, hi, r3)
        w = _weights_of_words(lo, hi, scale, zero)  # [TR, 16, G, 16]: row, tile column, i
        rows4 = (offs_tr[:, None] * 16 + offs_r[None, :])[:, :, None, None]  # [TR, 16, 1, 1]
        k4 = (g[:, None] * 16 + offs_r[None, :])[None, None, :, :]  # [1, 1, G, 16] columns
        tl.store(out_ptr + rows4 * stride_on + k4, w, mask=(rows4 < N) & (k4 < K))

    @triton.jit
    def _weight(lo, hi, scale, zero, I: tl.constexpr):
        """fp16 weight ``fp16(s · fp16(q − z))`` of code ``I`` of each word (the reference's)."""
        return ((_code_fp16(lo, hi, I) - zero).to(tl.float16) * scale).to(tl.float16)

    @triton.jit
    def _weights2(lo, hi, scale, zero, I: tl.constexpr, STEP: tl.constexpr):
        """The ``2 * STEP`` weights from code ``I``: the ``STEP`` from ``I`` and the ``STEP``
        from ``I + STEP`` joined on a new last axis of 2 (in registers), recursively, so the
        axes of 2 are the bits of the offset from ``I``, lowest first."""
        if STEP == 1:
            a = _weight(lo, hi, scale, zero, I)
            b = _weight(lo, hi, scale, zero, I + 1)
        else:
            a = _weights2(lo, hi, scale, zero, I, STEP // 2)
            b = _weights2(lo, hi, scale, zero, I + STEP, STEP // 2)
        return tl.join(a, b)

    @triton.jit
    def _weights_of_words(lo, hi, scale, zero):
        """``[TR, 16, G, 16]`` fp16: the 16 weights of each word of ``[TR, 16, G]`` halves,
        code ``i`` at index ``i`` of the last axis. The joins leave four axes of 2 that are the
        bits of ``i``, lowest first; reversed and merged they are ``i`` (no data moves)."""
        bits = _weights2(lo, hi, scale, zero, 0, 8)  # [TR, 16, G, 2, 2, 2, 2]
        ordered = tl.permute(bits, (0, 1, 2, 6, 5, 4, 3))
        return tl.reshape(ordered, (lo.shape[0], lo.shape[1], lo.shape[2], 16))


def _require_triton() -> None:
    if triton is None:
        raise LowbitError("the SpQR kernels need Triton (pip install 'lowbit[triton]')")


def sparse_operands(outliers: CSRMatrix | PTCSRMatrix | None) -> tuple:
    """``(kind, pointers, words)`` of the outliers as the kernel takes them (``(None, None,
    None)`` without any). Reads ``nnz`` (for PTCSR a device-to-host copy): compute it once,
    when a layer is prepared, and pass the tuple to :func:`spqr_gemv`."""
    if outliers is None or outliers.nnz == 0:
        return None, None, None
    if isinstance(outliers, CSRMatrix):
        return "csr", outliers.row_ptr, outliers.col_val
    return "ptcsr", outliers.tile_ptr, outliers.col_val


def _launch(x, words, perm, sparse, bias, n, config, probe=False, subnormal=True):
    """One launch (the product ``[M, N]``), or with ``probe`` the compiled kernel only.
    ``subnormal=False`` takes the GEMV's exponent-trick code form, for the tests that compare
    the two."""
    m, k = x.shape
    block_m, block_tr, block_g, split_k, num_warps = config
    n_groups = words.shape[1] // TILE
    chunks = -(-n_groups // block_g)
    per_split = -(-chunks // split_k)
    split_k = -(-chunks // per_split)  # no empty splits
    kind, sp_ptr, sp_val = sparse
    grid = (-(-n // (16 * block_tr)), split_k)
    out, partials, counters = split_buffers(x, split_k, n, grid[0])
    compiled = _spqr_gemv_kernel.run(
        x, words, words if perm is None else perm,
        words if sp_ptr is None else sp_ptr, words if sp_val is None else sp_val,
        x if bias is None else bias, out, partials, counters,
        m, n, k,
        x.stride(0), words.stride(0), partials.numel() // split_k, out.stride(0),
        N_TILES_G=n_groups, SPLIT_K=split_k, CHUNKS_PER_SPLIT=per_split,
        HAS_PERM=perm is not None, SPARSE=_SPARSE_KIND[kind], HAS_BIAS=bias is not None,
        EVEN_K=k % TILE == 0 and per_split * split_k * block_g == n_groups,
        BLOCK_TR=block_tr, BLOCK_G=block_g, BLOCK_M=block_m,
        SUBNORMAL=subnormal,
        INTERPRET=INTERPRET, num_warps=num_warps, grid=grid, warmup=probe,
    )  # fmt: skip
    return compiled if probe else out


def check_operands(x: Tensor, words: Tensor, perm: Tensor | None, n: int) -> tuple[int, int]:
    """Shapes, dtypes and devices of a product's operands; returns ``(M, K)``."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise LowbitError(f"the SpQR kernels take [M, K] fp16 or bf16 inputs, not {x.dtype}")
    m, k = x.shape
    tiles, width = words.shape
    if (
        words.dtype != torch.int64
        or tiles != triton.cdiv(n, TILE)
        or width != triton.cdiv(k, TILE) * TILE
    ):
        raise LowbitError(
            f"SpQR words of shape {tuple(words.shape)} ({words.dtype}) do not fit a {n} x {k} "
            "weight"
        )
    if perm is not None and (perm.dtype != torch.int32 or perm.numel() != k):
        raise LowbitError(
            f"the input permutation must be int32 [{k}], not {perm.dtype} {tuple(perm.shape)}"
        )
    if words.device != x.device:
        raise LowbitError(f"the weight is on {words.device} and the input on {x.device}")
    return m, k


def aligned_permutation(perm: Tensor | None) -> Tensor | None:
    """``perm`` itself if contiguous and 16-byte aligned, else such a copy: the GEMV loads its
    entries four at a time (16-byte vector loads)."""
    if perm is None or (perm.stride(0) == 1 and perm.data_ptr() % 16 == 0):
        return perm
    return perm.clone(memory_format=torch.contiguous_format)


def spqr_gemv(
    x: Tensor,
    words: Tensor,
    perm: Tensor | None,
    outliers: CSRMatrix | PTCSRMatrix | None,
    bias: Tensor | None,
    *,
    out_features: int,
    config: tuple[int, int, int, int, int] | None = None,
    check: bool = True,
) -> Tensor:
    """``x @ W'ᵀ + bias`` for M <= 16, fused dense and sparse.

    Args:
        x: ``[M, K]`` fp16/bf16, M <= 16, original column order.
        words: ``[ceil(N / 16), ceil(K / 16) * 16]`` int64 packed words.
        perm: ``[K]`` int32 input permutation (stored column ``j`` reads ``x[:, perm[j]]``) or
            None (:meth:`SpQRQuantized.perm_index` as int32; the containers keep 16 bits);
            with ``check=False`` contiguous and 16-byte aligned (:func:`aligned_permutation`).
        outliers: CSR or PTCSR with Crnčević's ``col_val`` words (stored column order), or
            None, or their :func:`sparse_operands` computed once (no ``nnz`` read per call).
        bias: ``[N]`` in ``x``'s dtype, or None.
        out_features: N.
        config: ``(BLOCK_M, BLOCK_TR, BLOCK_G, SPLIT_K, num_warps)`` to force a launch.
        check: validate the operands (False: the caller built them, as the backend does).

    Returns:
        ``[M, N]`` in ``x``'s dtype (fp32 accumulation).
    """
    if check:
        _require_triton()
        m, _ = check_operands(x, words, perm, out_features)
        perm = aligned_permutation(perm)
    else:
        m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise LowbitError(f"spqr_gemv takes 1 to {MAX_ROWS} rows, not {m}")
    if config is not None and (config[0] not in (1, MAX_ROWS) or config[0] < m):
        raise LowbitError(f"BLOCK_M must be 1 (M = 1) or {MAX_ROWS}, not {config[0]} for M={m}")
    if not x.is_contiguous():
        x = x.contiguous()
    sparse = outliers if isinstance(outliers, tuple) else sparse_operands(outliers)
    args = (x, words, perm, sparse, bias, out_features)
    if config is None:
        key = (m == 1, out_features, x.shape[1], sparse[0], perm is not None, x.dtype, x.device)
        config = cached_config(_TUNED, key, lambda: _choose(args, m, words.shape[1] // TILE))
    return _launch(*args, config)


#: measure launch configurations on a GPU's first call per shape (LOWBIT_TRITON_TUNE=0: no)
TUNE = os.environ.get("LOWBIT_TRITON_TUNE", "1") != "0"
#: |kernel - reference| <= TOL * max|reference| for a tuning candidate (the tests' bounds)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_TUNED: dict[tuple, tuple[int, int, int, int, int]] = {}


def _candidates(m: int):
    """Block shapes ``(BLOCK_M, BLOCK_TR, BLOCK_G, warps, split divisor)`` timed on a GPU, the
    default first (the module docstring says why); SPLIT_K is derived from the compiled
    kernel's occupancy (one wave), divided by the divisor. Every shape compiles for sm_90
    within its limits (tests/kernels/test_kernel_resources.py)."""
    if m == 1:
        yield from ((1, 8, 8, 4, 1), (1, 16, 8, 4, 1), (1, 4, 8, 4, 1), (1, 8, 8, 4, 2))
        yield from ((MAX_ROWS, 8, 16, 4, 1), (MAX_ROWS, 4, 16, 4, 1))
    else:
        yield from ((MAX_ROWS, 8, 16, 4, 1), (MAX_ROWS, 4, 16, 4, 1), (MAX_ROWS, 8, 16, 4, 4))


def _config(args, shape, n_groups: int):
    """The launch configuration of a block shape, SPLIT_K filling one wave of the device, or
    why the shape cannot launch there."""
    x, n = args[0], args[5]
    block_m, block_tr, block_g, warps, divisor = shape
    if INTERPRET:  # small blocks, one split: the interpreter runs programs one by one
        return block_m, 2, (4 if block_m == 1 else 16), 1, 4
    programs = triton.cdiv(n, 16 * block_tr)
    chunks = triton.cdiv(n_groups, block_g)
    guess_split = split_for(programs, chunks, 2 * device_limits(x.device).sms)
    guess = (block_m, block_tr, block_g, guess_split, warps)
    resident = resident_programs(lambda: _launch(*args, guess, probe=True), x.device)
    if isinstance(resident, str):
        return resident
    split = max(1, split_for(programs, chunks, resident) // divisor)
    return block_m, block_tr, block_g, split, warps


def _choose(args, m: int, n_groups: int) -> tuple[int, int, int, int, int]:
    shapes = list(_candidates(m))
    if not (TUNE and not INTERPRET):
        shapes = shapes[:1]
    return tuned_config(
        shapes, lambda s: _config(args, s, n_groups), lambda c: _launch(*args, c),
        lambda: _reference_of(*args), TOL[args[0].dtype],
        compile_only=lambda c: _launch(*args, c, probe=True),
    )  # fmt: skip


def _reference_of(x, words, perm, sparse, bias, n) -> Tensor:
    """The fp32 product the kernel computes, from its operands (the tuning check)."""
    xp = (x if perm is None else x[:, perm.long()]).float()  # [M, K] stored order
    weight = words_dense_reference(words, n, x.shape[1]).float()  # [N, K]
    kind, sp_ptr, sp_val = sparse
    if kind is not None:
        cls = CSRMatrix if kind == "csr" else PTCSRMatrix
        rows, cols, values = cls(sp_ptr, sp_val, (n, x.shape[1]), True)._coo()  # value high
        weight.index_put_((rows, cols), values.float(), accumulate=True)
    out = xp @ weight.T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def spqr_dequantize_dense(
    words: Tensor, out_features: int, in_features: int, *, probe: bool = False
) -> Tensor:
    """``D'`` ``[N, K]`` fp16 in stored column order, decoded by a Triton kernel; with
    ``probe`` the compiled kernel only."""
    _require_triton()
    out = torch.empty(out_features, in_features, dtype=torch.float16, device=words.device)
    block_tr, block_g = 2, 4
    n_groups = words.shape[1] // TILE
    grid = (triton.cdiv(out_features, 16 * block_tr), triton.cdiv(n_groups, block_g))
    compiled = _spqr_dense_kernel.run(
        words, out, out_features, in_features, words.stride(0), out.stride(0),
        N_TILES_G=n_groups, BLOCK_TR=block_tr, BLOCK_G=block_g, grid=grid, warmup=probe,
    )  # fmt: skip
    return compiled if probe else out


def words_dense_reference(words: Tensor, out_features: int, in_features: int) -> Tensor:
    """``D'`` ``[N, K]`` fp16 decoded by torch (the oracle of :func:`spqr_dequantize_dense`)."""
    codes, sc, zc, second = unpack_words(words, out_features, in_features)
    empty = CSRMatrix.from_dense(torch.zeros(out_features, in_features))
    return SpQRQuantized(codes, sc, zc, second, empty, None).dense_permuted()
