"""llama.cpp's 32-weight block grids (Q8_0, Q5_0, Q4_0, Q5_1, Q4_1, IQ4_NL) as a weight format.

A weight ``[out, in]`` is cut along ``in`` into blocks of 32. Each block stores an fp16 scale
``d``, for the affine types an fp16 minimum ``m``, and one code per weight naming a level of the
type's grid; the value is ``d * level`` (symmetric types, IQ4_NL's codebook) or ``d * level +
m`` (Q5_1, Q4_1), computed in fp32 as llama.cpp and the ``gguf`` package's reader do. Because
the levels are small integers and ``d`` is fp16, ``d * level`` is exact in fp32, so the
dequantized weight here equals the reader's bit for bit.

:class:`GGUFQuantized` is the container (codes, scales, minimums; ``dequantize``,
``storage_bits``, ``to_blocks``: llama.cpp's byte layout). Choosing the scale of a block
(:func:`fit_block_scales`) and rounding onto a fitted grid (:func:`round_to_grid`) are separate,
so RTN fits and rounds in one go and GPTQ fits a block's grid when it reaches the block, then
rounds column by column (:mod:`lowbit.algorithms.gguf_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lowbit.errors import LowbitError

__all__ = [
    "BLOCK",
    "BLOCK_TYPES",
    "BlockType",
    "GGUFQuantized",
    "block_type",
    "fit_block_scales",
    "round_to_grid",
]

BLOCK = 32
#: IQ4_NL's 16 non-uniform levels (llama.cpp's ``kvalues_iq4nl``)
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockType:
    """One 32-weight llama.cpp type.

    Attributes:
        name: llama.cpp's name ("Q4_0").
        levels: the grid's levels in code order (code ``c`` means ``levels[c]``).
        affine: ``d * level + m`` with an fp16 minimum (Q5_1, Q4_1); else ``d * level``.
        bytes_per_block: llama.cpp's block size in bytes (scale, minimum, codes).
    """

    name: str
    levels: tuple[int, ...]
    affine: bool
    bytes_per_block: int

    @property
    def bits_per_weight(self) -> float:
        return self.bytes_per_block * 8 / BLOCK

    def level_tensor(self, device=None) -> Tensor:
        """[L] fp32 levels in code order."""
        return torch.tensor(self.levels, dtype=torch.float32, device=device)


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("Q8_0", tuple(range(-128, 128)), False, 2 + 32),
        BlockType("Q5_0", tuple(range(-16, 16)), False, 2 + 4 + 16),
        BlockType("Q4_0", tuple(range(-8, 8)), False, 2 + 16),
        BlockType("Q5_1", tuple(range(32)), True, 2 + 2 + 4 + 16),
        BlockType("Q4_1", tuple(range(16)), True, 2 + 2 + 16),
        BlockType("IQ4_NL", IQ4_NL_LEVELS, False, 2 + 16),
    )
}


def block_type(name: str) -> BlockType:
    """The :class:`BlockType` called ``name`` (one LowbitError sentence otherwise)."""
    try:
        return BLOCK_TYPES[name.upper()]
    except KeyError:
        known = ", ".join(BLOCK_TYPES)
        raise LowbitError(f"unknown GGUF block type {name!r}; the types are {known}") from None


def round_to_grid(x: Tensor, kind: BlockType, scale: Tensor, minimum: Tensor | None):
    """Nearest level of each value under a fitted grid.

    Args:
        x: [..., n] fp32 values.
        scale: fp16-representable fp32 scales broadcasting against ``x`` (zero allowed).
        minimum: likewise, affine types only.

    Returns:
        ``(codes [..., n] int64, values [..., n] fp32)``; ``values`` is what llama.cpp decodes.
    """
    levels = kind.level_tensor(x.device)  # [L], increasing
    shifted = x - minimum if kind.affine else x
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    ratio = shifted / safe  # [..., n]
    mids = (levels[1:] + levels[:-1]) / 2  # [L - 1]
    codes = torch.bucketize(ratio.contiguous(), mids)  # [..., n] nearest level (ties up)
    values = levels[codes] * scale
    if kind.affine:
        values = values + minimum
    return codes, values


def _symmetric_candidates(blocks: Tensor, kind: BlockType, steps: int) -> Tensor:
    """[C, ..., nb, 1] candidate scales: the signed largest-magnitude weight mapped onto levels
    near the grid's end on its side (llama.cpp maps it onto the end itself)."""
    idx = blocks.abs().argmax(-1, keepdim=True)  # [..., nb, 1]
    extreme = blocks.gather(-1, idx)  # signed, [..., nb, 1]
    low, high = float(kind.levels[0]), float(kind.levels[-1])
    # targets from the negative end (llama.cpp's choice first) and from the positive end
    factors = torch.linspace(1.0, 0.8, steps, device=blocks.device)
    targets = torch.cat([low * factors, high * factors])  # [C]
    return extreme.unsqueeze(0) / targets.view(-1, *[1] * extreme.dim())


def _affine_candidates(blocks: Tensor, kind: BlockType, steps: int):
    """[C, ..., nb, 1] candidate (scale, minimum): the block's range shrunk from either end."""
    lo = blocks.amin(-1, keepdim=True)
    hi = blocks.amax(-1, keepdim=True)
    span = hi - lo
    top = float(kind.levels[-1])
    shrink = torch.linspace(0.0, 0.15, max(2, steps // 2), device=blocks.device)
    a, b = torch.meshgrid(shrink, shrink, indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)  # [C]
    shape = (-1, *[1] * lo.dim())
    low = lo.unsqueeze(0) + a.view(shape) * span.unsqueeze(0)
    high = hi.unsqueeze(0) - b.view(shape) * span.unsqueeze(0)
    return (high - low) / top, low


def fit_block_scales(
    blocks: Tensor, kind: BlockType, importance: Tensor | None = None, steps: int = 11
) -> tuple[Tensor, Tensor | None]:
    """Choose each block's fp16 scale (and minimum) by least (weighted) squared error.

    Candidates: the grid stretched so that the block's extreme lands on (or a little inside)
    the grid's end; for each, the codes it rounds to, then the least-squares scale (and
    minimum) of those codes, rounded to fp16; the candidate whose fp16 grid rounds the block
    with the smallest error wins. The first candidate is llama.cpp's own reference choice
    for the affine types, so a block already on an affine grid is found again.

    Args:
        blocks: [..., nb, 32] fp32 weights.
        importance: [..., nb, 32] non-negative weights of the squared error, or None.
        steps: candidates per end of the grid.

    Returns:
        ``(scale [..., nb, 1], minimum [..., nb, 1] or None)``, fp32 holding fp16 values.
    """
    w = torch.ones_like(blocks) if importance is None else importance
    if kind.affine:
        scales, mins = _affine_candidates(blocks, kind, steps)  # [C, ..., nb, 1]
    else:
        scales, mins = _symmetric_candidates(blocks, kind, steps), None
    best: list = [None, None, None]  # error [..., nb, 1], scale, minimum

    def consider(s: Tensor, m: Tensor | None) -> Tensor:
        """Keep (s, m) where it rounds a block with less error; the codes it rounds to."""
        codes, values = round_to_grid(blocks, kind, s, m)
        err = (w * (values - blocks).square()).sum(-1, keepdim=True)  # [..., nb, 1]
        if best[0] is None:
            best[:] = err, s, m
        else:
            better = err < best[0]
            best[0] = torch.where(better, err, best[0])
            best[1] = torch.where(better, s, best[1])
            if m is not None:
                best[2] = torch.where(better, m, best[2])
        return codes

    for c in range(scales.shape[0]):
        s = _fp16(scales[c])
        m = None if mins is None else _fp16(mins[c])
        codes = consider(s, m)
        consider(*_least_squares(blocks, w, kind, codes, s, m))  # refit for those codes
    return best[1], best[2]


def _fp16(x: Tensor) -> Tensor:
    return x.clamp(-65504.0, 65504.0).to(torch.float16).float()


def _least_squares(blocks, w, kind: BlockType, codes, s, m):
    """fp16 scale (and minimum) minimising the weighted error for fixed codes."""
    q = kind.level_tensor(blocks.device)[codes]  # [..., nb, 32]
    if not kind.affine:
        num = (w * q * blocks).sum(-1, keepdim=True)
        den = (w * q * q).sum(-1, keepdim=True)
        return _fp16(torch.where(den > 0, num / den.clamp_min(1e-30), s)), None
    sw = w.sum(-1, keepdim=True)
    sq = (w * q).sum(-1, keepdim=True)
    sqq = (w * q * q).sum(-1, keepdim=True)
    sx = (w * blocks).sum(-1, keepdim=True)
    sqx = (w * q * blocks).sum(-1, keepdim=True)
    det = sw * sqq - sq * sq
    ok = det.abs() > 1e-20 * (sw * sqq).abs().clamp_min(1e-30)
    safe = torch.where(ok, det, torch.ones_like(det))
    d = torch.where(ok, (sw * sqx - sq * sx) / safe, s)
    mn = torch.where(ok, (sqq * sx - sq * sqx) / safe, m)
    return _fp16(d), _fp16(mn)


@dataclass
class GGUFQuantized:
    """A weight on a 32-weight llama.cpp grid.

    Attributes:
        type_name: the :class:`BlockType`'s name.
        codes: [out, in] uint8 level indices.
        scale: [out, in / 32] fp16.
        minimum: [out, in / 32] fp16 (affine types) or None.
    """

    type_name: str
    codes: Tensor
    scale: Tensor
    minimum: Tensor | None = None

    @property
    def kind(self) -> BlockType:
        return block_type(self.type_name)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @classmethod
    def from_codes(cls, kind: BlockType, codes: Tensor, scale: Tensor, minimum: Tensor | None):
        """From [out, in] codes and [out, nb(, 1)] fp16-valued scales (and minimums)."""
        out, nb = codes.shape[0], codes.shape[1] // BLOCK
        return cls(
            kind.name,
            codes.to(torch.uint8),
            scale.reshape(out, nb).to(torch.float16),
            None if minimum is None else minimum.reshape(out, nb).to(torch.float16),
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """[out, in] weight as llama.cpp decodes it (fp32, then ``dtype``)."""
        out, n = self.codes.shape
        kind = self.kind
        levels = kind.level_tensor(self.codes.device)[self.codes.long()]  # [out, in]
        values = levels.view(out, -1, BLOCK) * self.scale.float().unsqueeze(-1)
        if kind.affine:
            values = values + self.minimum.float().unsqueeze(-1)
        values = values.reshape(out, n)
        return values if dtype is None else values.to(dtype)

    def storage_bits(self) -> int:
        out, n = self.codes.shape
        return out * (n // BLOCK) * self.kind.bytes_per_block * 8

    def to(self, device) -> GGUFQuantized:
        move = None if self.minimum is None else self.minimum.to(device)
        return GGUFQuantized(self.type_name, self.codes.to(device), self.scale.to(device), move)

    def to_blocks(self) -> np.ndarray:
        """llama.cpp's bytes: [out, in / 32 * bytes_per_block] uint8, rows in order."""
        kind = self.kind
        out, n = self.codes.shape
        nb = n // BLOCK
        codes = self.codes.cpu().numpy().reshape(out, nb, BLOCK)  # [out, nb, 32]
        parts = [self.scale.cpu().numpy().reshape(out, nb, 1).view(np.uint8)]  # [out, nb, 2]
        if kind.affine:
            parts.append(self.minimum.cpu().numpy().reshape(out, nb, 1).view(np.uint8))
        if kind.name == "Q8_0":
            parts.append((codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8))
        else:
            if len(kind.levels) == 32:  # fifth bits: bit j of a little-endian word
                high = (codes >> 4) & 1
                parts.append(np.packbits(high, axis=-1, bitorder="little"))  # [out, nb, 4]
            low = codes & 0x0F
            parts.append(low[..., :16] | (low[..., 16:] << 4))  # [out, nb, 16]
        blocks = np.concatenate(parts, axis=-1).astype(np.uint8)  # [out, nb, bytes]
        return blocks.reshape(out, nb * kind.bytes_per_block)
