"""A decode step's attention over packed KV pages with Triton (CUDA; the interpreter for tests).

The GPU counterpart of :func:`lowbit.kv.decode.compiled_decode_attention`: one query a row reads
the layer's pages where they lie, never a float copy of them. Two kernels a layer, each one
launch over every page:

* ``_scores_kernel``: a program decodes ``BLOCK_T`` tokens of one page for one (batch row, KV
  head), rotates pre-RoPE keys to their positions (rotate-half, cos/sin looked up by position),
  and writes ``q · k * scaling`` of the head's ``G`` query heads into the row ``[B, H_kv, G, T]``.
* ``_accumulate_kernel``: the same tiles of the values, weighted by the softmax of that row,
  summed into one partial ``[G, D]`` a program; torch adds the partials (a fixed order, so a
  step's result does not depend on scheduling).

Between and around them torch does what is small: the fp runs (sink, residual), the mask and
the softmax over the row, the values' basis rotation applied once to the sum (it is linear).

Pages are read through a table of their descriptors (:mod:`lowbit.kv.page_descriptors`, the
C kernels' ``lb_page``), one int64 row a page on the device: where its codes and statistics
are, their strides, its token count and first slot. What must be the same for every page of a
stream (bits, codebook, token and channel groups, which statistics exist and their dtypes)
are compile-time constants, so one compiled kernel serves a format. A value is
``(level(code) - zero) * scale + offset`` with each part only where the page has it, as in the
C kernels and torch's dequantization (Triton may contract a multiply and an add, so the results
equal torch's within float32 rounding, not bit for bit).

Formats: every page :func:`~lowbit.kv.page_descriptors.page_descriptor` reads (integer pages
per token or per channel, KVQuant's codebooks and ranges and its sparse outliers). A block's
outliers are read from its tokens' CSR rows, a few words at a time: each one's stored value
minus what its code decodes to, times the query (for pre-RoPE keys, at the channel and its
rotate-half partner, rotated to the token's position) or times the token's weight, is added to
the block's scores or sums. Pinned sink tokens and keys in a rotated basis return None (the
torch path runs them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

import lowbit.kv.native as native
import lowbit.kv.page_descriptors as pages_c
from lowbit.kernels.triton_support import interpreting, triton
from lowbit.kv.cache import QuantizedKVLayer


class RopeTables(Protocol):
    """What the kernels read of :class:`lowbit.kv.decode.RopeTable`."""

    def table(self, size: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin ``[>= size, D]`` of positions ``0..size-1``."""


__all__ = ["triton_decode_attention", "BLOCK_T"]

#: tokens a program decodes
BLOCK_T = 16

if triton is not None:
    import triton.language as tl

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
    def _scores_kernel(
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
                pos = tl.load(
                    positions + b * positions_stride + start + t, mask=t < tokens, other=0
                )
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
    def _accumulate_kernel(
        table, levels, p, partial, total, blocks,
        HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        DP: tl.constexpr, BLOCK: tl.constexpr,
        OUTLIERS: tl.constexpr, BATCH: tl.constexpr, ROWS: tl.constexpr,
        BITS: tl.constexpr, ROW_BYTES: tl.constexpr, LEVELS: tl.constexpr,
        LEVEL_BIAS: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr,
        SCALE: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,
    ):  # fmt: skip
        """partial[program 0, b * HEADS + h] = sum over BLOCK tokens of a page of
        p[b, h, g, start + t] * value(t), [GP, DP] (zeros past the page's tokens)."""
        page = tl.program_id(0) // blocks
        t0 = (tl.program_id(0) % blocks) * BLOCK
        bh = tl.program_id(1)
        row = table + page * _COLUMNS
        tokens = tl.load(row + _TOKENS)
        g = tl.arange(0, GP)[:, None]
        c = tl.arange(0, DP)[None, :]
        out = partial + ((tl.program_id(0) * tl.num_programs(1) + bh) * GP + g) * DP + c
        acc = tl.zeros([GP, DP], dtype=tl.float32)
        if t0 < tokens:
            start = tl.load(row + _START)
            b = bh // HEADS
            h = bh % HEADS
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
            acc = tl.sum(w[:, :, None] * v[None, :, :], axis=1)  # [GP, DP]
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


def _stat_columns(stat: native.Stat) -> list[int]:
    return [stat.data or 0, *stat.stride]


def _constants(desc: native.Page) -> dict:
    """A page's compile-time constants: bits, row bytes, levels (0 integer, 1 a codebook, 2 a
    codebook a channel), level bias, token and channel groups, each statistic's dtype code (0:
    absent)."""
    scale, zero, offset = (s.dtype if s.data else 0 for s in (desc.scale, desc.zero, desc.offset))
    return dict(
        BITS=desc.bits, ROW_BYTES=-(-desc.dim * desc.bits // 8),
        LEVELS=0 if not desc.levels else 1 + desc.levels_per_channel,
        LEVEL_BIAS=float(desc.level_bias), TG=desc.token_group, CG=desc.channel_group,
        SCALE=scale, ZERO=zero, OFFSET=offset,
    )  # fmt: skip


@dataclasses.dataclass
class _Pages:
    """One stream's pages as the kernels read them."""

    table: Tensor | None  # [pages, _COLUMNS] int64 on the device; None: no pages
    constants: dict  # the format's compile-time constants (_constants)
    levels: Tensor  # the codebook(s) the pages share (a placeholder for integer levels)
    dense: list  # (first slot, last slot + 1, fp tensor [B, H, n, D]) beside the pages
    rotation: Tensor | None  # the pages' stored basis (values: x̂ Rᵀ), or None
    most: int  # the most tokens of a page
    held: list  # what the descriptors point into, alive while the kernels run

    @property
    def count(self) -> int:
        return 0 if self.table is None else self.table.shape[0]


def _pages(regions, device: torch.device) -> _Pages | None:
    """The regions of a stream (:meth:`~lowbit.kv.cache._Stream.regions`) as :class:`_Pages`;
    None where a page is not one the kernels read, or the pages differ in format, codebook or
    basis.

    The table is built and copied to the device each call (a row of 21 integers a page): an
    open page's token count changes every step."""
    rows, dense, held, first = [], [], [], None
    for r0, r1, data in regions:
        if isinstance(data, Tensor):
            dense.append((r0, r1, data))
            continue
        described = pages_c.page_descriptor(data)
        if described is None:
            return None
        desc, tensors = described
        this = (_constants(desc), desc.levels, data.rotation)
        if first is None:
            first = this
            levels = next((t for t in tensors if t.data_ptr() == desc.levels), None)
        elif this[:2] != first[:2] or this[2] is not first[2]:
            return None
        held.append(tensors)
        rows.append([desc.codes, *desc.code_stride, desc.tokens, r0,
                     *_stat_columns(desc.scale), *_stat_columns(desc.zero),
                     *_stat_columns(desc.offset), desc.row_ptr or 0, desc.col_val or 0])  # fmt: skip
    if first is None:
        return _Pages(None, {}, torch.zeros(1, device=device), dense, None, 0, held)
    if levels is None:  # integer levels: a placeholder the kernels never read
        levels = torch.zeros(1, device=device)
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    most = max(row[4] for row in rows)
    constants = {**first[0], "OUTLIERS": any(row[21] for row in rows)}
    return _Pages(table, constants, levels, dense, first[2], most, held)


def triton_decode_attention(
    q: Tensor,
    layer: QuantizedKVLayer,
    *,
    scaling: float,
    mask: Tensor | None = None,
    rope_table: RopeTables | None = None,
    fp_keys: Callable[[int, int, Tensor], Tensor] | None = None,
) -> Tensor | None:
    """One decode step's attention with the Triton kernels reading the packed pages; None,
    having changed nothing, where they cannot: no Triton, not on CUDA (outside the
    interpreter), more than one query a row, pinned sink tokens, a page format they do not read
    (K-sort + BFP), pages of two formats, keys in a rotated basis, a negative position.

    ``q``, ``layer``, ``scaling``, ``mask`` and the result as for
    :func:`~lowbit.kv.decode.chunked_attention`. Pre-RoPE keys: ``rope_table`` (rotate-half
    RoPE in the natural channel order, applied to the pages here) and ``fp_keys``, ``(first
    slot, last slot + 1, fp keys) -> the keys rotated to their positions`` for the fp runs;
    both None for keys cached after RoPE."""
    b, hq, s, d = q.shape
    if triton is None or s != 1 or (q.device.type != "cuda" and not interpreting()):
        return None
    if layer.k.pinned is not None or layer.v.pinned is not None:
        return None
    if rope_table is not None and d % 2:
        return None
    regions = layer.k.regions()
    keys, values = _pages(regions, q.device), _pages(layer.v.regions(), q.device)
    if keys is None or values is None or keys.rotation is not None:
        return None
    hkv = regions[0][2].shape[1]
    groups, total = hq // hkv, layer.length
    gp = triton.next_power_of_2(groups)
    rows = triton.next_power_of_2(BLOCK_T * b)  # a block's CSR rows, for its outliers
    qf = q.float().reshape(b, hkv, groups, d).contiguous()  # [B, Hkv, G, D]
    scores = torch.empty(b, hkv, groups, total, device=q.device)  # [B, Hkv, G, T]
    if keys.count:
        rope = rope_table is not None
        positions = cos = sin = None
        stride = 0
        if rope:
            low, high = layer.track.bounds()
            if low < 0:  # the tables are indexed by position
                return None
            positions = layer.track.positions  # [B or 1, T] int32
            stride = positions.stride(0) if positions.shape[0] == b else 0
            cos, sin = rope_table.table(high + 1, torch.float32, q.device)  # [P, D]
        blocks = -(-keys.most // BLOCK_T)
        dp = triton.next_power_of_2(d // 2 if rope else d)
        _scores_kernel[(keys.count * blocks, b * hkv)](
            keys.table, keys.levels, qf, scores, positions, cos, sin, total, stride, scaling,
            blocks, HEADS=hkv, G=groups, GP=gp, D=d, DP=dp, ROPE=rope, BLOCK=BLOCK_T, BATCH=b,
            ROWS=rows, **keys.constants,
        )  # fmt: skip
    for r0, r1, data in keys.dense:  # the fp runs: sink, residual
        k = fp_keys(r0, r1, data) if fp_keys is not None else data.float()
        scores[..., r0:r1] = torch.matmul(qf, k.transpose(2, 3)) * scaling
    if mask is not None:
        row = mask[:, 0, -1, :total][:, None, None]  # [B or 1, 1, 1, T]
        scores = (
            scores.masked_fill(~row, float("-inf")) if row.dtype == torch.bool
            else scores + row.float()
        )  # fmt: skip
    top = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(top), 0.0, top))
    total_p = p.sum(-1, keepdim=True)
    p = (p / torch.where(total_p == 0, 1.0, total_p)).contiguous()  # a row seeing nothing: 0
    out = torch.zeros(b, hkv, groups, d, device=q.device)
    if values.count:
        blocks = -(-values.most // BLOCK_T)
        dp = triton.next_power_of_2(d)
        partial = torch.empty(values.count * blocks, b * hkv, gp, dp, device=q.device)
        _accumulate_kernel[(values.count * blocks, b * hkv)](
            values.table, values.levels, p, partial, total, blocks,
            HEADS=hkv, G=groups, GP=gp, D=d, DP=dp, BLOCK=BLOCK_T, BATCH=b, ROWS=rows,
            **values.constants,
        )  # fmt: skip
        out = partial.sum(0).view(b, hkv, gp, dp)[:, :, :groups, :d]  # [B, Hkv, G, D]
        if values.rotation is not None:  # summed in the stored basis: x̂ Rᵀ once
            out = out @ values.rotation.float().T
    for r0, r1, data in values.dense:
        out = out + torch.matmul(p[..., r0:r1], data.float())
    return out.reshape(b, hq, 1, d).transpose(1, 2).to(q.dtype)  # [B, 1, H_q, D]
