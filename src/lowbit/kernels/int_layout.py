"""The tiled int32 layout lowbit's Triton integer kernels read (pure torch, no Triton).

The checkpoint keeps the canonical bit stream (:mod:`lowbit.formats.packing`); the ``triton``
backend converts it once per layer and device to this layout.

**Words.** A row of ``K`` unsigned ``b``-bit codes is cut into *tiles* of ``TILE_K = PPW *
TILE_WORDS`` codes, ``PPW = 32 // b`` codes per int32 word (16, 10, 8, 4 for 2, 3, 4, 8 bits)
and ``TILE_WORDS`` (32 or 16) words per tile. Within a tile, slot ``j`` (bits ``[j*b,
(j+1)*b)``) of word ``i`` holds code ``j * TILE_WORDS + i``: slot ``j`` of the tile's words is
the contiguous run of codes ``[j * TILE_WORDS, (j + 1) * TILE_WORDS)``. The row is padded with
zero codes to whole tiles; the kernels mask the activations beyond ``K`` so padding adds 0.

Why this order:

* A kernel loads a tile as one ``[rows, TILE_WORDS]`` block of whole int32 words (128 or 64
  contiguous bytes per row, coalesced, vectorised) and decodes slot ``j`` with one shift and one
  mask for the whole block: ``(words >> j*b) & (2**b - 1)`` is a ``[rows, TILE_WORDS]`` tile of
  codes for a contiguous run of ``K``, in the same register layout as the words. No reshape,
  no gather, no layout conversion; the matching activations are one contiguous load.
* A slot's run lies inside one quantization group whenever ``TILE_WORDS`` divides the group
  size, so each slot needs one scale (and zero) per row: a ``[rows]`` vector, not a per-code
  gather, and the small-batch kernel can apply it after the dot product.
* **3 bits**: ten codes per word in bits 0-29, bits 30-31 unused (3.2 bits per code, +6.7%
  bytes). No code straddles a word, so every thread's load is whole words it decodes alone, with
  the same shift-and-mask as 2/4/8 bits (one kernel for all four widths). The alternatives were
  worse at decode: 32 codes in three words (codes 10 and 21 straddle; a thread needs all three
  words and two extra shift/or per straddling code) or bit-planes (a 2-bit and a 1-bit plane,
  exactly 3.0 bits, but two loads, two shifts, two masks and an or per code). On an H100 a
  3-bit GEMV at full bandwidth must decode ~8e12 codes/s against ~3.3e13 instructions/s, a
  budget of about 4 per code: the decode loop is issue-bound already (shift, mask, or-magic,
  plus the fadd and ffma every layout needs), so 3 more instructions per code would cost far
  more than 6.7% more bytes.
* Codes become floats with the exponent trick ``float_bits(code | 0x4B000000) - 2**23 = code``
  (exact, full-rate integer ops; int-to-float conversion runs at 1/4-1/8 rate on NVIDIA SMs).

``TILE_WORDS`` is 32 where 32 divides the group size (or per channel) and padding does not grow,
else 16 (groups of 16, or rows like K = 576 at 4 bits: 640 codes instead of 768).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lowbit.errors import LowbitError

__all__ = [
    "KERNEL_BITS",
    "codes_per_word",
    "tile_words",
    "tiled_row_words",
    "pack_tiles",
    "unpack_tiles",
]

#: code widths the tiled layout (and the Triton kernels) take
KERNEL_BITS = (2, 3, 4, 8)
_TILE_WORDS = (32, 16)


def codes_per_word(bits: int) -> int:
    """Codes per int32 word: ``32 // bits`` (ten for 3 bits, two bits unused)."""
    if bits not in KERNEL_BITS:
        raise LowbitError(f"the tiled int32 layout holds 2, 3, 4 or 8-bit codes, not {bits}")
    return 32 // bits


def tile_words(k: int, bits: int, group_size: int | None) -> int | None:
    """Words per tile for a row of ``k`` codes: 32 or 16, the one that divides the group size
    with the fewest padded codes (32 on a tie); None if neither divides the group size."""
    ppw = codes_per_word(bits)
    fits = [w for w in _TILE_WORDS if group_size is None or group_size % w == 0]
    if not fits:
        return None
    return min(fits, key=lambda w: (math.ceil(k / (ppw * w)) * ppw * w, -w))


def tiled_row_words(k: int, bits: int, tile: int) -> int:
    """int32 words per row: ``ceil(k / TILE_K) * TILE_WORDS``."""
    return math.ceil(k / (codes_per_word(bits) * tile)) * tile


def pack_tiles(codes: Tensor, bits: int, tile: int) -> Tensor:
    """``[N, K]`` unsigned codes -> ``[N, W]`` int32 words in the tiled layout (module doc)."""
    if codes.dim() != 2:
        raise LowbitError(f"codes must be [N, K], got shape {tuple(codes.shape)}")
    ppw = codes_per_word(bits)
    n, k = codes.shape
    words = tiled_row_words(k, bits, tile)
    padded = torch.zeros(n, words * ppw, dtype=torch.int64, device=codes.device)
    padded[:, :k] = codes  # [N, Kp]
    slots = padded.view(n, words // tile, ppw, tile)  # [N, tiles, slot j, word i]
    shifts = torch.arange(ppw, device=codes.device, dtype=torch.int64).view(1, 1, ppw, 1) * bits
    packed = (slots << shifts).sum(2)  # [N, tiles, TILE_WORDS], disjoint bits: sum == or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # uint32 -> int32 bits
    return packed.to(torch.int32).view(n, words)


def unpack_tiles(words: Tensor, bits: int, k: int, tile: int) -> Tensor:
    """Inverse of :func:`pack_tiles`: ``[N, W]`` int32 -> ``[N, K]`` uint8 codes."""
    ppw = codes_per_word(bits)
    n, w = words.shape
    if words.dtype != torch.int32 or w != tiled_row_words(k, bits, tile):
        raise LowbitError(
            f"expected [N, {tiled_row_words(k, bits, tile)}] int32 words for K={k}, "
            f"{bits} bits, got {tuple(words.shape)} {words.dtype}"
        )
    tiles = (words.to(torch.int64) & 0xFFFFFFFF).view(n, w // tile, 1, tile)  # [N, t, 1, i]
    shifts = torch.arange(ppw, device=words.device, dtype=torch.int64).view(1, 1, ppw, 1) * bits
    codes = (tiles >> shifts) & ((1 << bits) - 1)  # [N, tiles, slot j, word i]
    return codes.reshape(n, -1)[:, :k].to(torch.uint8)


def check_operands(
    x: Tensor,
    words: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    bias: Tensor | None,
    bits: int,
    group_size: int | None,
    tile: int,
) -> tuple[int, int, int]:
    """``(M, N, K)`` of a kernel call, after checking every operand (one sentence if wrong).

    Args:
        x: ``[M, K]`` fp16 or bf16 activations.
        words: ``[N, W]`` int32 in the tiled layout of ``K`` codes of ``bits`` bits.
        scale: ``[G, N]`` float scales (``G = K // group_size``, 1 per channel).
        zero: ``[G, N]`` uint8 zero points, or None (symmetric: codes minus ``2**(bits-1)``).
        bias: ``[N]`` in ``x``'s dtype, or None.
    """
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise LowbitError(f"x must be [M, K] fp16 or bf16, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if tile not in _TILE_WORDS:
        raise LowbitError(f"tiles have 32 or 16 words, not {tile}")
    row_words = tiled_row_words(k, bits, tile)
    if words.dim() != 2 or words.dtype != torch.int32 or words.shape[1] != row_words:
        raise LowbitError(
            f"words must be [N, {row_words}] int32 for K={k} at {bits} bits, got "
            f"{tuple(words.shape)} {words.dtype}"
        )
    n = words.shape[0]
    if group_size is not None and (group_size % tile or k % group_size):
        raise LowbitError(f"group size {group_size} must divide K={k} and be a multiple of {tile}")
    groups = 1 if group_size is None else k // group_size
    if scale.shape != (groups, n) or not scale.dtype.is_floating_point:
        raise LowbitError(f"scale must be [{groups}, {n}] float, got {tuple(scale.shape)}")
    if zero is not None and (zero.shape != (groups, n) or zero.dtype != torch.uint8):
        raise LowbitError(f"zero must be [{groups}, {n}] uint8, got {tuple(zero.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise LowbitError(f"bias must be [{n}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    devices = {t.device for t in (x, words, scale, zero, bias) if t is not None}
    if len(devices) != 1:
        raise LowbitError(f"every operand must be on one device, got {sorted(map(str, devices))}")
    return m, n, k


def tiled_reference(
    x: Tensor,
    words: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    bias: Tensor | None,
    bits: int,
    group_size: int | None,
    tile: int,
) -> Tensor:
    """``x @ Wᵀ + bias`` decoded from the tiled layout in fp32: the kernels' torch reference.

    Reads ``N * W * 4`` bytes of words, ``G * N`` scales (and zeros) and ``M * K`` activations
    once, writes ``M * N``; the kernels move the same bytes without the fp32 weight in between.
    Returns ``[M, N]`` in ``x``'s dtype.
    """
    m, n, k = check_operands(x, words, scale, zero, bias, bits, group_size, tile)
    group = group_size or k
    codes = unpack_tiles(words, bits, k, tile).float().view(n, k // group, group)  # [N, G, g]
    offset = 2.0 ** (bits - 1) if zero is None else zero.t().float().unsqueeze(-1)
    w = ((codes - offset) * scale.t().float().unsqueeze(-1)).view(n, k)  # [N, K] fp32
    out = x.float() @ w.t()  # [M, N] fp32
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
