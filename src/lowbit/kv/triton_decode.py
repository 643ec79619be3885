"""A decode step's attention over packed KV pages with Triton (CUDA; the interpreter for tests).

The GPU counterpart of :func:`lowbit.kv.decode.compiled_decode_attention`: one query a row reads
the layer's pages where they lie, never a float copy of them. Two kernels a layer
(:mod:`lowbit.kv.triton_decode_kernels`, imported when a step runs them: importing lowbit
never imports Triton), each one launch over every page:

* ``scores_kernel``: a program decodes ``BLOCK_T`` tokens of one page for one (batch row, KV
  head), rotates pre-RoPE keys to their positions (rotate-half, cos/sin looked up by position),
  and writes ``q · k * scaling`` of the head's ``G`` query heads into the row ``[B, H_kv, G, T]``.
* ``accumulate_kernel``: the same tiles of the values, weighted by the softmax of that row,
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
import os
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

import lowbit.kv.native as native
import lowbit.kv.page_descriptors as pages_c
from lowbit.kv.cache import QuantizedKVLayer


class RopeTables(Protocol):
    """What the kernels read of :class:`lowbit.kv.decode.RopeTable`."""

    def table(self, size: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin ``[>= size, D]`` of positions ``0..size-1``."""


__all__ = ["triton_decode_attention", "BLOCK_T", "RUN_BLOCKS"]

#: tokens a program decodes at a time
BLOCK_T = 16
#: blocks a weighted-sum program adds into its one partial sum: its partials, [G, D] floats a
#: run of 256 tokens and KV head, take half the bytes of the scores row ([G] a token and head)
#: at D = 128, not a partial a block (8x the row)
RUN_BLOCKS = 16


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
    tokens: list  # each page's token count, as the table holds it
    room: int | None  # the table row of the open page of a room (its token count moves)
    held: list  # the regions and what the descriptors point into, alive while kept

    @property
    def count(self) -> int:
        return len(self.tokens)


def _pages(stream, device: torch.device, plans: dict, name: str) -> _Pages | None:
    """The regions of a layer's keys or values (``stream``'s
    :meth:`~lowbit.kv.cache._Stream.regions`) as :class:`_Pages`; None where a page is not one
    the kernels read, or the pages differ in format, codebook or basis.

    ``plans`` (a layer's ``decode_streams``) keeps it under ``name`` between steps: while the
    stream's :meth:`~lowbit.kv.cache._Stream.layout_key` is unchanged (the same regions but for
    the open page of a room that grew in place), the table on the device stays and only that
    page's token count is written there (one element, no copy of the table, so a step does not
    wait for the device)."""
    key = stream.layout_key()
    kept = plans.get(name)
    if kept is not None and kept[0] == key:
        pages = kept[1]
        if stream.residual is not None:  # it may have grown in place: the fp runs as they are
            pages.dense = [
                (r0, r1, data) for r0, r1, data in stream.regions() if isinstance(data, Tensor)
            ]
        if pages.room is not None:
            row, tokens = pages.room, stream.chunks[-1].num_tokens
            if pages.tokens[row] != tokens:
                pages.table[row, 4] = tokens
                pages.tokens[row] = tokens
        return pages
    regions = stream.regions()
    rows, dense, room, held, first = [], [], None, [stream.layout_objects(), regions], None
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
        if data is stream.chunks[-1] and data.room is not None:
            room = len(rows)
        held.append(tensors)
        rows.append([desc.codes, *desc.code_stride, desc.tokens, r0,
                     *_stat_columns(desc.scale), *_stat_columns(desc.zero),
                     *_stat_columns(desc.offset),
                     desc.row_ptr or 0, desc.col_val or 0])  # fmt: skip
    if first is None:
        pages = _Pages(None, {}, torch.zeros(1, device=device), dense, None, [], None, held)
    else:
        if levels is None:  # integer levels: a placeholder the kernels never read
            levels = torch.zeros(1, device=device)
        table = torch.tensor(rows, dtype=torch.int64).to(device)
        constants = {**first[0], "OUTLIERS": any(row[21] for row in rows)}
        tokens = [row[4] for row in rows]
        pages = _Pages(table, constants, levels, dense, first[2], tokens, room, held)
    plans[name] = (key, pages)
    return pages


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
    if s != 1 or (q.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET")):
        return None  # (not importing Triton to find out)
    from lowbit.kernels.triton_support import interpreting, triton

    if triton is None or (q.device.type != "cuda" and not interpreting()):
        return None
    from lowbit.kv.triton_decode_kernels import accumulate_kernel, scores_kernel

    if layer.k.pinned is not None or layer.v.pinned is not None:
        return None
    if rope_table is not None and d % 2:
        return None
    keys = _pages(layer.k, q.device, layer.decode_streams, "triton k")
    values = _pages(layer.v, q.device, layer.decode_streams, "triton v")
    if keys is None or values is None or keys.rotation is not None:
        return None
    hkv = layer.k.heads()
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
        blocks = -(-max(keys.tokens) // BLOCK_T)
        dp = triton.next_power_of_2(d // 2 if rope else d)
        scores_kernel[(keys.count * blocks, b * hkv)](
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
        runs = -(-max(values.tokens) // (BLOCK_T * RUN_BLOCKS))
        dp = triton.next_power_of_2(d)
        partial = torch.empty(values.count * runs, b * hkv, gp, dp, device=q.device)
        accumulate_kernel[(values.count * runs, b * hkv)](
            values.table, values.levels, p, partial, total, runs,
            HEADS=hkv, G=groups, GP=gp, D=d, DP=dp, BLOCK=BLOCK_T, RUN=RUN_BLOCKS, BATCH=b,
            ROWS=rows, **values.constants,
        )  # fmt: skip
        out = partial.sum(0).view(b, hkv, gp, dp)[:, :, :groups, :d]  # [B, Hkv, G, D]
        if values.rotation is not None:  # summed in the stored basis: x̂ Rᵀ once
            out = out @ values.rotation.float().T
    for r0, r1, data in values.dense:
        out = out + torch.matmul(p[..., r0:r1], data.float())
    return out.reshape(b, hq, 1, d).transpose(1, 2).to(q.dtype)  # [B, 1, H_q, D]
