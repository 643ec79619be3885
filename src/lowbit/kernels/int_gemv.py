"""Decode-time product with packed integer weights: ``x [M, K] @ Wᵀ`` for M <= 16 (Triton).

The torch reference is :func:`lowbit.kernels.int_layout.tiled_reference` (decode the tiled
layout in fp32, matmul). Memory traffic at M = 1: the kernel reads each weight word once
(``N * K * b / 8`` bytes, ``32 / 30`` of that at 3 bits, plus padding to whole tiles), one
scale (and zero) per group and row, and ``x`` from cache; it writes ``M * N`` outputs. Decoding
is bandwidth-bound only if the ALUs keep up, so the inner loop is kept to a few integer/float
ops per code (see :mod:`lowbit.kernels.int_layout` for the layout and the op budget).

One program owns ``BLOCK_N`` output rows and a range of K tiles. Per tile it loads the
``[BLOCK_N, TILE_WORDS]`` words once, then for each of the ``32 // b`` slots decodes a
``[BLOCK_N, TILE_WORDS]`` block of codes (shift, mask, exponent trick, minus the zero) and:

* ``BLOCK_M == 1`` (GEMV): FMAs it with ``x`` into a ``[BLOCK_N, TILE_WORDS]`` fp32 sum,
  reduced across the tile once at the end (no shuffles inside the loop);
* ``BLOCK_M == 16`` (small batch, 2 <= M <= 16, rows masked; a tuning candidate at M = 1):
  one ``tl.dot`` of the codes ``[BLOCK_N, TILE_WORDS]`` (exact small integers in x's dtype)
  with ``xᵀ [TILE_WORDS, 16]``, the weight as the MMA's tall operand (N fills the 64-row wgmma
  tile; M = 16 is its narrow side), taken from registers. Decoding is paid once for all rows;
  CUDA-core FMAs would cost M per code and saturate the ALUs from M ~ 4. The codes are decoded
  in x's dtype directly (bits ``code | 0x6400`` are fp16 ``1024 + code``, ``code | 0x4300``
  bf16 ``128 + code``). Where two neighbouring slots lie in one group (2, 4 and 8 bits; bf16
  below 8), one dot takes both, interleaved column by column, so that the two halves of each
  register the MMA reads come from one word: a PRMT, a LOP3 and a packed FMA for two codes
  (:func:`_decode_pair`; from sm_90, ``PAIRS``: compiled for sm_80 and sm_89 the pairs'
  operands spill registers at 128 rows). Otherwise (3 bits, 8-bit bf16 through the fp32
  trick, groups of 32 in 32-word tiles, before sm_90) one slot a dot.

Both sum the unscaled ``(code - zero) * x`` of a group and apply the group's scale once when
its last run is done (scale loads and multiplies per group, not per code). At 3 TB/s a 4-bit
GEMV decodes 6e12 codes/s against an H100's ~3.3e13 instructions/s, so every op per code
counts (``tools/kernel_sass.py`` counts them in the compiled loop without a GPU).

The GEMV (M = 1, below 8 bits) spends two instructions per code: the code masked in place,
``w & (mask << s)``, read as a float is the subnormal ``code * 2**(s - 149)`` (exact: below bit
23), and one FFMA with ``x * 2**(E - s)`` (exact) adds the normal ``code * x * 2**(E - 149)``;
the offset (8, or the zero point) is applied per group and row through the group's ``sum x``,
``s * (sum code * x - z * sum x)``, and the output is scaled back by ``2**(149 - E)`` (exact).
``E`` is 100 for fp16 x (any fp16 is below 2**16) and 64 for bf16, whose range is fp32's:
``x * 2**64`` overflows only for ``|x| >= 2**64``, and products are exact down to
``|x| = 2**-53``. Its scales (and zeros) are loaded with inline PTX in the accumulator's row
layout (no shared-memory round trip, no barrier). 8-bit codes take a byte extract and the
``code | 0x4B000000`` trick (a code and its shift do not fit below bit 23).

Split-K: a grid of ``cdiv(N, BLOCK_N) x SPLIT_K`` programs. A 4096-row layer at 128 rows per
program gives 32 programs for 132 SMs, too few bytes in flight; splitting K fills the machine.
Partial sums go to an fp32 buffer (:mod:`lowbit.kernels.split_k`; at M = 1 it is under 2% of
a 4-bit weight's bytes, at M = 16 a quarter, so tuning weighs fewer splits there).

Bytes in flight: with ``STAGES = 1`` each thread issues one tile's word loads, then decodes
them, and nothing loads during the decode. ``STAGES = 2`` takes two tiles a step and loads each
one's words into registers while the other decodes (no shared memory, no barrier; twice the
words' registers, so 8 warps of 128 rows or 4 warps at 2 blocks an SM). ``STAGES > 2``
software-pipelines the tile loop through shared memory (``tl.range(num_stages=STAGES)``): from
sm_90 the Tensor Memory Accelerator copies the next ``STAGES - 1`` tiles' words (a descriptor
per launch, one bulk copy per tile issued by one thread, no register held for words in flight,
so each split's first tiles are all in flight at once), before sm_90 ``cp.async``; a
shared-memory load per word and 3 barriers a tile pay for it, and the activations are loaded by
inline PTX, which the pipeliner leaves alone. Whatever the stages, a tile's loads go out
together so that a thread waits for memory once a tile, not once per load: at M = 1 the scales
(and zeros) of the groups that end in the tile are loaded as it starts, held above its decode by
a store that never runs (:func:`~lowbit.kernels.triton_support.keep_loads_above`); at M = 16
every slot's activations are loaded before the first slot's operands are staged in shared
memory. Which (BLOCK_M, BLOCK_N, SPLIT_K, STAGES) wins is
measured per shape on the GPU by :func:`int_gemv` (the call replayed from a CUDA graph after an L2
flush, :func:`~lowbit.kernels.triton_support.time_call`; cached), never under the interpreter.
Accumulation is fp32 throughout.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from lowbit.errors import LowbitError
from lowbit.kernels.int_layout import check_operands, tiled_reference
from lowbit.kernels.split_k import split_buffers, store_output
from lowbit.kernels.triton_support import (
    cached_config,
    device_limits,
    keep_loads_above,
    resident_programs,
    split_for,
    tuned_config,
)

__all__ = ["int_gemv", "MAX_ROWS"]

#: largest M this kernel takes (tl.dot's narrow side)
MAX_ROWS = 16
INTERPRET = bool(triton.knobs.runtime.interpret)
#: measure launch configurations on a GPU's first call per shape (LOWBIT_TRITON_TUNE=0: no)
TUNE = os.environ.get("LOWBIT_TRITON_TUNE", "1") != "0"


@triton.jit
def _load_x(x_tile, J0: tl.constexpr, offs_w, k_left, EVEN_K: tl.constexpr,
            PAST_END: tl.constexpr, INLINE: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``x_tile[J0 + offs_w]`` as fp32, 0 past K (``k_left`` columns from ``x_tile`` are
    below K). ``EVEN_K``: K is a multiple of the tile's codes, so a tile is wholly below K or
    wholly past it: no mask, or with ``PAST_END`` (the last split runs past the last tile) one
    the whole tile shares. ``x_tile`` is the tile's first column, so each slot's address is a
    constant offset from it, and the mask compares ``offs_w`` with a scalar (32-bit compares).
    ``INLINE``: loaded by inline PTX, which Triton's software pipeliner leaves alone (it routes
    a ``tl.load`` of a pipelined loop through shared memory, with the barriers that takes);
    columns past K read below it (with ``EVEN_K`` the caller's ``x_tile`` is the last tile's
    for a tile past K) and are zeroed (the interpreter loads the same addresses by ``tl.load``)."""
    if INLINE and EVEN_K:  # a tile past K (k_left <= 0) reads the last tile's x, zeroed
        x = _load_rows(x_tile + J0 + offs_w, INTERPRET).to(tl.float32)
        return tl.where(k_left > 0, x, 0.0) if PAST_END else x
    if INLINE:  # columns past K read the last one's x, zeroed
        cols = J0 + offs_w
        x = _load_rows(x_tile + tl.minimum(cols, k_left - 1), INTERPRET).to(tl.float32)
        return tl.where(cols < k_left, x, 0.0)
    if EVEN_K and PAST_END:
        in_k = tl.zeros_like(offs_w) + k_left > 0  # (the interpreter takes no scalar mask)
        return tl.load(x_tile + J0 + offs_w, mask=in_k, other=0.0).to(tl.float32)
    if EVEN_K:
        return tl.load(x_tile + J0 + offs_w).to(tl.float32)
    return tl.load(x_tile + J0 + offs_w, mask=offs_w < k_left - J0, other=0.0).to(tl.float32)


@triton.jit
def _load_rows(ptrs, INTERPRET: tl.constexpr, ORDERED: tl.constexpr = False):
    """``*ptrs`` (every pointer valid) in the layout its consumer gives ``ptrs``. A ``tl.load``
    of a ``[BLOCK_N]`` vector is coalesced to one row per thread, and moving it to the
    accumulator's rows then takes shared memory and two barriers; inline PTX is not coalesced:
    each thread loads its own rows (a global load per row, from L1 for the threads sharing it).
    ``ORDERED``: a coherent load (``ld.global``), which ptxas keeps above a later store
    (:func:`keep_loads_above`); a non-coherent one (``.nc``, read-only data) it moves freely."""
    if INTERPRET:
        return tl.load(ptrs)
    LOAD: tl.constexpr = "ld.global" if ORDERED else "ld.global.nc"
    BITS: tl.constexpr = ptrs.dtype.element_ty.primitive_bitwidth
    if BITS == 8:
        value = tl.inline_asm_elementwise(LOAD + ".u8 $0, [$1];", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    elif BITS == 16:
        value = tl.inline_asm_elementwise(LOAD + ".b16 $0, [$1];", "=h,l", [ptrs],
                                          dtype=ptrs.dtype.element_ty, is_pure=True, pack=1)  # fmt: skip
    else:
        value = tl.inline_asm_elementwise(LOAD + ".b32 $0, [$1];", "=r,l", [ptrs],
                                          dtype=ptrs.dtype.element_ty, is_pure=True, pack=1)  # fmt: skip
    return value.to(ptrs.dtype.element_ty)


@triton.jit
def _group_offsets(scale_rows, zero_rows, group, stride_sg, stride_zg, SYMMETRIC: tl.constexpr,
                   BITS: tl.constexpr, INTERPRET: tl.constexpr, ORDERED: tl.constexpr = False):  # fmt: skip
    """``(scale, offset)`` ``[BLOCK_N]`` fp32 of a group: its scales, and its zeros or the
    symmetric codes' ``2**(BITS - 1)`` (``ORDERED``: see :func:`_load_rows`)."""
    scale = _load_rows(scale_rows + group * stride_sg, INTERPRET, ORDERED).to(tl.float32)
    if SYMMETRIC:
        offset = tl.full(scale.shape, 1 << (BITS - 1), tl.float32)
    else:
        offset = _load_rows(zero_rows + group * stride_zg, INTERPRET, ORDERED).to(tl.float32)
    return scale, offset


@triton.jit
def _flush_offsets(acc, acc_off, acc_group, x_cols, scale, offset, SUB_SHIFT: tl.constexpr):
    """One group of the GEMV (M = 1) that applies offsets per row: ``acc_group`` holds the
    unsigned ``sum code * x * 2**-SUB_SHIFT`` per element (``SUB_SHIFT`` 49 for fp16 x, 85 for
    bf16: the subnormal codes' scale) and ``x_cols`` the group's ``x`` per column; the scale
    ``[BLOCK_N]`` multiplies the elements, the offset (``8`` symmetric, else the zero) goes to
    the per-row ``acc_off`` through the group's scalar ``sum x``:
    ``acc + s * acc_group``, ``acc_off - s * z * sum x * 2**-SUB_SHIFT``."""
    x_sum = tl.sum(tl.sum(x_cols, axis=1), axis=0) * (1.0 / (1 << SUB_SHIFT))  # exact scaling
    acc_off -= scale * (offset * x_sum)
    return acc + acc_group * scale[:, None], acc_off


@triton.jit
def _pair_words(words, BITS: tl.constexpr):
    """A tile's ``words`` (``[BLOCK_N, TILE_WORDS]`` uint32) as ``[BLOCK_N, 2 * TILE_WORDS]``:
    column ``2i`` word ``i``, column ``2i + 1`` word ``i`` shifted right by ``BITS``, so that
    slot ``j + 1``'s code sits in column ``2i + 1`` where slot ``j``'s sits in column ``2i``
    (:func:`_decode_pair`)."""
    pairs = tl.join(words, words >> BITS)  # [BLOCK_N, TILE_WORDS, 2]
    return pairs.reshape(words.shape[0], 2 * words.shape[1])


@triton.constexpr_function
def pair_bias(slot: int, bits: int, bf16: bool) -> float:
    """What :func:`pair_decode_asm` adds to each code before the zero is subtracted: the
    exponent it ORs in, times the scale ``2**-low`` (fp16 ``1024 * 2**-low``, bf16 ``128 *
    2**-low``)."""
    return (128.0 if bf16 else 1024.0) / (1 << slot * bits % 8)


@triton.constexpr_function
def pair_decode_asm(slot: int, bits: int, bf16: bool) -> str:
    """The PTX of :func:`_decode_pair` for slots ``slot`` and ``slot + 1`` (``pack=2``): ``$1``
    and ``$2`` two elements' words, ``$3`` their negated bases (:func:`pair_bias` plus the
    zero) as packed fp16 (bf16), ``$0`` their codes minus their zeros, packed alike.

    A PRMT copies the code's byte of ``$1`` into the low half of a register and that of ``$2``
    into the high half, a LOP3 keeps the code's bits and ORs in an exponent (code ``q`` at bit
    ``low`` of the byte: fp16 ``1024 + q * 2**low``, bf16 ``128 + q * 2**low``, exact as long as
    ``q * 2**low`` stays below the exponent's mantissa range: 1024 and 128) and a packed FMA
    scales by ``2**-low`` and adds the negated base."""
    byte, low = slot * bits // 8, slot * bits % 8  # the code's byte, its bit in the byte
    select = byte | byte << 4 | (4 + byte) << 8 | (4 + byte) << 12  # bytes of t: a a b b
    mask = (((1 << bits) - 1) << low) * 0x10001  # the code's bits in both halves
    if bf16:
        exponent, scale, fma = 0x43004300, ((127 - low) << 7) * 0x10001, "fma.rn.bf16x2"
    else:
        exponent, scale, fma = 0x64006400, ((15 - low) << 10) * 0x10001, "fma.rn.f16x2"
    return (
        f"{{ .reg .b32 t, s; prmt.b32 t, $1, $2, {select:#x}; "
        f"lop3.b32 t, t, {mask:#x}, {exponent:#x}, 0xea; "  # (t & mask) | exponent
        f"mov.b32 s, {scale:#x}; {fma} $0, t, s, $3; }}"
    )


@triton.jit
def _decode_pair(pairs, J: tl.constexpr, offset, BITS: tl.constexpr, BF16: tl.constexpr,
                 INTERPRET: tl.constexpr):  # fmt: skip
    """Slots ``J`` and ``J + 1`` (``J`` even) of a tile whose words are ``pairs``
    (:func:`_pair_words`) as the ``[BLOCK_N, 2 * TILE_WORDS]`` operand of one dot: column
    ``2i + h`` is the code of slot ``J + h`` in word ``i`` minus ``offset`` (``[BLOCK_N]`` fp32,
    the zero plus ``2**23``), in fp16 (bf16 with ``BF16``), exact.

    The MMA takes neighbouring columns of its operand as the two halves of one register, and
    the two codes of a column pair sit in the same byte of their elements of ``pairs``, so
    three instructions decode two codes (:func:`pair_decode_asm`), in place of a shift, a mask,
    a repack and half a subtraction per code. Each element of ``pairs`` holds its own code, so
    the result does not depend on which two elements Triton hands the assembly."""
    BIAS: tl.constexpr = pair_bias(J, BITS, BF16)
    base = offset - (8388608.0 - BIAS)  # [BLOCK_N] fp32: the zero plus the bias
    if INTERPRET:  # the same exact values in fp32
        codes = (pairs >> (J * BITS)) & ((1 << BITS) - 1)
        return codes.to(tl.float32) + BIAS - base[:, None]
    dtype = tl.bfloat16 if BF16 else tl.float16
    return tl.inline_asm_elementwise(
        pair_decode_asm(J, BITS, BF16), "=r,r,r,r", [pairs, (-base).to(dtype)[:, None]],
        dtype=dtype, is_pure=True, pack=2,
    )  # fmt: skip


@triton.jit
def _gemv_tile(words, t, acc, acc_group, x_cols, acc_off, x_ptr, out_ptr, scale_rows, zero_rows,
               offs_w, offs_m, mask_m, M, K, stride_xm, stride_sg, stride_zg, low_mask,
               BITS: tl.constexpr, TILE_WORDS: tl.constexpr, GROUP_SIZE: tl.constexpr,
               SYMMETRIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN_K: tl.constexpr, PAST_END: tl.constexpr, SUBNORMAL: tl.constexpr,
               SHIFT: tl.constexpr, INLINE_X: tl.constexpr, PAIRS: tl.constexpr,
               INTERPRET: tl.constexpr):  # fmt: skip
    """Tile ``t`` of the product: its ``words`` (``[BLOCK_N, TILE_WORDS]`` int32) decoded slot
    by slot into the accumulators (see :func:`_int_gemv_kernel`), the groups that end in it
    flushed; returns ``acc, acc_group, x_cols, acc_off``."""
    PPW: tl.constexpr = 32 // BITS  # codes per word
    HALF: tl.constexpr = PPW // 2  # codes in a word's lower half (at most 16 bits)
    TILE_K: tl.constexpr = PPW * TILE_WORDS  # codes per tile
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    MAGIC: tl.constexpr = 0x4B000000  # float bits of 2**23: (code | MAGIC) as f32 = 2**23 + code
    SUB_X: tl.constexpr = 149 - SHIFT  # SUBNORMAL: x is scaled by 2**(SUB_X - s)
    # groups start only at slots j with j * TILE_WORDS % GROUP_SIZE == 0 (whole groups per tile,
    # or whole tiles per group)
    SAME_GROUP: tl.constexpr = TILE_K % GROUP_SIZE == 0 or GROUP_SIZE % TILE_K == 0

    # M > 1 at 2, 4 and 8 bits (not bf16 at 8) with PAIRS: slots j and j + 1 decoded together
    # into one dot of twice the depth (_decode_pair), where the two lie in one group
    PAIRED: tl.constexpr = (PAIRS and BLOCK_M > 1 and BITS != 3
                            and GROUP_SIZE % (2 * TILE_WORDS) == 0
                            and (x_ptr.dtype.element_ty == tl.float16 or BITS < 8))  # fmt: skip
    STEP: tl.constexpr = 2 if PAIRED else 1  # slots a step
    words = words.to(tl.uint32, bitcast=True)  # logical shifts: no sign extension
    if PAIRED:
        word_pairs = _pair_words(words, BITS)  # [BLOCK_N, 2 * TILE_WORDS]
    upper = words >> (HALF * BITS)  # the upper half's codes below bit 16 (M = 1)
    k_left = K - t * TILE_K  # the tile's columns below K
    if INLINE_X and EVEN_K and PAST_END:  # a tile past K reads the last tile's x (zeroed)
        x_tile = x_ptr + tl.minimum(t * TILE_K, K - TILE_K)
    else:
        x_tile = x_ptr + t * TILE_K  # the tile's first column
    # the scales (and zeros) of the groups that end in this tile (ENDS of them, at slots known
    # at compile time) loaded before any of it is decoded, and at M = 1 kept above the decode
    # with the words and x loaded so far (at M = 16 the barriers keep them): loaded where a
    # group ends, they took a round trip to memory each, in series with the words'
    # (tools/kernel_sass.py, its round trips)
    ENDS: tl.constexpr = (TILE_K // GROUP_SIZE if TILE_K % GROUP_SIZE == 0 else
                          (1 if GROUP_SIZE % TILE_K == 0 else 0))  # fmt: skip
    # (not the pipelined loop's zeros: behind the tile's scales they waited once more)
    PRELOAD: tl.constexpr = (ENDS == 1 or ENDS == 2) and (SYMMETRIC or not INLINE_X)
    if PRELOAD:
        first_end = (t * TILE_K + tl.minimum(GROUP_SIZE, TILE_K) - 1) // GROUP_SIZE
        first_end = tl.minimum(first_end, (K - 1) // GROUP_SIZE)  # (a tile past K: clamped)
        scale_a, offset_a = _group_offsets(scale_rows, zero_rows, first_end, stride_sg,
                                           stride_zg, SYMMETRIC, BITS, INTERPRET, True)  # fmt: skip
        if ENDS == 2:
            second_end = tl.minimum(first_end + 1, (K - 1) // GROUP_SIZE)
            scale_b, offset_b = _group_offsets(scale_rows, zero_rows, second_end, stride_sg,
                                               stride_zg, SYMMETRIC, BITS, INTERPRET, True)  # fmt: skip
        if BLOCK_M == 1:
            keep_loads_above(out_ptr, K)
    if BLOCK_M > 1:
        # every slot's x loaded before any slot is decoded: loaded in its slot, each waited a
        # round trip of its own, since ptxas keeps a load below the barriers of the slot
        # before (the dot's operands staged in shared memory)
        xs = ()
        for j in tl.static_range(PPW):
            offs_k = t * TILE_K + j * TILE_WORDS + offs_w  # [TILE_WORDS]
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            xs = xs + (tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0),)
        if PAIRED:
            # x[:, 2i + h] is slot j + h's column i, as in _decode_pair's operand; joined here,
            # so that each pair's operand gets a shared-memory buffer of its own (joined at its
            # dot, the pairs shared one, and each pair waited at two barriers more)
            x_pairs = ()
            for j in tl.static_range(0, PPW, 2):
                pair = tl.join(xs[j], xs[j + 1])  # [BLOCK_M, TILE_WORDS, 2]
                x_pairs = x_pairs + (pair.reshape(BLOCK_M, 2 * TILE_WORDS),)
            xs = x_pairs  # [BLOCK_M, 2 * TILE_WORDS] each
    for j in tl.static_range(0, PPW, STEP):  # j: the step's first slot
        k0 = t * TILE_K + j * TILE_WORDS  # first code of slot j's run
        offs_k = k0 + offs_w  # [TILE_WORDS]
        group = tl.minimum(k0, K - 1) // GROUP_SIZE  # the step lies in one group
        if SUBNORMAL:  # the offsets come once per group (x_cols, _flush_offsets)
            pass
        elif SYMMETRIC:
            offset = tl.full((BLOCK_N,), 8388608.0 + (1 << (BITS - 1)), tl.float32)
        elif PRELOAD and (j == 0 or (j * TILE_WORDS) % GROUP_SIZE == 0):
            # the slot starts a group, one of those that end in this tile (ENDS == 2: the
            # second from the slot at GROUP_SIZE)
            if ENDS == 2 and j * TILE_WORDS >= GROUP_SIZE:
                offset = offset_b + 8388608.0
            else:
                offset = offset_a + 8388608.0
        elif j == 0 or not SAME_GROUP or (j * TILE_WORDS) % GROUP_SIZE == 0:
            # the slot starts a group (or may): its zeros, kept for the group's next slots
            zero = _load_rows(zero_rows + group * stride_zg, INTERPRET)
            offset = zero.to(tl.float32) + 8388608.0  # [BLOCK_N]
        if SUBNORMAL:
            # the code masked in place is the float bits of the subnormal code * 2**(s - 149)
            # (exact: below bit 23); times x * 2**(SUB_X - s) (exact: see the kernel's SUB_X)
            # it is the normal code * x * 2**-SHIFT: one LOP3 and one FFMA per code; the
            # offset (8 or the zero) is applied per group through sum x
            if j < HALF:
                src = words
            else:
                src = upper
            if j % HALF == 0 and BITS != 3:
                codes = src & low_mask  # [BLOCK_N, TILE_WORDS]
            else:
                codes = src & (CODE_MASK << ((j % HALF) * BITS))
            x = _load_x(x_tile, j * TILE_WORDS, offs_w, k_left, EVEN_K, PAST_END,
                        INLINE_X, INTERPRET)[None, :]  # fmt: skip
            x_cols += x  # [1, TILE_WORDS] (2-D: the layout of the products' x)
            x = x * (1.0 * (1 << (SUB_X - (j % HALF) * BITS)))  # exact
            acc_group += codes.to(tl.float32, bitcast=True) * x
        elif PAIRED:
            q = _decode_pair(word_pairs, j, offset, BITS, x_ptr.dtype.element_ty == tl.bfloat16,
                             INTERPRET)  # fmt: skip
        elif BLOCK_M > 1 and x_ptr.dtype.element_ty == tl.float16:
            # the same trick in fp16, two codes per instruction: bits (code | 0x6400) are
            # 1024 + code, and 1024 + zero is exact in fp16 (integers up to 2048)
            codes16 = (((words >> (j * BITS)) & CODE_MASK) | 0x6400).to(tl.uint16)
            offset16 = (offset - (8388608.0 - 1024.0)).to(tl.float16)  # [BLOCK_N]
            q = codes16.to(tl.float16, bitcast=True) - offset16[:, None]  # exact
        elif BLOCK_M > 1 and BITS < 8:
            # bf16: bits (code | 0x4300) are 128 + code, exact below 8-bit codes (bf16 holds
            # integers up to 256), and so is 128 + zero
            codes16 = (((words >> (j * BITS)) & CODE_MASK) | 0x4300).to(tl.uint16)
            codes16 = codes16.to(tl.bfloat16, bitcast=True)
            if INTERPRET:  # its bf16 arithmetic is wrong: the same exact values in fp32
                q = codes16.to(tl.float32) - (offset - (8388608.0 - 128.0))[:, None]
            else:
                offset16 = (offset - (8388608.0 - 128.0)).to(tl.bfloat16)  # [BLOCK_N]
                q = codes16 - offset16[:, None]  # exact
        else:
            codes = ((words >> (j * BITS)) & CODE_MASK) | MAGIC  # [BLOCK_N, TILE_WORDS]
            q = codes.to(tl.float32, bitcast=True) - offset[:, None]  # code - zero, exact
            if BLOCK_M == 1:  # (zero points: shifted down, fewer registers per row)
                x = _load_x(x_tile, j * TILE_WORDS, offs_w, k_left, EVEN_K, PAST_END,
                            INLINE_X, INTERPRET)  # fmt: skip
                acc_group += q * x[None, :]  # [BLOCK_N, TILE_WORDS]
        if BLOCK_M > 1:
            x = xs[j // STEP]  # [BLOCK_M, STEP * TILE_WORDS]
            if INTERPRET:  # the interpreter's bf16 dot is wrong: exact fp32 operands
                acc_group = tl.dot(q.to(tl.float32), tl.trans(x.to(tl.float32)), acc_group)
            else:  # |code - zero| <= 255: exact in fp16 and bf16
                acc_group = tl.dot(q.to(x.dtype), tl.trans(x), acc_group)  # [BLOCK_N, BLOCK_M]
        if (k0 + STEP * TILE_WORDS) % GROUP_SIZE == 0:  # the group ends here: apply its scale
            if not PRELOAD:
                end_scale, end_offset = _group_offsets(scale_rows, zero_rows, group, stride_sg,
                                                       stride_zg, SYMMETRIC, BITS, INTERPRET)  # fmt: skip
            elif ENDS == 2 and (j + STEP) * TILE_WORDS > GROUP_SIZE:
                end_scale, end_offset = scale_b, offset_b
            else:
                end_scale, end_offset = scale_a, offset_a
            if SUBNORMAL:
                acc, acc_off = _flush_offsets(acc, acc_off, acc_group, x_cols, end_scale,
                                              end_offset, SHIFT)  # fmt: skip
                x_cols = tl.zeros_like(x_cols)
            else:
                acc += acc_group * end_scale[:, None]
            acc_group = tl.zeros_like(acc)
    return acc, acc_group, x_cols, acc_off


@triton.jit
def _int_gemv_kernel(
    x_ptr, words_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sg, stride_zg, stride_ps, stride_om,
    BITS: tl.constexpr, TILE_WORDS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    K_TILES: tl.constexpr, SPLIT_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr,
    TMA: tl.constexpr, PAIRS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    TILE_K: tl.constexpr = (32 // BITS) * TILE_WORDS  # codes per tile
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    # M = 1 below 8 bits: codes as subnormal floats, no magic and no FADD (module doc); the
    # offsets (8 or the zeros) are applied per group and row through the group's sum x, into
    # acc_off (_flush_offsets)
    SUBNORMAL: tl.constexpr = BLOCK_M == 1 and BITS < 8
    PAST_END: tl.constexpr = K_TILES % TILES_PER_SPLIT != 0  # the last split's tiles past K
    # x is scaled by 2**(SUB_X - s), s <= 12 (the code's place in a word's half): fp16 x below
    # 2**16 stays below 2**116; bf16 x below 2**64 (far beyond any model's activations) below
    # 2**128. The sums are 2**(SUB_X - 149) times the true ones: normal floats, exact to fp32's
    # precision, down to true sums of 2**-77 (fp16) or 2**-41 (bf16), below which each loses at
    # most 2**-100 or 2**-64 (tests/kernels/test_triton_int.py: bit for bit from 2**-20 to 2**64)
    SUB_X: tl.constexpr = 100 if x_ptr.dtype.element_ty == tl.float16 else 64
    SHIFT: tl.constexpr = 149 - SUB_X if SUBNORMAL else 0  # the sums' scale, 2**-SHIFT
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    offs_row = tl.minimum(offs_n, N - 1)  # rows past N read row N - 1 (their outputs are masked)
    scale_rows = scale_ptr + offs_row  # [BLOCK_N] (group 0's scales)
    zero_rows = zero_ptr + offs_row
    offs_w = tl.arange(0, TILE_WORDS)  # [TILE_WORDS]
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    mask_m = offs_m < M
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, TILE_WORDS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_group = tl.zeros_like(acc)  # the current group's sum of (code - zero) * x, unscaled
    # SUBNORMAL: acc_group holds the group's sum of code * x, x_cols its x per column; the
    # offsets are applied once per group, s * (sum code * x - z * sum x)
    x_cols = tl.zeros((1, TILE_WORDS), dtype=tl.float32)  # SUBNORMAL: the group's x per column
    acc_off = tl.zeros((BLOCK_N,), dtype=tl.float32)  # SUBNORMAL: the offsets' - s z sum x
    # the lowest code's mask as a value the compiler cannot fold (K >= 1 when a kernel runs):
    # with it constant, upper & CODE_MASK became a bit-field extract of words (SHF + SGXT), not
    # one LOP3 on the shifted words
    low_mask = tl.where(K > 0, CODE_MASK, 0).to(tl.uint32)
    # unmasked word loads: rows past N read row N - 1 and a tile past K_TILES (the last
    # split's) reads the last tile; their products are never stored or are skipped
    if not TMA:  # (with TMA words_ptr is the words' descriptor, blocks [BLOCK_N, TILE_WORDS])
        # [BLOCK_N, TILE_WORDS]
        w_rows = words_ptr + offs_row[:, None] * stride_wn + offs_w[None, :]
    t_first = pid_k * TILES_PER_SPLIT
    # constexpr trip counts: known to the compiler, and the interpreter (numpy >= 2.4) cannot
    # take a runtime scalar as a range bound
    if STAGES == 2:
        # two tiles a step (TILES_PER_SPLIT is even), each one's words loaded while the other
        # decodes. Each decode is its own block (a branch, which also skips the last split's
        # tiles past K), and each load is kept above it (keep_loads_above): ptxas moves a load
        # across neither, so the loads are issued as the step and its second half begin. (A
        # loop-carried prefetch would share the words' registers, and ptxas would issue it once
        # they are dead, at the loop's end.)
        words_a = tl.load(w_rows + tl.minimum(t_first, K_TILES - 1) * TILE_WORDS)
        for i in tl.range(0, TILES_PER_SPLIT, 2):
            t = t_first + i
            words_b = tl.load(w_rows + tl.minimum(t + 1, K_TILES - 1) * TILE_WORDS)
            keep_loads_above(out_ptr, K)
            if t < K_TILES:
                acc, acc_group, x_cols, acc_off = _gemv_tile(
                    words_a, t, acc, acc_group, x_cols, acc_off, x_ptr, out_ptr, scale_rows,
                    zero_rows, offs_w, offs_m, mask_m, M, K, stride_xm, stride_sg, stride_zg,
                    low_mask, BITS, TILE_WORDS, GROUP_SIZE, SYMMETRIC, BLOCK_M, BLOCK_N, EVEN_K,
                    False, SUBNORMAL, SHIFT, False, PAIRS, INTERPRET,
                )  # fmt: skip
            # the split's last step loads nothing (the same mask for every thread; a tensor:
            # the interpreter takes no scalar mask)
            more = tl.zeros((BLOCK_N, TILE_WORDS), tl.int32) + t + 2 < t_first + TILES_PER_SPLIT
            words_a = tl.load(w_rows + tl.minimum(t + 2, K_TILES - 1) * TILE_WORDS, mask=more)
            keep_loads_above(out_ptr, K)
            if t + 1 < K_TILES:
                acc, acc_group, x_cols, acc_off = _gemv_tile(
                    words_b, t + 1, acc, acc_group, x_cols, acc_off, x_ptr, out_ptr, scale_rows,
                    zero_rows, offs_w, offs_m, mask_m, M, K, stride_xm, stride_sg, stride_zg,
                    low_mask, BITS, TILE_WORDS, GROUP_SIZE, SYMMETRIC, BLOCK_M, BLOCK_N,
                    EVEN_K, False, SUBNORMAL, SHIFT, False, PAIRS, INTERPRET,
                )  # fmt: skip
    else:
        # one tile a step; STAGES > 2: Triton's pipeline copies the next STAGES - 1 tiles'
        # words into shared memory (by TMA, else cp.async) while this one decodes, and x is
        # loaded by inline PTX so that it stays out of the pipeline. The last split's tiles
        # past K are computed against x masked to 0 (PAST_END)
        for i in tl.range(TILES_PER_SPLIT, num_stages=STAGES):
            t = t_first + i
            if TMA:
                words = words_ptr.load([pid_n * BLOCK_N, tl.minimum(t, K_TILES - 1) * TILE_WORDS])
            else:
                words = tl.load(w_rows + tl.minimum(t, K_TILES - 1) * TILE_WORDS)
            acc, acc_group, x_cols, acc_off = _gemv_tile(
                words, t, acc, acc_group, x_cols, acc_off, x_ptr, out_ptr, scale_rows, zero_rows,
                offs_w, offs_m, mask_m, M, K, stride_xm, stride_sg, stride_zg, low_mask,
                BITS, TILE_WORDS, GROUP_SIZE, SYMMETRIC, BLOCK_M, BLOCK_N, EVEN_K, PAST_END,
                SUBNORMAL, SHIFT, STAGES > 2, PAIRS, INTERPRET,
            )  # fmt: skip
    # a group cut by this split's end (or a per-channel K that is not a multiple of TILE_WORDS)
    last = tl.minimum((pid_k + 1) * TILES_PER_SPLIT * TILE_K, K) - 1
    scale, offset = _group_offsets(scale_rows, zero_rows, last // GROUP_SIZE, stride_sg,
                                   stride_zg, SYMMETRIC, BITS, INTERPRET)  # fmt: skip
    if SUBNORMAL:
        acc, acc_off = _flush_offsets(acc, acc_off, acc_group, x_cols, scale, offset, SHIFT)
        out = (tl.sum(acc, axis=1) + acc_off) * (1.0 * (1 << SHIFT))  # [BLOCK_N], exact
        out = out[:, None]  # [BLOCK_N, 1]
    else:
        acc += acc_group * scale[:, None]
        if BLOCK_M == 1:
            out = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
        else:
            out = acc  # [BLOCK_N, BLOCK_M]
    offs_out = offs_m[None, :] * stride_om + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
    mask = mask_n[:, None] & mask_m[None, :]
    store_output(out_ptr + offs_out, part_ptr + offs_out, stride_ps, count_ptr, out, mask,
                 bias_ptr, offs_n, mask_n, HAS_BIAS, SPLIT_K, INTERPRET)  # fmt: skip


def tiles_per_split(n_tiles: int, split_k: int, stages: int) -> int:
    """K tiles each of ``split_k`` splits takes (``TILES_PER_SPLIT``): even for ``stages`` 2,
    whose loop takes two tiles a step."""
    per_split = -(-n_tiles // split_k)
    return per_split + per_split % 2 if stages == 2 else per_split


def uses_tma(words: Tensor, config: tuple[int, int, int, int, int], device) -> bool:
    """Whether a launch copies its words into shared memory by TMA: a pipelined tile loop
    (``stages`` > 2) on a device with a TMA (sm_90 on; the interpreter emulates it), words
    16-byte aligned as its descriptors need; else ``cp.async`` copies them."""
    if config[4] <= 2 or not (INTERPRET or device_limits(device).hopper):
        return False
    return words.data_ptr() % 16 == 0 and words.stride(0) % 4 == 0 and words.stride(1) == 1


def _launch(x, words, scale, zero, bias, bits, group_size, tile, config, probe=False):
    """One launch (the product ``[M, N]``), or with ``probe`` the compiled kernel only."""
    m, n, k = x.shape[0], words.shape[0], x.shape[1]
    block_m, block_n, split_k, num_warps, stages = config
    n_tiles = words.shape[1] // tile
    per_split = tiles_per_split(n_tiles, split_k, stages)
    split_k = -(-n_tiles // per_split)  # no empty splits
    grid = (-(-n // block_n), split_k)
    out, partials, counters = split_buffers(x, split_k, n, grid[0])
    tiles = words
    if uses_tma(words, config, x.device):  # the tiles as TMA copies them (rows past N: zeros)
        tiles = TensorDescriptor(words, [n, words.shape[1]], [words.stride(0), 1], [block_n, tile])
    compiled = _int_gemv_kernel.run(
        x, tiles, scale, words if zero is None else zero, x if bias is None else bias, out,
        partials, counters,
        m, n, k,
        x.stride(0), words.stride(0), scale.stride(0), 0 if zero is None else zero.stride(0),
        partials.numel() // split_k, out.stride(0),
        BITS=bits, TILE_WORDS=tile, GROUP_SIZE=group_size or k, SYMMETRIC=zero is None,
        HAS_BIAS=bias is not None, K_TILES=n_tiles, SPLIT_K=split_k, TILES_PER_SPLIT=per_split,
        BLOCK_M=block_m, BLOCK_N=block_n,
        EVEN_K=k == n_tiles * tile * (32 // bits), STAGES=stages, TMA=tiles is not words,
        PAIRS=device_limits(x.device).hopper, INTERPRET=INTERPRET, num_warps=num_warps,
        grid=grid, warmup=probe,
    )  # fmt: skip
    return compiled if probe else out


def _candidates(m: int, bits: int = 4):
    """Block shapes ``(BLOCK_M, BLOCK_N, warps, split divisor, stages)`` timed on a GPU, the
    default first; SPLIT_K is derived from the compiled kernel's occupancy (one wave), divided
    by the divisor (fewer, longer splits: less fp32 partial traffic at 16 rows, and more tiles
    for a pipelined loop to overlap). Every shape compiles for sm_90 within its limits at its
    width (tests/kernels/test_kernel_resources.py: at 2 bits with zero points, 128 rows on 4
    warps spill, the GEMV's and the 16-row kernel's)."""
    # the 16-row kernel, one tile a step: its codes decoded two at a time for the tensor cores
    # (fewer instructions a code than the GEMV's FFMAs, fewer blocks an SM); at 2 bits 64 rows
    # only (at 128 the pairs spill); on 8 warps two warpgroups of 64 rows, half the registers a
    # thread and twice the warps an SM to hide a tile's loads behind the other warps' decode
    if bits == 2:
        dot = ((MAX_ROWS, 64, 4, 1, 1),)
    else:
        dot = ((MAX_ROWS, 128, 4, 1, 1), (MAX_ROWS, 64, 4, 1, 1), (MAX_ROWS, 128, 8, 1, 1))
    if m == 1:
        gemv = ((1, 64, 4, 1, 1),) if bits == 2 else ((1, 128, 4, 1, 1), (1, 64, 4, 1, 1))
        yield from (*gemv, *dot)
        # the next tiles' words copied into shared memory (TMA from sm_90): every split's
        # first STAGES - 1 tiles are in flight at once, so the splits stay as many as fit (at
        # 2 and 3 bits 128 rows spill)
        piped = ((1, 128, 4, 1, 3), (1, 128, 4, 1, 4)) if bits in (4, 8) else ((1, 64, 4, 1, 3),)
        yield from piped
        # the next tile's words in registers: 8 warps at every width (at 4 and 8 bits 128
        # registers, 16 warps an SM), 4 warps where 32 more words a thread fit (8 warps an SM;
        # at 2 and 3 bits they spill)
        yield from ((1, 128, 4, 1, 2),) if bits in (4, 8) else ()
        yield (1, 128, 8, 1, 2)
    else:
        yield from (*dot, (MAX_ROWS, 64, 4, 2, 3), (MAX_ROWS, 64, 4, 1, 2))
        yield from () if bits == 2 else ((MAX_ROWS, 128, 4, 4, 1), (MAX_ROWS, 128, 4, 1, 3))


def _config(args, shape, n_tiles: int):
    """The launch configuration of a block shape with SPLIT_K filling one wave of the device,
    or why the shape cannot launch there."""
    x, words = args[0], args[1]
    block_m, block_n, warps, divisor, stages = shape
    programs = triton.cdiv(words.shape[0], block_n)
    if INTERPRET:  # small blocks, one split: the interpreter runs programs one by one
        return block_m, 32, 1, warps, stages
    split = split_for(programs, n_tiles, 2 * device_limits(x.device).sms)
    guess = (block_m, block_n, split, warps, stages)
    resident = resident_programs(lambda: _launch(*args, guess, probe=True), x.device)
    if isinstance(resident, str):
        return resident
    split = max(1, split_for(programs, n_tiles, resident) // divisor)
    return block_m, block_n, split, warps, stages


#: |kernel - reference| <= TOL * max|reference| for a tuning candidate (the tests' bounds)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_TUNED: dict[tuple, tuple[int, int, int, int, int]] = {}


def _choose(args, m: int, n_tiles: int, tune: bool) -> tuple[int, int, int, int, int]:
    shapes = list(_candidates(m, args[5]))
    if not (tune and TUNE and not INTERPRET):
        shapes = shapes[:1]
    return tuned_config(
        shapes, lambda s: _config(args, s, n_tiles), lambda c: _launch(*args, c),
        lambda: tiled_reference(*args), TOL[args[0].dtype],
        compile_only=lambda c: _launch(*args, c, probe=True),
    )  # fmt: skip


def int_gemv(
    x: Tensor,
    words: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    bias: Tensor | None,
    *,
    bits: int,
    group_size: int | None,
    tile: int,
    config: tuple[int, int, int, int, int] | None = None,
    tune: bool = True,
    check: bool = True,
) -> Tensor:
    """``x @ Wᵀ + bias`` for M <= 16 with ``W`` in the tiled int32 layout.

    Args:
        x: ``[M, K]`` fp16/bf16, M <= 16.
        words, scale, zero, bias, bits, group_size, tile: see
            :func:`lowbit.kernels.int_layout.check_operands`.
        config: ``(BLOCK_M, BLOCK_N, SPLIT_K, num_warps, stages)`` to force one launch
            configuration (``stages``: 1 one tile at a time, 2 the next tile's words loaded
            into registers while one decodes, 3 or more pipelined through shared memory, by
            TMA where the device has one).
        tune: on a GPU, time the candidate configurations once per shape and keep the fastest.
        check: validate the operands (False: the caller built them, as the backend does).

    Returns:
        ``[M, N]`` in ``x``'s dtype (fp32 accumulation).
    """
    if check:
        m, n, k = check_operands(x, words, scale, zero, bias, bits, group_size, tile)
    else:
        m, n, k = x.shape[0], words.shape[0], x.shape[1]
    if not 1 <= m <= MAX_ROWS:
        raise LowbitError(f"int_gemv takes 1 to {MAX_ROWS} rows, not {m}")
    if config is not None and len(config) != 5:
        raise LowbitError("config is (BLOCK_M, BLOCK_N, SPLIT_K, num_warps, stages)")
    if config is not None and (config[0] not in (1, MAX_ROWS) or config[0] < m):
        raise LowbitError(f"BLOCK_M must be 1 (M = 1) or {MAX_ROWS}, not {config[0]} for M={m}")
    if not x.is_contiguous():
        x = x.contiguous()
    args = (x, words, scale, zero, bias, bits, group_size, tile)
    if config is None:
        key = (m == 1, n, k, bits, group_size, tile, zero is None, x.dtype, x.device)
        config = cached_config(_TUNED, key, lambda: _choose(args, m, words.shape[1] // tile, tune))
    return _launch(*args, config)
