"""Bit packing: unsigned b-bit codes (1 <= b <= 8) into uint8 or int32 words, and back.

Plain order is a little-endian bit stream along the last axis: element ``i`` of a row occupies
stream bits ``[i*b, (i+1)*b)``, bit 0 of the stream being bit 0 of the first byte. uint8 words
are the stream's bytes; int32 words are its 4-byte little-endian chunks. Rows are padded with
zero bits to a whole number of words, so every row starts on a word boundary. This works for
every width, 3, 5, 6 and 7 included (codes then straddle word boundaries).

Interleaved orders are for widths that divide the word (1, 2, 4, 8 bits): within each word of
``k = word_bits // b`` elements, slot ``j`` of the word holds element ``order[j]`` of that
word's run of ``k`` elements. ``order="interleaved"`` puts the even elements in the low slots
and the odd ones in the high slots (``[0, 2, 4, 6, 1, 3, 5, 7]`` for 4 bits in int32, the order
used by AWQ-style int4 kernels, which unpack two fp16 halves at once); any permutation of
``range(k)`` may be given explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lowbit.errors import LowbitError

__all__ = ["pack_bits", "unpack_bits", "packed_words_per_row", "interleave_permutation"]

_WORD_BITS = {"uint8": 8, "int32": 32}


def _check(bits: int, word: str) -> int:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise LowbitError(f"bits must be an integer in 1..8, got {bits!r}")
    if word not in _WORD_BITS:
        raise LowbitError(f"word must be 'uint8' or 'int32', got {word!r}")
    return _WORD_BITS[word]


def packed_words_per_row(n: int, bits: int, word: str = "uint8") -> int:
    """Number of words that hold ``n`` codes of ``bits`` bits (the row padded to a word)."""
    word_bits = _check(bits, word)
    return math.ceil(n * bits / word_bits)


def interleave_permutation(bits: int, word: str = "int32", order="interleaved") -> list[int]:
    """The slot → element permutation inside one word (see module docstring)."""
    word_bits = _check(bits, word)
    if word_bits % bits:
        raise LowbitError(f"an interleaved order needs bits dividing {word_bits}, got bits={bits}")
    k = word_bits // bits
    if isinstance(order, str):
        if order == "plain":
            return list(range(k))
        if order == "interleaved":
            return list(range(0, k, 2)) + list(range(1, k, 2))
        raise LowbitError(f"order must be 'plain', 'interleaved' or a permutation, got {order!r}")
    perm = [int(i) for i in order]
    if sorted(perm) != list(range(k)):
        raise LowbitError(f"order must be a permutation of range({k}), got {order!r}")
    return perm


def _bytes_from_codes(codes: Tensor, bits: int) -> Tensor:
    """[rows, n] integer codes → [rows, ceil(n*bits/8)] uint8 little-endian bit stream (never
    a view of ``codes``)."""
    src_ptr = codes.data_ptr()
    rows, n = codes.shape
    if 8 % bits == 0:  # fast path: whole codes per byte, stays in uint8
        k = 8 // bits
        codes = codes.to(torch.uint8).contiguous()
        if n % k:
            padded = torch.zeros(rows, math.ceil(n / k) * k, dtype=torch.uint8, device=codes.device)
            padded[:, :n] = codes
            codes = padded
        if k == 1:
            if codes.data_ptr() == src_ptr:
                return codes.clone(memory_format=torch.contiguous_format)
            return codes
        slots = codes.view(rows, -1, k)  # [rows, bytes, k]
        out = slots[..., k - 1] << ((k - 1) * bits)  # [rows, bytes], one pass per slot
        for j in range(k - 2, 0, -1):
            out |= slots[..., j] << (j * bits)
        out |= slots[..., 0]
        return out
    codes = codes.to(torch.int64)
    chunk_elems = math.lcm(bits, 8) // bits  # elements per whole-byte chunk (<= 8)
    chunk_bytes = chunk_elems * bits // 8  # <= 7 bytes, fits in int64
    n_chunks = math.ceil(n / chunk_elems)
    padded = torch.zeros(rows, n_chunks * chunk_elems, dtype=torch.int64, device=codes.device)
    padded[:, :n] = codes
    padded = padded.view(rows, n_chunks, chunk_elems)  # [rows, chunks, chunk_elems]
    shifts = torch.arange(chunk_elems, device=codes.device, dtype=torch.int64) * bits
    chunk = (padded << shifts).sum(-1, keepdim=True)  # [rows, chunks, 1], disjoint bits
    byte_shifts = torch.arange(chunk_bytes, device=codes.device, dtype=torch.int64) * 8
    out = ((chunk >> byte_shifts) & 0xFF).to(torch.uint8)  # [rows, chunks, chunk_bytes]
    return out.view(rows, -1)[:, : math.ceil(n * bits / 8)]


def _codes_from_bytes(data: Tensor, bits: int, n: int) -> Tensor:
    """[rows, n_bytes] uint8 stream → [rows, n] integer codes (uint8 for 1/2/4/8 bits, int32
    for 3 and 6, int64 otherwise): the narrowest integers that hold a whole-byte chunk, since a
    decode step of a packed KV cache unpacks every cached token."""
    rows, n_bytes = data.shape
    if 8 % bits == 0:  # whole codes per byte: shifts and a mask in uint8
        k = 8 // bits
        if k == 1:
            return data[:, :n]
        if n_bytes % 4 == 0 and data.is_contiguous():  # shifts on int32 words: vectorized
            words = data.view(torch.int32)  # [rows, n_bytes / 4]
            mask = ((1 << bits) - 1) * 0x01010101  # the slot's bits in each of the 4 bytes
            slots = [((words >> (j * bits)) & mask).view(torch.uint8) for j in range(k)]
            return torch.stack(slots, -1).view(rows, -1)[:, :n]  # [rows, n_bytes * k]
        shifts = torch.arange(k, device=data.device, dtype=torch.uint8) * bits
        codes = (data.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, n_bytes, k]
        return codes.view(rows, -1)[:, :n]
    if bits in (3, 6) and n_bytes % 3 == 0 and n % (24 // bits) == 0:  # 3-byte chunks in int32
        chunks = data.reshape(rows, n_bytes // 3, 3).to(torch.int32)  # [rows, chunks, 3]
        word = chunks[..., 0] | (chunks[..., 1] << 8) | (chunks[..., 2] << 16)
        shifts = torch.arange(24 // bits, device=data.device, dtype=torch.int32) * bits
        codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, chunks, 24/bits]
        return codes.view(rows, -1)[:, :n]
    chunk_elems = math.lcm(bits, 8) // bits
    chunk_bytes = chunk_elems * bits // 8
    n_chunks = math.ceil(n / chunk_elems)
    padded = torch.zeros(rows, n_chunks * chunk_bytes, dtype=torch.int64, device=data.device)
    take = min(n_bytes, n_chunks * chunk_bytes)
    padded[:, :take] = data[:, :take].to(torch.int64)
    padded = padded.view(rows, n_chunks, chunk_bytes)  # [rows, chunks, chunk_bytes]
    byte_shifts = torch.arange(chunk_bytes, device=data.device, dtype=torch.int64) * 8
    chunk = (padded << byte_shifts).sum(-1, keepdim=True)  # [rows, chunks, 1]
    shifts = torch.arange(chunk_elems, device=data.device, dtype=torch.int64) * bits
    codes = (chunk >> shifts) & ((1 << bits) - 1)  # [rows, chunks, chunk_elems]
    return codes.view(rows, -1)[:, :n]


def pack_bits(
    codes: Tensor,
    bits: int,
    *,
    word: str = "uint8",
    order: str | Sequence[int] = "plain",
    check_range: bool = True,
) -> Tensor:
    """Pack unsigned codes along the last axis.

    Args:
        codes: integer tensor ``[..., n]`` with values in ``[0, 2**bits - 1]``.
        bits: code width, 1..8.
        word: ``"uint8"`` or ``"int32"``.
        order: ``"plain"``, ``"interleaved"`` or an explicit in-word permutation (see module doc).
        check_range: verify the codes lie in range (one extra pass over ``codes``); callers that
            produced the codes by clamping may pass False. Out-of-range codes then corrupt
            their neighbours' bits.

    Returns:
        ``[..., ceil(n * bits / word_bits)]`` tensor of dtype uint8 or int32.
    """
    word_bits = _check(bits, word)
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise LowbitError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0:
        raise LowbitError("codes must have at least one dimension")
    lead, n = codes.shape[:-1], codes.shape[-1]
    flat = codes.reshape(-1, n)  # [rows, n]
    if check_range and flat.numel():
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0 or int(hi) >= (1 << bits):
            raise LowbitError(f"codes must lie in [0, {(1 << bits) - 1}] for bits={bits}")
    perm = None if order == "plain" else interleave_permutation(bits, word, order)
    if perm is not None:
        k = word_bits // bits
        n_pad = math.ceil(n / k) * k
        padded = torch.zeros(flat.shape[0], n_pad, dtype=flat.dtype, device=flat.device)
        padded[:, :n] = flat
        flat = padded.view(-1, n_pad // k, k)[:, :, perm].reshape(-1, n_pad)
    stream = _bytes_from_codes(flat, bits)  # [rows, n_bytes]
    n_words = packed_words_per_row(n, bits, word)
    if word == "uint8":
        return stream[:, :n_words].reshape(*lead, n_words)
    out = torch.zeros(stream.shape[0], n_words * 4, dtype=torch.uint8, device=stream.device)
    out[:, : stream.shape[1]] = stream
    # little-endian 4-byte words, assembled arithmetically so the result is host-order free
    out = out.view(-1, n_words, 4).to(torch.int64)
    word_vals = out[..., 0] | (out[..., 1] << 8) | (out[..., 2] << 16) | (out[..., 3] << 24)
    word_vals = torch.where(word_vals >= 2**31, word_vals - 2**32, word_vals)
    return word_vals.to(torch.int32).reshape(*lead, n_words)


def unpack_bits(
    packed: Tensor, bits: int, n: int, *, word: str = "uint8", order: str | Sequence[int] = "plain"
) -> Tensor:
    """Inverse of :func:`pack_bits`.

    Args:
        packed: ``[..., n_words]`` uint8 or int32 words.
        bits: code width, 1..8.
        n: number of codes per row to recover.
        word, order: as given to :func:`pack_bits`.

    Returns:
        ``[..., n]`` uint8 codes.
    """
    word_bits = _check(bits, word)
    expected = {"uint8": torch.uint8, "int32": torch.int32}[word]
    if packed.dtype != expected:
        raise LowbitError(
            f"packed must have dtype {expected} for word={word!r}, got {packed.dtype}"
        )
    if packed.shape[-1] != packed_words_per_row(n, bits, word):
        raise LowbitError(
            f"packed rows have {packed.shape[-1]} words, expected "
            f"{packed_words_per_row(n, bits, word)} for n={n}, bits={bits}"
        )
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, packed.shape[-1])
    if word == "int32":
        w = flat.to(torch.int64) & 0xFFFFFFFF  # [rows, n_words]
        shifts = torch.arange(4, device=w.device, dtype=torch.int64) * 8
        flat = ((w.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(w.shape[0], -1)
    perm = None if order == "plain" else interleave_permutation(bits, word, order)
    if perm is None:
        codes = _codes_from_bytes(flat, bits, n)
    else:
        k = word_bits // bits
        n_pad = math.ceil(n / k) * k
        slots = _codes_from_bytes(flat, bits, n_pad).view(-1, n_pad // k, k)
        inverse = [0] * k
        for slot, elem in enumerate(perm):
            inverse[elem] = slot
        codes = slots[:, :, inverse].reshape(-1, n_pad)[:, :n]
    return codes.to(torch.uint8).reshape(*lead, n)
