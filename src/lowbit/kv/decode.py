"""Attention that reads a quantized KV cache a chunk at a time (flash-decoding on the CPU).

:func:`chunked_attention` computes ``softmax(q kᵀ · scaling + mask) v`` over a
:class:`~lowbit.kv.cache.QuantizedKVLayer` without ever building the layer's whole float K/V:
for each chunk the layer yields (a page of packed tokens, the fp sink, the fp residual; at most
``lowbit.kv.cache.PAGE_TOKENS`` slots) it dequantizes that chunk only, applies RoPE to pre-RoPE
keys at their true positions, takes the scores, and merges them into a running max, sum and
weighted value sum (Dao et al.'s online softmax). The work per step is one pass over the stored
codes; the float memory is one chunk's. A decode step (one query per row) goes first to
:func:`compiled_decode_attention`, the same computation in compiled C (:mod:`lowbit.kv.native`)
for the formats it reads, or on CUDA to Triton's (:mod:`lowbit.kv.triton_decode`). A prefill
step (several queries per row) whose layer K/V take at most ``DENSE_PREFILL_BYTES`` in float32
reads them dequantized whole, by torch's fused attention (:func:`_dense_attention`): one
layer's float K/V at a time, never the whole model's cache.

Decisions:

* GQA without repeating heads: the query heads of one KV head are laid side by side,
  ``[B, H_kv, G * S, D]``, so one matmul per chunk serves the group.
* Scores and sums in float32 whatever the model's dtype (the dequantized chunk is produced in
  float32 directly), so the result equals the dequantize-everything path within float32
  rounding of a different summation order.
* Values stored in a rotated basis (KVQuant's ``rotate=True``: dequantized ``x̂ Rᵀ``) are
  accumulated in that basis, and ``Rᵀ`` is applied once to the sum (it is linear), not to
  every cached token.
* Masks: transformers' 4-D mask (bool, or additive float) sliced per chunk; with no mask and
  more than one query the causal mask is built per chunk from slot indices (the queries are
  the last ``S`` slots). A query row that may see nothing gets zeros.
* RoPE of pre-RoPE keys uses a table of cos/sin by position (:class:`RopeTable`), equal bit
  for bit to computing them per position (each entry is one product and a cos/sin), so a step
  does no trigonometry over the cache.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

import lowbit.kv.cache as kv_cache
import lowbit.kv.native as native
import lowbit.kv.page_descriptors as pages_c
from lowbit.kv.cache import QuantizedKVLayer
from lowbit.kv.triton_decode import triton_decode_attention

__all__ = ["chunked_attention", "compiled_decode_attention", "RopeTable"]

#: most score elements of one chunk (4 M fp32: 16 MB) when many queries come at once
SCORE_ELEMENTS = 1 << 22
#: most float32 bytes of a layer's keys and values read whole by a prefill step (torch's fused
#: attention over them); beyond it the step goes chunk by chunk
DENSE_PREFILL_BYTES = 64 << 20


class RopeTable:
    """cos/sin ``[P, D]`` of positions ``0..P-1`` for one model, grown on demand (doubling)
    up to ``limit`` positions; positions beyond it are computed directly.

    Args:
        rope_cos_sin: the adapter's ``positions [B, T], dtype -> (cos, sin) [B, T, D]``.
        limit: the largest table kept (the model's ``max_position_embeddings``).
    """

    def __init__(
        self, rope_cos_sin: Callable[[Tensor, torch.dtype], tuple[Tensor, Tensor]], limit: int
    ) -> None:
        self.rope_cos_sin = rope_cos_sin
        self.limit = max(int(limit), 1)
        self.tables: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}
        #: (dtype, device) -> (the table they were made from, cos blocks, sin blocks)
        self._blocks: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}

    def table(self, top: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """(cos, sin) ``[P, D]`` of positions ``0..P-1``, ``P >= top`` (past ``limit`` when
        ``top`` is: the compiled decode path reads positions from the table only)."""
        key = (dtype, device)
        cos, sin = self.tables.get(key, (None, None))
        if cos is None or cos.shape[0] < top:
            size = max(top, 2 * (0 if cos is None else cos.shape[0]), 1024)
            if top <= self.limit:  # past the limit it doubles too, not one position a step
                size = min(size, self.limit)
            grid = torch.arange(size, device=device)[None]  # [1, P]
            cos, sin = (t[0] for t in self.rope_cos_sin(grid, dtype))  # [P, D]
            self.tables[key] = (cos, sin)
        return cos, sin

    def blocks(self, top: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """:meth:`table`'s (cos, sin) in blocks of 16 positions (:func:`native.rope_blocks`),
        kept while the table lives."""
        cos, sin = self.table(top, dtype, device)
        key = (dtype, device)
        made = self._blocks.get(key)
        if made is None or made[0] is not cos:
            made = (cos, *native.rope_blocks(cos, sin))
            self._blocks[key] = made
        return made[1], made[2]

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) ``[B, n, D]`` of ``positions`` ``[B, n]``."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self.limit:
            return self.rope_cos_sin(positions, dtype)
        cos, sin = self.table(top, dtype, positions.device)
        return cos[positions], sin[positions]  # [B, n, D]


def chunked_attention(
    q: Tensor,
    layer: QuantizedKVLayer,
    *,
    scaling: float,
    mask: Tensor | None = None,
    key_rope: Callable[[Tensor, Tensor], Tensor] | None = None,
    rope_table: RopeTable | None = None,
    max_tokens: int | None = None,
    query_rope: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Attention of queries over every token ``layer`` holds, the new ones included.

    A decode step (one query per row) goes to :func:`compiled_decode_attention` (on CUDA, to
    :func:`~lowbit.kv.triton_decode.triton_decode_attention`) when it can read the layer's
    pages, a prefill step to :func:`_dense_attention` when the layer's K/V are small enough to
    read whole; everything else is computed here, chunk by chunk, in torch (and any call that
    gives ``max_tokens``).

    Args:
        q: ``[B, H_q, S, D]`` queries, ready for ``q kᵀ`` (RoPE, Hadamard, query quantizer done)
            but for ``query_rope``.
        layer: the layer's cache, after this step's keys and values were stored.
        scaling: the softmax scale.
        mask: transformers' 4-D mask ``[B or 1, 1, S, T]`` (bool: allowed; float: added), or
            None (then causal when ``S > 1``).
        key_rope: ``(keys [B, H_kv, n, D], positions [B, n]) -> rotated keys`` for a cache of
            pre-RoPE keys; None when keys are cached after RoPE.
        rope_table: the cos/sin tables ``key_rope`` reads, when it is rotate-half RoPE in the
            natural channel order (the compiled path applies it itself); None: it is not.
        max_tokens: most slots decoded at once (None: a page, ``PAGE_TOKENS``, or fewer so
            that a chunk's scores hold at most ``SCORE_ELEMENTS``: a long prompt's prefill).
        query_rope: ``q -> q`` rotated to the queries' positions when ``q`` is not yet (pre-RoPE
            caches): the compiled decode rotates a step's query itself, with ``rope_table``.

    Returns:
        ``[B, S, H_q, D]`` in ``q``'s dtype (the layout ``o_proj`` reads after a reshape).
    """
    b, hq, s, d = q.shape
    decode_step = s == 1 and max_tokens is None and (key_rope is None or rope_table is not None)
    if decode_step:
        out = compiled_decode_attention(
            q, layer, scaling=scaling, mask=mask, key_rope=key_rope, rope_table=rope_table,
            query_rope=query_rope,
        )  # fmt: skip
        if out is not None:
            return out
    if query_rope is not None:
        q = query_rope(q)
    if decode_step and q.device.type == "cuda":
        out = _triton_decode(q, layer, scaling, mask, key_rope, rope_table)
        if out is not None:
            return out
    if s > 1 and max_tokens is None:
        out = _dense_attention(q, layer, scaling=scaling, mask=mask, key_rope=key_rope)
        if out is not None:
            return out
    total = layer.length
    if max_tokens is None:  # a page, fewer when many queries (prefill) would make big scores
        max_tokens = min(kv_cache.PAGE_TOKENS, max(64, SCORE_ELEMENTS // (b * hq * s)))
    positions = layer.positions() if key_rope is not None else None  # [B, T]
    acc: dict[int, Tensor] = {}  # id of the value basis's rotation (0: none) -> [B, Hkv, GS, D]
    rotations: dict[int, Tensor] = {}
    m = l = qf = None
    for start, stop, k, k_rot, v, v_rot in layer.chunks(torch.float32, max_tokens):
        if qf is None:
            hkv = k.shape[1]
            qf = q.float().reshape(b, hkv, (hq // hkv) * s, d)  # [B, Hkv, G*S, D]
            m = torch.full((b, hkv, qf.shape[2], 1), float("-inf"), device=q.device)  # max
            l = torch.zeros(b, hkv, qf.shape[2], 1, device=q.device)  # running sum of exp
        if k_rot is not None:  # keys in a rotated basis: x̂ Rᵀ
            k = k @ k_rot.float().T
        if key_rope is not None:
            k = key_rope(k, positions[:, start:stop])
        scores = torch.matmul(qf, k.transpose(2, 3)) * scaling  # [B, Hkv, G*S, n]
        scores = _masked(scores, mask, start, stop, s, total)
        top = scores.amax(-1, keepdim=True)  # [B, Hkv, G*S, 1]
        m_new = torch.maximum(m, top)
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - safe)  # [B, Hkv, G*S, n]
        alpha = torch.exp(m - safe)  # 0 where nothing was seen yet
        l = l * alpha + p.sum(-1, keepdim=True)
        key = 0 if v_rot is None else id(v_rot)
        if v_rot is not None:
            rotations[key] = v_rot
        for other in acc:
            acc[other] = acc[other] * alpha
        pv = torch.matmul(p, v)  # [B, Hkv, G*S, D]
        acc[key] = acc[key] + pv if key in acc else pv
        m = m_new
    out = None
    for key, part in acc.items():
        part = part if key == 0 else part @ rotations[key].float().T
        out = part if out is None else out + part
    out = out / torch.where(l == 0, torch.ones_like(l), l)  # [B, Hkv, G*S, D]
    return out.view(b, hq, s, d).transpose(1, 2).to(q.dtype)  # [B, S, H_q, D]


def _dense_attention(
    q: Tensor,
    layer: QuantizedKVLayer,
    *,
    scaling: float,
    mask: Tensor | None,
    key_rope: Callable[[Tensor, Tensor], Tensor] | None,
) -> Tensor | None:
    """Attention of several queries a row (a prefill chunk) over the layer's keys and values
    dequantized whole, in float32, by torch's fused attention: the chunked path's per-chunk
    scores, exponentials and merges cost several times the float cache's attention on a long
    prompt. None where they would take more than ``DENSE_PREFILL_BYTES`` (then chunk by chunk,
    so a prefill's float memory stays one layer's bounded share). Arguments and result as for
    :func:`chunked_attention`; a query row that may see nothing gets zeros, as there."""
    b, hq, s, d = q.shape
    total = layer.length
    hkv = layer.k.regions()[0][2].shape[1]
    if 2 * b * hkv * total * d * 4 > DENSE_PREFILL_BYTES:
        return None
    keys, values = layer.k.full(torch.float32), layer.v.full(torch.float32)  # [B, Hkv, T, D]
    if key_rope is not None:
        keys = key_rope(keys, layer.positions())
    if mask is None:  # the queries are the last S slots; query i sees slots <= T - S + i
        slots = torch.arange(total, device=q.device)
        allowed = slots[None, :] <= (total - s) + torch.arange(s, device=q.device)[:, None]
    else:
        allowed = mask[..., :total]  # [B or 1, 1, S, T]
        allowed = allowed.float() if allowed.dtype != torch.bool else allowed
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys, values, attn_mask=allowed, scale=scaling, enable_gqa=hq != hkv
    )  # [B, H_q, S, D]
    seen = allowed if allowed.dtype == torch.bool else allowed > float("-inf")
    out = torch.where(seen.any(-1, keepdim=True), out, 0.0)  # not SDPA's NaN for such rows
    return out.transpose(1, 2).to(q.dtype)  # [B, S, H_q, D]


def compiled_decode_attention(
    q: Tensor,
    layer: QuantizedKVLayer,
    *,
    scaling: float,
    mask: Tensor | None = None,
    key_rope: Callable[[Tensor, Tensor], Tensor] | None = None,
    rope_table: RopeTable | None = None,
    query_rope: Callable[[Tensor], Tensor] | None = None,
) -> Tensor | None:
    """One decode step's attention with the compiled kernels (:mod:`lowbit.kv.native`) reading
    the packed pages; None, having changed nothing, where they cannot: no compiled library,
    more than one query per row, pinned sink tokens, a page format they do not read, keys in a
    rotated basis, or pre-RoPE keys without ``rope_table`` or at a negative position.

    One library call a layer (``lb_attend``): the scores of every slot (pages and fp runs) into
    one row per query, the mask, the softmax over the row, the weighted sums of the values and
    the division, the row being ``[B, H_kv, G, T]`` floats (36 MB for 9 query heads at a million
    tokens) rather than an online softmax's running merges; each thread's part of the slots is a
    split of its own (scores, softmax, weighted sums), merged at the end. A query not yet rotated
    (``query_rope``) is rotated by the library at the step's position from ``rope_table`` when it
    applies to the keys, else by ``query_rope``. Arguments and result as for
    :func:`chunked_attention`.
    """
    lib = native.library()
    b, hq, s, d = q.shape
    if lib is None or s != 1 or q.device.type != "cpu" or q.dtype not in native.FLOAT_DTYPES:
        return None
    if layer.k.pinned is not None or layer.v.pinned is not None:
        return None
    hkv = layer.k.heads()
    groups = hq // max(hkv, 1)
    if hkv == 0 or groups > native.MAX_GROUPS or d > native.MAX_DIM:
        return None
    total = layer.length
    rope = None
    if key_rope is not None:
        positions = layer.track.positions  # [B, T] int32, rows read by their stride
        low, high = layer.track.bounds()
        if low < 0:  # the kernels index the tables by position
            return None
        top = high + 1
        cos, sin = rope_table.table(top, torch.float32, q.device)  # [P, D]
        cos_b, sin_b = rope_table.blocks(top, torch.float32, q.device)  # [P / 16 + 1, C, 16]
        rope = native.Rope(cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), positions.stride(0),
                           cos_b.data_ptr(), sin_b.data_ptr(), cos_b.shape[1])  # fmt: skip
    keep: list = []  # everything the library's structures point into
    keys = _stream(layer.k, keep, key_rope is not None, layer.decode_streams, "k")
    values = _stream(layer.v, keep, False, layer.decode_streams, "v")
    if keys is None or values is None or keys[1] is not None:
        return None  # a page the kernels do not read, or keys in a rotated basis
    row = None
    if mask is not None:
        row = mask[:, 0, -1, :total]  # [B or 1, T]
        row = (
            torch.zeros(row.shape).masked_fill_(~row, float("-inf"))
            if row.dtype == torch.bool
            else row.float().contiguous()
        )
    value_rotation = None if values[1] is None else values[1].float().contiguous()
    rotate_query = query_rope is not None and rope is not None
    if query_rope is not None and not rotate_query:
        q = query_rope(q)
    q = q.contiguous()  # [B, H_q, 1, D]: the rows [B, H_kv, G, D] in order
    out = torch.empty(b, 1, hq, d, dtype=q.dtype)  # the same rows, written in q's dtype
    status = lib.lb_attend(
        ctypes.byref(keys[0]), ctypes.byref(values[0]), None if rope is None else ctypes.byref(rope),
        q.data_ptr(), native.FLOAT_DTYPES[q.dtype], b, hkv, groups, d, total, scaling,
        None if row is None else row.data_ptr(), 0 if row is None or row.shape[0] == 1 else total,
        None if value_rotation is None else value_rotation.data_ptr(), int(rotate_query),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return None if status else out  # [B, 1, H_q, D]


def _stream(
    stream: kv_cache._Stream,
    keep: list,
    pre_rope: bool = False,
    plans: dict | None = None,
    name: str = "",
) -> tuple[native.Stream, Tensor | None] | None:
    """The keys or values of a layer (its ``stream``'s :meth:`~lowbit.kv.cache._Stream.regions`)
    as the library's ``lb_stream``, and the rotation of its pages' stored basis (or None);
    None where a page is not one the kernels read, or the pages differ in basis. ``pre_rope``:
    the fp runs are pre-RoPE keys, rotated by the library. The structures and the tensors they
    point into are appended to ``keep``.

    ``plans`` (a layer's ``decode_streams``) keeps the result under ``name`` between decode
    steps: while the stream's :meth:`~lowbit.kv.cache._Stream.layout_key` is unchanged (every
    region the same object as last step, but for the open page of a room and the residual,
    both grown in place), the kept structures are reused with their token counts updated, not
    described anew."""
    key = stream.layout_key()
    kept = None if plans is None else plans.get(name)
    if kept is not None and kept[0] == key:
        _, result, page_array, room_page, dense_array, residual_run, held = kept
        if room_page is not None:  # the open page's tokens, written since
            page_array[room_page].tokens = stream.chunks[-1].num_tokens
        if residual_run is not None:  # and the residual's
            dense_array[residual_run].tokens = stream.residual.shape[2]
        keep.append(held)
        return result
    pages, starts, dense, rotations, held = [], [], [], set(), [stream.layout_objects()]
    rotation = room_page = residual_run = None
    keepable = plans is not None
    for r0, r1, data in stream.regions():
        held.append(data)
        if isinstance(data, Tensor):
            if data is stream.residual and data is stream.residual_view:
                residual_run = len(dense)  # grows in place: its token count moves
            if data.dtype not in native.FLOAT_DTYPES or data.stride(-1) != 1:
                data = data.float().contiguous()
                held.append(data)
                residual_run, keepable = None, False  # a copy: described anew every step
            part = native.Dense(data.data_ptr(), native.FLOAT_DTYPES[data.dtype], int(pre_rope),
                                r0, r1 - r0)  # fmt: skip
            part.stride[:] = list(data.stride()[:3])
            dense.append(part)
            continue
        described = pages_c.page_descriptor(data)
        if described is None:
            return None
        if data is stream.chunks[-1] and data.room is not None:
            room_page = len(pages)
        pages.append(described[0])
        starts.append(r0)
        held.append(described[1])
        rotation = data.rotation
        rotations.add(None if rotation is None else id(rotation))
    if len(rotations) > 1:
        return None
    page_array, start_array = pages_c.page_array(pages, starts)
    dense_array = (native.Dense * len(dense))(*dense)
    held += [page_array, start_array, dense_array]
    described_stream = native.Stream(
        ctypes.cast(page_array, ctypes.c_void_p), ctypes.cast(start_array, ctypes.c_void_p),
        len(pages), ctypes.cast(dense_array, ctypes.c_void_p), len(dense),
    )  # fmt: skip
    keep.append(held)
    if keepable:
        result = (described_stream, rotation)
        plans[name] = (key, result, page_array, room_page, dense_array, residual_run, held)
    elif plans is not None:
        plans.pop(name, None)
    return described_stream, rotation


def _triton_decode(
    q: Tensor,
    layer: QuantizedKVLayer,
    scaling: float,
    mask: Tensor | None,
    key_rope: Callable[[Tensor, Tensor], Tensor] | None,
    rope_table: RopeTable | None,
) -> Tensor | None:
    """:func:`~lowbit.kv.triton_decode.triton_decode_attention` with this module's rotation of
    pre-RoPE fp keys (a sink's rotated once)."""
    fp_keys = None
    if key_rope is not None:

        def fp_keys(r0: int, r1: int, data: Tensor) -> Tensor:
            return _rotated_fp_keys(layer, r0, r1, data, key_rope)

    return triton_decode_attention(
        q, layer, scaling=scaling, mask=mask, fp_keys=fp_keys,
        rope_table=rope_table if key_rope is not None else None,
    )  # fmt: skip


def _rotated_fp_keys(
    layer: QuantizedKVLayer,
    r0: int,
    r1: int,
    data: Tensor,
    key_rope: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """The fp keys ``data`` ``[B, H, r1 - r0, D]`` of slots ``r0:r1`` rotated to their
    positions, in float32; kept in ``layer.rotated_fp_keys`` while the same tensor, unchanged,
    holds those slots (a sink's keys are rotated once, not every step)."""
    kept = layer.rotated_fp_keys.get(r0)
    if kept is not None and kept[0]() is data and kept[1] == (data._version, r1):
        return kept[2]
    k = key_rope(data.float(), layer.positions(r0, r1))
    layer.rotated_fp_keys[r0] = (weakref.ref(data), (data._version, r1), k)
    return k


def _masked(scores: Tensor, mask: Tensor | None, start: int, stop: int, s: int, total: int):
    """``scores`` ``[B, Hkv, G*S, n]`` of slots ``start:stop`` with the mask applied."""
    b, hkv, gs, n = scores.shape
    if mask is None:
        first_query = total - s  # slot of query 0; query i sees slots <= first_query + i
        if s == 1 or stop - 1 <= first_query:
            return scores
        slots = torch.arange(start, stop, device=scores.device)  # [n]
        queries = torch.arange(s, device=scores.device)
        allowed = slots[None, :] <= first_query + queries[:, None]  # [S, n]
        grouped = scores.view(b, hkv, gs // s, s, n)
        return grouped.masked_fill(~allowed, float("-inf")).view(b, hkv, gs, n)
    part = mask[..., start:stop]  # [B or 1, 1, S, n]
    grouped = scores.view(b, hkv, gs // s, s, n)
    part = part[:, :, None]  # [B or 1, 1, 1, S, n]
    if part.dtype == torch.bool:
        grouped = grouped.masked_fill(~part, float("-inf"))
    else:
        grouped = grouped + part.float()
    return grouped.reshape(b, hkv, gs, n)
