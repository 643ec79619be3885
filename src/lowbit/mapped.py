"""Pages of memory-mapped weight files that a process no longer reads, given back.

A checkpoint loads memory-mapped (safetensors, through transformers): each stored tensor the
model keeps as it is (packed codes, scales) is a view of the file's mapping, and its pages count
in the resident set once read. Two kinds of pages stay resident for nothing:

* those of tensors that were converted as they loaded (an fp32 embedding run in bf16): the copy
  is what the model holds, the mapping stays alive for the other tensors;
* those of packed layers swapped for their run form (:mod:`lowbit.nn.run_linear`): the kernel's
  layout is a copy, the packed buffers are released, the mapping stays alive for the layers
  not swapped yet.

:func:`release_pages` drops such pages from the resident set with ``madvise(MADV_DONTNEED)``,
only *clean* ones: pages of a file mapping that hold what the file holds (``/proc/self/pagemap``
says they are file pages, not private copies made by a write). Dropping a clean page never
changes what the process reads: the next read faults it in again from the file. So a call is
at worst wasted work, never a wrong value. Elsewhere than Linux (or where ``/proc`` cannot be
read) nothing is released.

:func:`discard_tail` is the one exception to "never a wrong value", for memory the process
allocated itself: the tail of a large buffer whose contents its owner will not read again
(GPTQ's float64 factor, once rewritten as float32 into its first half) is given back at once
instead of when the buffer is freed.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FileMapping", "discard_tail", "file_mappings", "release_pages", "release_unused_pages"]

_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_FILE_PAGE = 1 << 61  # pagemap: a file page or shared anonymous page (not a private copy)
_SWAPPED = 1 << 62
_PRESENT = 1 << 63


@dataclass(frozen=True)
class FileMapping:
    start: int
    end: int
    path: str


def file_mappings(suffix: str = ".safetensors") -> list[FileMapping]:
    """This process's mappings of files whose name ends in ``suffix`` (none off Linux)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    mappings = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].rstrip("\n").endswith(suffix):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            mappings.append(FileMapping(start, end, parts[5].rstrip("\n")))
    return mappings


def _byte_range(tensor: Tensor) -> tuple[int, int]:
    """[start, end) of the bytes ``tensor`` itself reads (a view: not its whole storage)."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    span = 1 + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, start + span * tensor.element_size()


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` less every byte of ``holes`` (both lists of [start, end))."""
    out = []
    holes = sorted(holes)
    for start, end in sorted(ranges):
        for hole_start, hole_end in holes:
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                out.append((start, hole_start))
            start = max(start, hole_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


# below this a buffer may share its pages with others in glibc's heap; above glibc's largest
# mmap threshold (32 MB) each buffer is a mapping of its own
_OWN_MAPPING_BYTES = 64 << 20


def discard_tail(tensor: Tensor, keep_bytes: int) -> int:
    """Give back the pages of ``tensor``'s storage (CPU memory this process allocated, not a
    file mapping) beyond its first ``keep_bytes``; returns the bytes given back.

    The caller promises never to read those bytes again: a read would see zeros. Storages
    under 64 MB, not on the CPU, or outside Linux are left alone (returns 0).
    """
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or storage.nbytes() < _OWN_MAPPING_BYTES:
        return 0
    madvise = _libc_madvise()
    if madvise is None:
        return 0
    base = storage.data_ptr()
    first = -(-(base + keep_bytes) // _PAGE) * _PAGE
    end = (base + storage.nbytes()) // _PAGE * _PAGE
    if end <= first or madvise(first, end - first, _MADV_DONTNEED) != 0:
        return 0
    return end - first


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _drop_clean_pages(start: int, end: int, pagemap, madvise) -> int:
    """Drop the clean pages of [start, end) (page-aligned inward); returns the resident bytes
    dropped."""
    first = -(-start // _PAGE)
    last = end // _PAGE
    if last <= first:
        return 0
    pagemap.seek(first * 8)
    entries = torch.frombuffer(bytearray(pagemap.read((last - first) * 8)), dtype=torch.int64)
    present = entries < 0  # bit 63
    file_page = (entries >> 61) & 1 == 1
    swapped = (entries >> 62) & 1 == 1
    private = (present & ~file_page) | swapped  # a written copy: the file does not hold it
    clean = torch.cat([torch.zeros(1, dtype=torch.int8), (~private).to(torch.int8),
                       torch.zeros(1, dtype=torch.int8)])  # fmt: skip
    edges = clean[1:] - clean[:-1]
    run_starts = (edges == 1).nonzero().flatten().tolist()
    run_ends = (edges == -1).nonzero().flatten().tolist()
    resident = torch.cat([torch.zeros(1, dtype=torch.int64), present.cumsum(0)]).tolist()
    dropped = 0
    for begin, stop in zip(run_starts, run_ends, strict=True):
        pages = resident[stop] - resident[begin]
        if pages and madvise((first + begin) * _PAGE, (stop - begin) * _PAGE, _MADV_DONTNEED) == 0:
            dropped += pages * _PAGE
    return dropped


def release_pages(tensors: Iterable[Tensor], *, keep: Iterable[Tensor] = ()) -> int:
    """Drop from the resident set the clean file-mapped pages that lie wholly inside the storage
    of ``tensors`` and outside that of ``keep``; returns the resident bytes dropped.

    Call it for tensors the program is done with (a packed layer swapped for its run form):
    their pages are read again from the file if they are ever read. Tensors not in a file
    mapping are left alone.
    """
    mappings = file_mappings()
    madvise = _libc_madvise()
    if not mappings or madvise is None:
        return 0
    ranges = []
    for tensor in tensors:
        if tensor is None or tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        start, end = _byte_range(tensor)
        for mapping in mappings:
            if mapping.start <= start < mapping.end:
                ranges.append((start, min(end, mapping.end)))
                break
    if not ranges:
        return 0
    holes = [_byte_range(t) for t in keep if t is not None and t.device.type == "cpu"]
    return _drop(_subtract(ranges, holes), madvise)


def release_unused_pages(in_use: Iterable[Tensor]) -> int:
    """In every file mapping that holds one of ``in_use`` (a model's tensors: its checkpoint's
    files), drop the clean pages that none of ``in_use`` lies on; returns the bytes dropped.

    What a model converted as it loaded (an fp32 tensor it holds in bf16) is then no longer
    resident twice.
    """
    mappings = file_mappings()
    madvise = _libc_madvise()
    if not mappings or madvise is None:
        return 0
    used = [_byte_range(t) for t in in_use if t is not None and t.device.type == "cpu"]
    holding = [m for m in mappings if any(m.start <= start < m.end for start, _ in used)]
    return _drop(_subtract([(m.start, m.end) for m in holding], used), madvise)


def _drop(ranges: list[tuple[int, int]], madvise) -> int:
    if not ranges:
        return 0
    try:
        pagemap = open("/proc/self/pagemap", "rb", buffering=0)
    except OSError:  # cannot tell clean pages from private copies: drop nothing
        return 0
    with pagemap:
        return sum(_drop_clean_pages(start, end, pagemap, madvise) for start, end in ranges)
