"""The Triton kernels of :mod:`lowbit.kv.triton_decode` (imported by it only when a step runs
them, so that importing lowbit never imports Triton): a page's codes decoded as the C kernels
and torch decode them, a block's scores, a block's weighted values, and the corrections of a
block's sparse outliers. The page table's layout, the launch and the torch around them are
:mod:`lowbit.kv.triton_decode`'s."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["scores_kernel", "accumulate_kernel"]

# a page's row of the descriptor table (_pages): codes and their strides (bytes: batch row,
# head, token), token count, first slot, then scale, zero and offset, each a pointer and 4
# strides (elements), then the sparse outliers' CSR row pointers and words (0: none)
_CODES, _TOKENS, _START = tl.constexpr(0), tl.constexpr(4), tl.constexpr(5)
_SCALE, _ZERO, _OFFSET = tl.constexpr(6), tl.constexpr(11), tl.constexpr(16)
_ROW_PTR, _COL_VAL, _COLUMNS = tl.constexpr(21), tl.constexpr(22), tl.constexpr(23)
#: outlier words the scores kernel takes at a time, and the weighted sums' (theirs scatter
#: over every channel: [G, words, channels] at once)
_WORDS, _VALUE_WORDS = tl.constexpr(16), tl.constexpr(8)


@triton.jit
def _stat(row, col: tl.constexpr, KIND: tl.constexpr, b, h, tg, cg, valid):
    """Statistic ``col`` of the page at (b, h, token group tg, channel group cg), float32;
    KIND: native's dtype code (1 fp16, 2 fp32, 3 uint8), never 0 here."""
    at = (
        b * tl.load(row + col + 1)
        + h * tl.load(row + col + 2)
        + tg * tl.load(row + col + 3)
        + cg * tl.load(row + col + 4)
    )
    base = tl.load(row + col)
    if KIND == 1:
        x = tl.load(base.to(tl.pointer_type(tl.float16)) + at, mask=valid, other=0.0)
    elif KIND == 2:
        x = tl.load(base.to(tl.pointer_type(tl.float32)) + at, mask=valid, other=0.0)
    else:
        x = tl.load(base.to(tl.pointer_type(tl.uint8)) + at, mask=valid, other=0)
    return x.to(tl.float32)


@triton.jit
def _decode(
    row, levels, b, h, t, c, valid,
    D: tl.constexpr, BITS: tl.constexpr, ROW_BYTES: tl.constexpr, LEVELS: tl.constexpr,
    LEVEL_BIAS: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr,
    SCALE: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """Channels ``c`` [1, C] of tokens ``t`` [T, 1] of the page, head h, batch row b:
    [T, C] float32 (0 where not ``valid``). LEVELS: 0 integer levels (code + LEVEL_BIAS),
    1 one codebook, 2 a codebook a channel."""
    codes = tl.load(row + _CODES).to(tl.pointer_type(tl.uint8))
    at = (
        b * tl.load(row + _CODES + 1)
        + h * tl.load(row + _CODES + 2)
        + t * tl.load(row + _CODES + 3)
    )
    bit = c * BITS  # the codes are a little-endian bit stream a row
    word = tl.load(codes + at + bit // 8, mask=valid, other=0).to(tl.int32)
    if 8 % BITS != 0:  # a code may end in the next byte
        more = valid & (bit // 8 + 1 < ROW_BYTES)
        word = word | (tl.load(codes + at + bit // 8 + 1, mask=more, other=0).to(tl.int32) << 8)
    code = (word >> (bit % 8)) & ((1 << BITS) - 1)
    if LEVELS == 0:
        v = code.to(tl.float32) + LEVEL_BIAS
    elif LEVELS == 1:
        v = tl.load(levels + code)
    else:
        v = tl.load(levels + (h * D + c) * (1 << BITS) + code, mask=valid, other=0.0)
    tg = t // TG
    cg = c // CG
    if ZERO != 0:
        v = v - _stat(row, _ZERO, ZERO, b, h, tg, cg, valid)
    if SCALE != 0:
        v = v * _stat(row, _SCALE, SCALE, b, h, tg, cg, valid)
    if OFFSET != 0:
        v = v + _stat(row, _OFFSET, OFFSET, b, h, tg, cg, valid)
    return tl.where(valid, v, 0.0)


@triton.jit
def _block_words(row, t0, tokens, BLOCK: tl.constexpr, BATCH: tl.constexpr):
    """The CSR rows r0..r1 - 1 of tokens t0..t0 + BLOCK - 1 of the page (row = token *
    BATCH + batch row) and the indices of their first and past their last outlier word."""
    row_ptr = tl.load(row + _ROW_PTR).to(tl.pointer_type(tl.int32))
    r0 = t0 * BATCH
    r1 = tl.minimum(t0 + BLOCK, tokens) * BATCH
    return r0, r1, tl.load(row_ptr + r0), tl.load(row_ptr + r1)


@triton.jit
def _outlier_words(
    row, levels, b, h, r0, r1, e, BATCH: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, BITS: tl.constexpr, ROW_BYTES: tl.constexpr, LEVELS: tl.constexpr,
    LEVEL_BIAS: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr,
    SCALE: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """The outlier words ``e`` [W] (CSR indices, those < the end of row r1 - 1) among the
    page's rows r0..r1 - 1 (row = token * BATCH + batch row; ROWS: a power of two >=
    r1 - r0): each one's token, channel of its head, and stored value minus the value its
    code decodes to; ``ok``: words of batch row b and head h."""
    row_ptr = tl.load(row + _ROW_PTR).to(tl.pointer_type(tl.int32))
    col_val = tl.load(row + _COL_VAL).to(tl.pointer_type(tl.int32))
    k = tl.arange(0, ROWS)
    ends = tl.load(row_ptr + r0 + 1 + k, mask=r0 + 1 + k <= r1, other=2147483647)
    inside = e < tl.load(row_ptr + r1)
    r = r0 + tl.sum((ends[None, :] <= e[:, None]).to(tl.int32), axis=1)  # [W]
    word = tl.load(col_val + e - tl.load(row_ptr), mask=inside, other=0)
    channel = (word >> 16) & 0xFFFF  # head * D + channel of the head
    t = r // BATCH
    d = channel % D
    ok = inside & (r % BATCH == b) & (channel // D == h)
    value = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    coded = _decode(
        row, levels, b, h, t, d, ok,
        D, BITS, ROW_BYTES, LEVELS, LEVEL_BIAS, TG, CG, SCALE, ZERO, OFFSET,
    )  # fmt: skip
    return t, d, tl.where(ok, value - coded, 0.0), ok


@triton.jit
def scores_kernel(
    table, levels, q, scores, positions, cos, sin, total, positions_stride, scaling, blocks,
    HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr,
    OUTLIERS: tl.constexpr, BATCH: tl.constexpr, ROWS: tl.constexpr,
    BITS: tl.constexpr, ROW_BYTES: tl.constexpr, LEVELS: tl.constexpr,
    LEVEL_BIAS: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr,
    SCALE: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """scores[b, h, g, start + t] = q[b, h, g] . key(t) * scaling for BLOCK tokens of a page
    (program 0: page * blocks + block; program 1: b * HEADS + h). DP: a power of two >= D
    (>= D / 2 with ROPE: the two halves apart)."""
    page = tl.program_id(0) // blocks
    t0 = (tl.program_id(0) % blocks) * BLOCK
    bh = tl.program_id(1)
    row = table + page * _COLUMNS
    tokens = tl.load(row + _TOKENS)
    if t0 < tokens:
        start = tl.load(row + _START)
        b = bh // HEADS
        h = bh % HEADS
        t = t0 + tl.arange(0, BLOCK)[:, None]  # [T, 1]
        g = tl.arange(0, GP)[:, None]  # [GP, 1]
        qrow = q + (bh * G + g) * D
        if ROPE:  # k cos + rotate_half(k) sin, the halves apart
            c = tl.arange(0, DP)[None, :]
            valid = (t < tokens) & (c < D // 2)
            lo = _decode(
                row, levels, b, h, t, c, valid,
                D, BITS, ROW_BYTES, LEVELS, LEVEL_BIAS, TG, CG, SCALE, ZERO, OFFSET,
            )  # fmt: skip
            hi = _decode(
                row, levels, b, h, t, c + D // 2, valid,
                D, BITS, ROW_BYTES, LEVELS, LEVEL_BIAS, TG, CG, SCALE, ZERO, OFFSET,
            )  # fmt: skip
            pos = tl.load(positions + b * positions_stride + start + t, mask=t < tokens, other=0)
            at = pos * D + c
            r_lo = lo * tl.load(cos + at, mask=valid, other=0.0) - hi * tl.load(
                sin + at, mask=valid, other=0.0
            )
            r_hi = hi * tl.load(cos + at + D // 2, mask=valid, other=0.0) + lo * tl.load(
                sin + at + D // 2, mask=valid, other=0.0
            )
            qm = (g < G) & (c < D // 2)
            q_lo = tl.load(qrow + c, mask=qm, other=0.0)  # [GP, DP]
            q_hi = tl.load(qrow + c + D // 2, mask=qm, other=0.0)
            s = tl.sum(q_lo[:, None, :] * r_lo[None, :, :], axis=2)
            s += tl.sum(q_hi[:, None, :] * r_hi[None, :, :], axis=2)  # [GP, T]
        else:
            c = tl.arange(0, DP)[None, :]
            valid = (t < tokens) & (c < D)
            k = _decode(
                row, levels, b, h, t, c, valid,
                D, BITS, ROW_BYTES, LEVELS, LEVEL_BIAS, TG, CG, SCALE, ZERO, OFFSET,
            )  # fmt: skip
            qv = tl.load(qrow + c, mask=(g < G) & (c < D), other=0.0)  # [GP, DP]
            s = tl.sum(qv[:, None, :] * k[None, :, :], axis=2)  # [GP, T]
        tt = t0 + tl.arange(0, BLOCK)[None, :]
        if OUTLIERS:  # each outlier's stored value in place of its code's: q . (o - k) e_d
            if tl.load(row + _ROW_PTR) != 0:
                r0, r1, first, end = _block_words(row, t0, tokens, BLOCK, BATCH)
                for e0 in range(first, end, _WORDS):
                    e = e0 + tl.arange(0, _WORDS)
                    tk, d, delta, ok = _outlier_words(
                        row, levels, b, h, r0, r1, e, BATCH, ROWS,
                        D, BITS, ROW_BYTES, LEVELS, LEVEL_BIAS, TG, CG, SCALE, ZERO, OFFSET,
                    )  # fmt: skip
                    mine = (g < G) & ok[None, :]
                    f = tl.load(qrow + d[None, :], mask=mine, other=0.0)  # [GP, W]
                    if ROPE:  # d and its rotate-half partner both move
                        partner = (d + D // 2) % D
                        where = tl.load(
                            positions + b * positions_stride + start + tk, mask=ok, other=0
                        )  # [W]
                        sign = tl.where(d < D // 2, 1.0, -1.0)
                        cd = tl.load(cos + where * D + d, mask=ok, other=0.0)
                        sp = tl.load(sin + where * D + partner, mask=ok, other=0.0)
                        fp = tl.load(qrow + partner[None, :], mask=mine, other=0.0)
                        f = f * cd[None, :] + fp * (sign * sp)[None, :]
                    hit = (tk[:, None] == tt) & ok[:, None]  # [W, T]
                    corr = (f * delta[None, :])[:, :, None] * hit[None, :, :].to(tl.float32)
                    s += tl.sum(corr, axis=1)  # [GP, T]
        out = scores + (bh * G + g) * total + start + tt
        tl.store(out, s * scaling, mask=(g < G) & (tt < tokens))


@triton.jit
def accumulate_kernel(
    table, levels, p, partial, total, runs,
    HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, BLOCK: tl.constexpr, RUN: tl.constexpr,
    OUTLIERS: tl.constexpr, BATCH: tl.constexpr, ROWS: tl.constexpr,
    BITS: tl.constexpr, ROW_BYTES: tl.constexpr, LEVELS: tl.constexpr,
    LEVEL_BIAS: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr,
    SCALE: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
):  # fmt: skip
    """partial[program 0, b * HEADS + h] = sum over a run of RUN blocks of BLOCK tokens of a
    page of p[b, h, g, start + t] * value(t), [GP, DP] (program 0: page * runs + run; zeros
    past the page's tokens): a program's partial stands for RUN * BLOCK tokens, so the
    partials of a layer take less than its row of scores."""
    page = tl.program_id(0) // runs
    first_token = (tl.program_id(0) % runs) * RUN * BLOCK
    bh = tl.program_id(1)
    row = table + page * _COLUMNS
    tokens = tl.load(row + _TOKENS)
    start = tl.load(row + _START)
    b = bh // HEADS
    h = bh % HEADS
    g = tl.arange(0, GP)[:, None]
    c = tl.arange(0, DP)[None, :]
    out = partial + ((tl.program_id(0) * tl.num_programs(1) + bh) * GP + g) * DP + c
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    for step in range(RUN):
        t0 = first_token + step * BLOCK
        if t0 < tokens:
            t = t0 + tl.arange(0, BLOCK)[:, None]  # [T, 1]
            valid = (t < tokens) & (c < D)
            v = _decode(
                row, levels, b, h, t, c, valid,
                D, BITS, ROW_BYTES, LEVELS, LEVEL_BIAS, TG, CG, SCALE, ZERO, OFFSET,
            )  # fmt: skip
            tt = t0 + tl.arange(0, BLOCK)[None, :]
            w = tl.load(
                p + (bh * G + g) * total + start + tt, mask=(g < G) & (tt < tokens), other=0.0
            )
            acc += tl.sum(w[:, :, None] * v[None, :, :], axis=1)  # [GP, DP]
            if OUTLIERS:  # each outlier's stored value in place of its code's
                if tl.load(row + _ROW_PTR) != 0:
                    r0, r1, first, end = _block_words(row, t0, tokens, BLOCK, BATCH)
                    for e0 in range(first, end, _VALUE_WORDS):
                        e = e0 + tl.arange(0, _VALUE_WORDS)
                        tk, d, delta, ok = _outlier_words(
                            row, levels, b, h, r0, r1, e, BATCH, ROWS,
                            D, BITS, ROW_BYTES, LEVELS, LEVEL_BIAS, TG, CG, SCALE, ZERO, OFFSET,
                        )  # fmt: skip
                        pw = tl.load(
                            p + (bh * G + g) * total + start + tk[None, :],
                            mask=(g < G) & ok[None, :], other=0.0,
                        )  # fmt: skip
                        hit = (d[:, None] == c) & ok[:, None]  # [W, DP]
                        corr = (pw * delta[None, :])[:, :, None] * hit[None, :, :].to(tl.float32)
                        acc += tl.sum(corr, axis=1)  # [GP, DP]
    tl.store(out, acc)
