"""Packed KV pages described to the compiled attention kernels (:mod:`lowbit.kv.native`; on
CUDA the Triton ones of :mod:`lowbit.kv.triton_decode` read the same descriptors).

:func:`page_descriptor` reads integer pages (:class:`~lowbit.kv.int_quant.IntPackedKV`: per
token or per channel, any bits, integer zero points, fp16 minima or symmetric) and KVQuant pages
(:class:`~lowbit.kv.kvquant.KVQuantPackedKV`: shared or per-channel codebooks, per-token or
per-channel ranges, sparse outliers); other formats (K-sort + BFP) return None, and attention
then takes the torch path. A descriptor points into the page's tensors: keep them (returned
beside it) alive while the kernels run.

Descriptors are kept per page object for as long as the page lives: a page object's tokens
never change (a join, a cut, a batch selection or a token written into an open page's room makes
a new object), so a decode step describes only the page that changed since the last (its open
page), not every page of the cache.
"""

from __future__ import annotations

import ctypes
import weakref

from torch import Tensor

import lowbit.kv.native as native
from lowbit.kv.int_quant import IntPackedKV
from lowbit.kv.kvquant import KVQuantPackedKV
from lowbit.kv.quantizer import PackedKV

__all__ = ["page_descriptor", "page_array"]


def _stat(t: Tensor | None) -> native.Stat:
    """A statistic ``[B, H, T/tg, D/cg]`` (or ``[H, D]``: per channel, shared by every token)."""
    s = native.Stat()
    if t is None:
        return s
    s.data, s.dtype = t.data_ptr(), native.STAT_DTYPES[t.dtype]
    if t.dim() == 2:  # [H, D]: no batch or token axis
        s.stride[:] = [0, t.stride(0), 0, t.stride(1)]
    else:
        s.stride[:] = list(t.stride())
    return s


#: id of a described page -> (weak reference to it, its descriptor, the tensors it points into)
_described: dict[int, tuple[weakref.ref, native.Page, list[Tensor]]] = {}


def page_descriptor(page: PackedKV) -> tuple[native.Page, list[Tensor]] | None:
    """``page`` as the kernels read it, and the tensors that must stay alive while they do;
    None for a format or layout the kernels do not read (attention then takes the torch path)."""
    key = id(page)
    entry = _described.get(key)
    if entry is not None and entry[0]() is page:
        return entry[1], entry[2]
    room = page.room
    described = _describe(page) if room is None else _room_page(page, room)
    if described is not None:
        _remember(_described, key, page, described)
    return described


def _remember(table: dict, key: int, owner, value: tuple) -> None:
    """``table[key] = (weak reference to owner, *value)``, dropped when ``owner`` goes."""

    def forget(ref: weakref.ref, key: int = key) -> None:
        if table.get(key, (None,))[0] is ref:
            del table[key]

    table[key] = (weakref.ref(owner, forget), *value)


#: id of an open page's room -> (weak reference to it, the descriptor of one of its pages, the
#: tensors it points into, the room's layout then)
_rooms: dict[int, tuple] = {}


def _room_page(page: PackedKV, room) -> tuple[native.Page, list[Tensor]] | None:
    """A page of an open page's room: the room's descriptor copied with this page's token
    count, described anew when the room's layout (``room.layout()``: where its buffers that may
    move are) is not the described one."""
    layout = room.layout()
    entry = _rooms.get(id(room))
    if entry is None or entry[0]() is not room or entry[3] != layout:
        described = _describe(page)
        if described is None:
            return None
        _remember(_rooms, id(room), room, (*described, layout))
        entry = _rooms[id(room)]
    desc = native.Page.from_buffer_copy(entry[1])
    desc.tokens = page.num_tokens
    return desc, entry[2]


def _describe(page: PackedKV) -> tuple[native.Page, list[Tensor]] | None:
    b, h, t, d = page.shape
    if not isinstance(page, (IntPackedKV, KVQuantPackedKV)):
        return None
    if d > native.MAX_DIM or page.codes is None:  # on the page's device (C: CPU; Triton: CUDA)
        return None
    codes = page.codes
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    keep = [codes]
    desc = native.Page(batch=b, heads=h, tokens=t, dim=d, codes=codes.data_ptr())
    desc.code_stride[:] = list(codes.stride()[:3])
    if isinstance(page, IntPackedKV):
        stats = [page.scale, page.zero, page.minimum]
        if any(s is not None and s.dtype not in native.STAT_DTYPES for s in stats):
            return None
        desc.bits = page.bits
        desc.level_bias = -float(2 ** (page.bits - 1)) if page.symmetric else 0.0
        desc.token_group, desc.channel_group = page.token_group, page.channel_group
        desc.scale, desc.zero, desc.offset = (_stat(s) for s in stats)
        keep += [s for s in stats if s is not None]
    else:
        q = page.quantizer
        levels = q.codebook.float().contiguous()  # [2**bits] or [H*D, 2**bits]
        desc.bits, desc.levels = q.bits, levels.data_ptr()
        desc.levels_per_channel = int(levels.dim() == 2)
        if page.center is None:  # per-channel ranges [H, D]
            half, center = q.half_range, q.center
            desc.token_group, desc.channel_group = 1, 1
        else:  # per-token ranges [B, H, T, 1]
            half, center = page.half_range, page.center
            desc.token_group, desc.channel_group = 1, d
        if half.dtype not in native.STAT_DTYPES or center.dtype not in native.STAT_DTYPES:
            half, center = half.float(), center.float()
        desc.scale, desc.offset = _stat(half), _stat(center)
        keep += [levels, half, center]
        if page.col_val.numel():
            row_ptr, col_val = page.row_ptr.contiguous(), page.col_val.contiguous()
            desc.row_ptr, desc.col_val = row_ptr.data_ptr(), col_val.data_ptr()
            keep += [row_ptr, col_val]
    return desc, keep


def page_array(pages: list[native.Page], starts: list[int]) -> tuple[ctypes.Array, ctypes.Array]:
    """``pages`` and the slot of each one's first token as the C arrays the kernels take."""
    return (native.Page * len(pages))(*pages), (ctypes.c_int64 * len(starts))(*starts)
