"""llama.cpp's block grids as a weight format: the 32-weight types (Q8_0, Q5_0, Q4_0, Q5_1,
Q4_1, IQ4_NL) and the 256-weight super-block K types (Q6_K, Q5_K, Q4_K, Q3_K, Q2_K).

A weight ``[out, in]`` is cut along ``in`` into blocks. A 32-weight block stores an fp16 scale
``d``, for the affine types an fp16 minimum ``m``, and one code per weight naming a level of the
type's grid; the value is ``d * level`` (symmetric types, IQ4_NL's codebook) or ``d * level +
m`` (Q5_1, Q4_1). A K type's super-block of 256 holds sub-blocks of 16 or 32 weights, each with
an integer scale (and minimum) of 4, 6 or 8 bits under the super-block's fp16 ``d`` (and
``dmin``): the value is ``(d * scale) * level`` (Q6_K, Q3_K) or ``(d * scale) * level - dmin *
minimum`` (Q5_K, Q4_K, Q2_K). Everything is computed in fp32 as llama.cpp and the ``gguf``
package's reader do; the levels and integer scales are small and ``d`` is fp16, so every
product is exact in fp32 and the dequantized weight here equals the reader's bit for bit.

:class:`GGUFQuantized` is the container (codes, scales, minimums, sub-block integers;
``dequantize``, ``storage_bits``, ``to_blocks``: llama.cpp's byte layout, the K types' by
:mod:`lowbit.formats.gguf_kblocks`). Fitting a block's grid (:func:`fit_grid`) and rounding
onto it (:func:`round_to_fitted`, :func:`round_to_grid`) are separate, so RTN fits and rounds
in one go and GPTQ fits a block's grid when it reaches the block, then rounds column by column
(:mod:`lowbit.algorithms.gguf_spec`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.gguf_kblocks import pack_super_blocks

__all__ = [
    "BLOCK",
    "BLOCK_TYPES",
    "BlockType",
    "GGUFGrid",
    "GGUFQuantized",
    "block_type",
    "fit_block_scales",
    "fit_grid",
    "round_to_fitted",
    "round_to_grid",
]

BLOCK = 32
#: IQ4_NL's 16 non-uniform levels (llama.cpp's ``kvalues_iq4nl``)
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockType:
    """One llama.cpp type.

    Attributes:
        name: llama.cpp's name ("Q4_0").
        levels: the grid's levels in code order (code ``c`` means ``levels[c]``).
        affine: a minimum is added to ``d * level`` (Q5_1, Q4_1 and the affine K types).
        bytes_per_block: llama.cpp's block size in bytes (scales, minimums, codes).
        block: weights per block: 32, or 256 for the K types' super-blocks.
        sub: weights per sub-block of a super-block, each with its own integer scale (and
            minimum) under the super-block's fp16 ``d`` (and ``dmin``); ``block`` for the
            32-weight types.
        sub_scales: the integer range of a sub-block's scale (K types).
        sub_mins: the integer range of a sub-block's minimum (affine K types).
    """

    name: str
    levels: tuple[int, ...]
    affine: bool
    bytes_per_block: int
    block: int = BLOCK
    sub: int = BLOCK
    sub_scales: tuple[int, int] | None = None
    sub_mins: tuple[int, int] | None = None

    @property
    def bits_per_weight(self) -> float:
        return self.bytes_per_block * 8 / self.block

    @functools.cached_property
    def uniform(self) -> bool:
        """The levels are consecutive integers (every type but IQ4_NL)."""
        return self.levels == tuple(range(self.levels[0], self.levels[0] + len(self.levels)))

    @property
    def super_block(self) -> bool:
        """A K type: integer sub-block scales under fp16 super-scales."""
        return self.sub_scales is not None

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
        # value = d * sub_scale * level (- dmin * sub_min): ggml-common.h's block_q*_K
        BlockType("Q6_K", tuple(range(-32, 32)), False, 128 + 64 + 16 + 2, 256, 16, (-128, 127)),
        BlockType("Q5_K", tuple(range(32)), True, 4 + 12 + 32 + 128, 256, 32, (0, 63), (0, 63)),
        BlockType("Q4_K", tuple(range(16)), True, 4 + 12 + 128, 256, 32, (0, 63), (0, 63)),
        BlockType("Q3_K", tuple(range(-4, 4)), False, 32 + 64 + 12 + 2, 256, 16, (-32, 31)),
        BlockType("Q2_K", tuple(range(4)), True, 16 + 64 + 4, 256, 16, (0, 15), (0, 15)),
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
    levels, codes, values = _nearest_levels(x, kind, scale, minimum)
    if codes is None:
        codes = (levels - float(kind.levels[0])).long()
    return codes, values


def _nearest_levels(x: Tensor, kind: BlockType, scale: Tensor, minimum: Tensor | None):
    """:func:`round_to_grid` as ``(levels [..., n] fp32, codes or None, values)``: uniform types
    find the level arithmetically and give no codes (a fitting loop needs only the levels)."""
    shifted = x - minimum if kind.affine else x
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    ratio = shifted / safe  # [..., n], a new tensor: rounded in place below
    codes = None
    if kind.uniform:  # consecutive integers: the nearest is arithmetic (ties down)
        low = float(kind.levels[0])
        levels = ratio.sub_(low + 0.5).ceil_().clamp_(0, len(kind.levels) - 1).add_(low)
    else:
        table = _level_tensor(kind, x.device)  # [L], increasing
        mids = (table[1:] + table[:-1]) / 2  # [L - 1]
        codes = torch.bucketize(ratio.contiguous(), mids)  # [..., n] nearest level (ties down)
        levels = table[codes]
    values = levels * scale
    if kind.affine:
        values.add_(minimum)
    return levels, codes, values


@functools.cache
def _level_tensor(kind: BlockType, device: torch.device) -> Tensor:
    """[L] fp32 levels in code order, made once per type and device (never written to)."""
    return kind.level_tensor(device)


def _squared_error(values: Tensor, blocks: Tensor, w: Tensor | None) -> Tensor:
    """``sum(w * (values - blocks)²)`` over the last axis, keepdim; ``values`` is consumed
    (overwritten); ``w`` None weighs every element 1."""
    err = values.sub_(blocks).square_()
    if w is not None:
        err.mul_(w)
    return err.sum(-1, keepdim=True)


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


def _affine_candidates(blocks: Tensor, kind: BlockType, steps: int, nonpositive_min: bool):
    """[C, ..., nb, 1] candidate (scale, minimum): the block's range shrunk from either end."""
    lo = blocks.amin(-1, keepdim=True)
    if nonpositive_min:  # the K types store the minimum's magnitude: the range reaches 0
        lo = lo.clamp_max(0.0)
    hi = blocks.amax(-1, keepdim=True)
    span = hi - lo
    top = float(kind.levels[-1])
    shrink = torch.linspace(0.0, 0.15, max(2, steps // 2), device=blocks.device)
    a, b = torch.meshgrid(shrink, shrink, indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)  # [C]
    shape = (-1, *[1] * lo.dim())
    low = lo.unsqueeze(0) + a.view(shape) * span.unsqueeze(0)
    high = hi.unsqueeze(0) - b.view(shape) * span.unsqueeze(0)
    if nonpositive_min:
        low = low.clamp_max(0.0)
    return (high - low) / top, low


def fit_block_scales(
    blocks: Tensor,
    kind: BlockType,
    importance: Tensor | None = None,
    steps: int = 11,
    *,
    to_fp16: bool = True,
    nonpositive_min: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Choose each block's scale (and minimum) by least (weighted) squared error.

    Candidates: the grid stretched so that the block's extreme lands on (or a little inside)
    the grid's end; for each, the codes it rounds to, then the least-squares scale (and
    minimum) of those codes, rounded to fp16; the candidate whose fp16 grid rounds the block
    with the smallest error wins. The first candidate is llama.cpp's own reference choice
    for the affine types, so a block already on an affine grid is found again.

    Args:
        blocks: [..., nb, n] fp32 weights.
        importance: [..., nb, n] non-negative weights of the squared error, or None.
        steps: candidates per end of the grid.
        to_fp16: round scales and minimums to fp16 (False: the K types' sub-blocks, whose
            scales are quantized afterwards).
        nonpositive_min: keep minimums at or below 0 (the K types).

    Returns:
        ``(scale [..., nb, 1], minimum [..., nb, 1] or None)``, fp32.
    """
    n = blocks.shape[-1]
    flat = blocks.reshape(-1, n)  # [R, n]
    w = None if importance is None else importance.reshape(-1, n)  # None: every weight 1
    if kind.affine:
        scales, mins = _affine_candidates(flat, kind, steps, nonpositive_min)  # [C, R, 1]
    else:
        scales, mins = _symmetric_candidates(flat, kind, steps), None
    rounding = _fp16 if to_fp16 else (lambda x: x)
    scales = rounding(scales)
    mins = None if mins is None else rounding(mins)
    best_scale = torch.empty_like(flat[:, :1])  # [R, 1]
    best_min = None if mins is None else torch.empty_like(best_scale)
    rows = max(1, _CANDIDATE_ELEMENTS // (scales.shape[0] * n))  # blocks per batch
    for r in range(0, flat.shape[0], rows):
        part = slice(r, r + rows)
        s, m = _best_candidate(
            flat[part],
            None if w is None else w[part],
            kind,
            scales[:, part],
            None if mins is None else mins[:, part],
            rounding,
            nonpositive_min,
        )
        best_scale[part] = s
        if best_min is not None:
            best_min[part] = m
    shape = (*blocks.shape[:-1], 1)
    return best_scale.view(shape), None if best_min is None else best_min.view(shape)


#: most elements of one candidate batch: ``C`` candidates x some blocks x ``n`` weights
_CANDIDATE_ELEMENTS = 1 << 21


def _best_candidate(blocks, w, kind: BlockType, scales, mins, rounding, nonpositive_min):
    """The (scale, minimum) ``[r, 1]`` each block ``[r, n]`` rounds with least error, out of
    candidates ``[C, r, 1]`` and their least-squares refits, all rounded at once. Ties go to
    the earlier of the order ``candidate 0, its refit, candidate 1, ...``."""
    levels, _, values = _nearest_levels(blocks, kind, scales, mins)  # [C, r, n]
    first = _squared_error(values, blocks, w)  # [C, r, 1]
    refit, refit_min = _BlockSums(blocks, w).least_squares(levels, kind, scales, mins, rounding)
    if refit_min is not None and nonpositive_min:
        refit_min = refit_min.clamp_max(0.0)
    del levels, values
    _, _, values = _nearest_levels(blocks, kind, refit, refit_min)
    second = _squared_error(values, blocks, w)  # [C, r, 1]
    errors = torch.stack((first, second), 1).flatten(0, 1)  # [2C, r, 1], in that order
    pick = errors.nan_to_num(nan=float("inf")).argmin(0, keepdim=True)  # [1, r, 1], the first
    scale = torch.stack((scales, refit), 1).flatten(0, 1).gather(0, pick)[0]  # [r, 1]
    if mins is None:
        return scale, None
    return scale, torch.stack((mins, refit_min), 1).flatten(0, 1).gather(0, pick)[0]


def _fp16(x: Tensor) -> Tensor:
    return x.clamp(-65504.0, 65504.0).to(torch.float16).float()


class _BlockSums:
    """The sums of a least-squares fit that do not depend on the levels (``sum w``,
    ``sum w x``), taken once per set of blocks ``[..., nb, n]`` with weights ``w`` (or None)."""

    def __init__(self, blocks: Tensor, w: Tensor | None) -> None:
        self.blocks, self.w = blocks, w
        n = blocks.shape[-1]
        self.sw = (
            blocks.new_full((*blocks.shape[:-1], 1), float(n))
            if w is None
            else w.sum(-1, keepdim=True)
        )  # [..., nb, 1]
        self.sx = (blocks if w is None else w * blocks).sum(-1, keepdim=True)

    def least_squares(self, q: Tensor, kind: BlockType, s, m, rounding=_fp16):
        """Scale (and minimum) minimising the weighted error for fixed levels ``q``
        ``[..., nb, n]``, then ``rounding``."""
        wq = q if self.w is None else self.w * q
        sqq = (wq * q).sum(-1, keepdim=True)
        sqx = (wq * self.blocks).sum(-1, keepdim=True)
        if not kind.affine:
            return rounding(torch.where(sqq > 0, sqx / sqq.clamp_min(1e-30), s)), None
        sw, sx = self.sw, self.sx
        sq = wq.sum(-1, keepdim=True)
        det = sw * sqq - sq * sq
        ok = det.abs() > 1e-20 * (sw * sqq).abs().clamp_min(1e-30)
        safe = torch.where(ok, det, torch.ones_like(det))
        d = torch.where(ok, (sw * sqx - sq * sx) / safe, s)
        mn = torch.where(ok, (sqq * sx - sq * sqx) / safe, m)
        return rounding(d), rounding(mn)


@dataclass
class GGUFGrid:
    """Every block's grid as llama.cpp stores it, and the grid each sub-block rounds onto.

    For the 32-weight types a block is its own single sub-block: ``d`` is its fp16 scale,
    ``dmin`` its fp16 minimum. For the K types ``d``/``dmin`` are a super-block's fp16
    super-scales and ``sub_scale``/``sub_min`` each sub-block's integers; a sub-block's values
    are ``(d * sub_scale) * level - (dmin * sub_min)``, both products exact in fp32.

    Attributes:
        d: [..., nb] fp32 holding fp16 values.
        dmin: [..., nb] likewise (affine types) or None.
        sub_scale: [..., nb, sub-blocks] integer-valued fp32 (K types) or None.
        sub_min: likewise (affine K types) or None.
    """

    d: Tensor
    dmin: Tensor | None = None
    sub_scale: Tensor | None = None
    sub_min: Tensor | None = None

    def scale(self) -> Tensor:
        """[..., nb, sub-blocks] the scale each sub-block rounds with."""
        if self.sub_scale is None:
            return self.d.unsqueeze(-1)
        return self.d.unsqueeze(-1) * self.sub_scale

    def minimum(self) -> Tensor | None:
        """[..., nb, sub-blocks] the minimum added to each sub-block's ``scale * level``."""
        if self.dmin is None:
            return None
        if self.sub_min is None:
            return self.dmin.unsqueeze(-1)
        return -(self.dmin.unsqueeze(-1) * self.sub_min)


def _quantize_sub_scales(values: Tensor, span: tuple[int, int], signed: bool):
    """fp16 super-scale [..., nb] and integers [..., nb, k] for float sub-block values.

    Signed (Q6_K, Q3_K): the largest-magnitude value maps onto the negative end of ``span``, as
    llama.cpp maps it; otherwise the largest value onto the positive end.
    """
    low, high = span
    if signed:
        idx = values.abs().argmax(-1, keepdim=True)
        d = _fp16(values.gather(-1, idx)[..., 0] / low)
    else:
        d = _fp16(values.amax(-1).clamp_min(0.0) / high)
    d = torch.where(d == 0, torch.zeros_like(d), d)  # never a negative zero
    safe = torch.where(d == 0, torch.ones_like(d), d).unsqueeze(-1)
    ints = torch.round(values / safe).clamp(low, high)
    return d, torch.where(d.unsqueeze(-1) == 0, torch.zeros_like(ints), ints)


def fit_grid(
    blocks: Tensor, kind: BlockType, importance: Tensor | None = None, steps: int = 11
) -> GGUFGrid:
    """Each block's grid, by least (weighted) squared error.

    32-weight types: :func:`fit_block_scales`. K types: every sub-block's float scale (and
    minimum) by :func:`fit_block_scales`, quantized to integers under fp16 super-scales fitted
    to the largest; then each sub-block's integers are moved by one step where that rounds the
    sub-block with less error under the stored super-scales.

    Args:
        blocks: [..., nb, kind.block] fp32 weights.
        importance: like ``blocks``, non-negative weights of the squared error, or None.
        steps: candidates per end of the grid (:func:`fit_block_scales`).
    """
    if not kind.super_block:
        scale, minimum = fit_block_scales(blocks, kind, importance, steps)
        return GGUFGrid(scale[..., 0], None if minimum is None else minimum[..., 0])
    subs = blocks.unflatten(-1, (-1, kind.sub))  # [..., nb, k, sub]
    w = None if importance is None else importance.unflatten(-1, (-1, kind.sub))
    scale, minimum = fit_block_scales(subs, kind, w, steps, to_fp16=False, nonpositive_min=True)
    d, sub_scale = _quantize_sub_scales(scale[..., 0], kind.sub_scales, not kind.affine)
    dmin = sub_min = None
    if kind.affine:
        dmin, sub_min = _quantize_sub_scales(-minimum[..., 0], kind.sub_mins, False)
    grid = GGUFGrid(d, dmin, sub_scale, sub_min)
    return _refine_sub_scales(subs, kind, grid, w)


def _refine_sub_scales(subs: Tensor, kind: BlockType, grid: GGUFGrid, w) -> GGUFGrid:
    """Move each sub-block's integer scale (and minimum) by -1, 0 or +1, keeping the pair that
    rounds the sub-block with the least error."""
    best_err, best = None, (grid.sub_scale, grid.sub_min)
    steps = (-1.0, 0.0, 1.0)
    for ds in steps:
        for dm in steps if kind.affine else (0.0,):
            sc = (grid.sub_scale + ds).clamp(*kind.sub_scales)
            mn = None if grid.sub_min is None else (grid.sub_min + dm).clamp(*kind.sub_mins)
            trial = GGUFGrid(grid.d, grid.dmin, sc, mn)
            m = trial.minimum()
            _, _, values = _nearest_levels(
                subs, kind, trial.scale().unsqueeze(-1), None if m is None else m.unsqueeze(-1)
            )
            err = _squared_error(values, subs, w)[..., 0]  # [..., nb, k]
            if best_err is None:
                best_err, best = err, (sc, mn)
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (
                torch.where(better, sc, best[0]),
                None if mn is None else torch.where(better, mn, best[1]),
            )
    return GGUFGrid(grid.d, grid.dmin, best[0], best[1])


def round_to_fitted(blocks: Tensor, kind: BlockType, grid: GGUFGrid):
    """:func:`round_to_grid` of [..., nb, kind.block] weights onto their fitted blocks:
    ``(codes, values)`` shaped like ``blocks``."""
    subs = blocks.unflatten(-1, (-1, kind.sub))  # [..., nb, k, sub]
    m = grid.minimum()
    codes, values = round_to_grid(
        subs, kind, grid.scale().unsqueeze(-1), None if m is None else m.unsqueeze(-1)
    )
    return codes.flatten(-2), values.flatten(-2)


@dataclass
class GGUFQuantized:
    """A weight on a llama.cpp grid.

    Attributes:
        type_name: the :class:`BlockType`'s name.
        codes: [out, in] uint8 level indices.
        scale: [out, in / block] fp16: a block's scale, or a super-block's ``d``.
        minimum: [out, in / block] fp16: a block's minimum or a super-block's ``dmin``
            (affine types), or None.
        sub_scale: [out, in / sub] int8 sub-block scales (K types), or None.
        sub_min: [out, in / sub] int8 sub-block minimums (affine K types), or None.
    """

    type_name: str
    codes: Tensor
    scale: Tensor
    minimum: Tensor | None = None
    sub_scale: Tensor | None = None
    sub_min: Tensor | None = None

    @property
    def kind(self) -> BlockType:
        return block_type(self.type_name)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @classmethod
    def from_grid(cls, kind: BlockType, codes: Tensor, grid: GGUFGrid) -> GGUFQuantized:
        """From [out, in] codes and the [out, nb(, sub-blocks)] grid of :func:`fit_grid`."""
        out = codes.shape[0]

        def ints(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.reshape(out, -1).to(torch.int8)

        return cls(
            kind.name,
            codes.reshape(out, -1).to(torch.uint8),
            grid.d.reshape(out, -1).to(torch.float16),
            None if grid.dmin is None else grid.dmin.reshape(out, -1).to(torch.float16),
            ints(grid.sub_scale),
            ints(grid.sub_min),
        )

    def grid(self) -> GGUFGrid:
        """[out, nb(, sub-blocks)] the stored grid in fp32."""
        out = self.codes.shape[0]
        nb = self.scale.shape[1]

        def subs(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.float().reshape(out, nb, -1)

        return GGUFGrid(
            self.scale.float(),
            None if self.minimum is None else self.minimum.float(),
            subs(self.sub_scale),
            subs(self.sub_min),
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """[out, in] weight as llama.cpp decodes it (fp32, then ``dtype``)."""
        out, n = self.codes.shape
        kind = self.kind
        grid = self.grid()
        levels = kind.level_tensor(self.codes.device)[self.codes.long()]  # [out, in]
        values = levels.view(out, -1, kind.sub) * grid.scale().reshape(out, -1, 1)
        minimum = grid.minimum()
        if minimum is not None:
            values = values + minimum.reshape(out, -1, 1)
        values = values.reshape(out, n)
        return values if dtype is None else values.to(dtype)

    def storage_bits(self) -> int:
        out, n = self.codes.shape
        kind = self.kind
        return out * (n // kind.block) * kind.bytes_per_block * 8

    def to(self, device) -> GGUFQuantized:
        def move(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(device)

        return GGUFQuantized(
            self.type_name, self.codes.to(device), self.scale.to(device), move(self.minimum),
            move(self.sub_scale), move(self.sub_min),
        )  # fmt: skip

    def to_blocks(self) -> np.ndarray:
        """llama.cpp's bytes: [out, in / block * bytes_per_block] uint8, rows in order."""
        kind = self.kind
        out, n = self.codes.shape
        nb = n // kind.block
        codes = self.codes.cpu().numpy().reshape(out, nb, kind.block)  # [out, nb, block]
        if kind.super_block:

            def ints(x: Tensor | None) -> np.ndarray | None:
                return None if x is None else x.cpu().numpy().reshape(out, nb, -1)

            return pack_super_blocks(
                kind.name, codes, self.scale.cpu().numpy(), ints(self.sub_scale),
                None if self.minimum is None else self.minimum.cpu().numpy(), ints(self.sub_min),
            )  # fmt: skip
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
