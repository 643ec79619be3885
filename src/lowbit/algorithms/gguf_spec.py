"""llama.cpp's block grids as :func:`~lowbit.algorithms.weights.quantize_linears` drives them.

:class:`GGUFWeightSpec` quantizes a weight onto one llama.cpp type
(:mod:`lowbit.formats.gguf_blocks`) by RTN or GPTQ, so a GGUF export stores exactly the weight
lowbit simulated. GPTQ here is the column loop of :mod:`lowbit.algorithms.gptq` with the
format's grids: without act-order each block's grid (a K type's super-block: every sub-block's
integer scale and minimum and the fp16 super-scales) is fitted from the error-updated weights
when the loop reaches the block's first column (as GPTQ's dynamic groups), then every column
rounds onto it; with act-order every grid is fitted up front from the original weight (the
columns are visited out of block order, so a block's grid must exist before its first column).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.algorithms.gptq import GPTQSettings, one_thread_on_cpu, prepare_hessian
from lowbit.errors import LowbitError
from lowbit.formats.gguf_blocks import (
    GGUFGrid,
    GGUFQuantized,
    block_type,
    fit_grid,
    round_to_fitted,
    round_to_grid,
)

__all__ = ["GGUFWeightSpec"]


@dataclass(frozen=True)
class GGUFWeightSpec:
    """A weight on the llama.cpp type ``type_name`` (Q8_0, Q5_0, Q4_0, Q5_1, Q4_1, IQ4_NL,
    Q6_K, Q5_K, Q4_K, Q3_K, Q2_K)."""

    type_name: str

    def __post_init__(self) -> None:
        block_type(self.type_name)  # one sentence for an unknown name

    def check(self, weight: Tensor, name: str = "weight") -> None:
        block = block_type(self.type_name).block
        if weight.shape[-1] % block:
            raise LowbitError(
                f"{self.type_name} stores blocks of {block} weights; the input width "
                f"{weight.shape[-1]} of {name} is not a multiple of {block}"
            )

    def describe(self) -> str:
        return f"gguf {self.type_name}"

    # -- the WeightSpec contract (lowbit.algorithms.weights) -----------------------------------
    def rtn(self, weight: Tensor, steps: int = 11) -> GGUFQuantized:
        """Each block's grid fitted by least squares (``steps`` candidates per end of the
        grid), every weight rounded to nearest."""
        self.check(weight)
        kind = block_type(self.type_name)
        out = weight.shape[0]
        blocks = weight.detach().float().reshape(out, -1, kind.block)  # [out, nb, block]
        grid = fit_grid(blocks, kind, steps=steps)
        codes, _ = round_to_fitted(blocks, kind, grid)  # [out, nb, block]
        return GGUFQuantized.from_grid(kind, codes, grid)

    def gptq(
        self, weight: Tensor, hessian: Tensor, settings: GPTQSettings
    ) -> tuple[GGUFQuantized, Tensor, float]:
        """GPTQ onto the grid: ``(container, dequantized weight, damp)``."""
        self.check(weight)
        with one_thread_on_cpu(weight.device):
            return self._gptq(weight, hessian, settings)

    def guard_candidate(self, weight: Tensor) -> GGUFQuantized:
        return self.rtn(weight)

    def matches(self, weight) -> bool:
        return isinstance(weight, GGUFQuantized) and weight.type_name == self.type_name

    # -- GPTQ ----------------------------------------------------------------------------------
    def _gptq(self, weight: Tensor, hessian: Tensor, settings: GPTQSettings):
        kind = block_type(self.type_name)
        out, n = weight.shape
        block, sub = kind.block, kind.sub
        prepared = prepare_hessian(hessian, settings.damp, settings.act_order)
        perm = prepared.perm
        wt = prepared.visiting(weight).T.contiguous()  # [in, out], visiting order
        upper = prepared.upper.float()  # [in, in]
        fits: list[GGUFGrid | None] = [None] * (n // block)  # each block's grid, [out, 1(, k)]
        # the grid each sub-block rounds onto: [in / sub, out] scale and minimum
        scale_t = torch.zeros(n // sub, out, device=weight.device)
        min_t = torch.zeros(n // sub, out, device=weight.device) if kind.affine else None

        def keep(b: int, grid: GGUFGrid) -> None:
            """Block b's grid [out, 1(, k)]: stored, and its sub-blocks' rows filled."""
            fits[b] = grid
            k = block // sub
            scale_t[b * k : (b + 1) * k] = grid.scale().reshape(out, k).T
            if min_t is not None:
                min_t[b * k : (b + 1) * k] = grid.minimum().reshape(out, k).T

        # each block's grid fitted by squared error weighted by its inputs' energy, H's
        # diagonal (what llama.cpp's importance matrix weighs), floored so that a block of dead
        # inputs still has a grid: [in]
        diagonal = hessian.diagonal().float()
        diagonal = diagonal.clamp_min(max(float(diagonal.mean()) * 1e-6, 1e-12))
        if perm is not None:  # grids fixed in advance, from the original weight
            importance = diagonal.reshape(1, -1, block).expand(out, -1, -1)
            whole = fit_grid(weight.detach().float().reshape(out, -1, block), kind, importance)
            for b in range(n // block):
                keep(b, _select(whole, b))
        original = perm.tolist() if perm is not None else list(range(n))
        codes_t = torch.empty(n, out, dtype=torch.long, device=weight.device)  # visiting order
        values_t = torch.empty(n, out, device=weight.device)  # [in, out], visiting order
        size = settings.block_size
        for start in range(0, n, size):
            end = min(start + size, n)
            cols = wt[start:end]  # [b, out], updated in place
            errors = torch.empty_like(cols)  # [b, out]
            cols_u = upper[start:end, start:end]  # [b, b]
            for i in range(end - start):
                col = start + i
                if perm is None and col % block == 0:
                    # this block's grid, from its weights as updated so far: [out, 1, block]
                    importance = diagonal[col : col + block].reshape(1, 1, -1).expand(out, 1, -1)
                    blocks = wt[col : col + block].T.unsqueeze(1)
                    keep(col // block, fit_grid(blocks, kind, importance))
                g = original[col] // sub
                x = cols[i]  # [out]
                q, dq = round_to_grid(x, kind, scale_t[g], None if min_t is None else min_t[g])
                codes_t[col], values_t[col] = q, dq
                err = (x - dq) / cols_u[i, i]  # [out]
                cols[i:].addr_(cols_u[i, i:], err, alpha=-1.0)  # rank-1 update [b - i, out]
                errors[i] = err
            wt[end:] -= upper[start:end, end:].T @ errors  # lazy update [in - end, out]
        if perm is not None:
            inverse = torch.argsort(perm)
            codes_t, values_t = codes_t[inverse], values_t[inverse]
        grid = _concat(fits)
        quantized = GGUFQuantized.from_grid(kind, codes_t.T, grid)
        return quantized, values_t.T.contiguous(), prepared.damp


def _select(grid: GGUFGrid, b: int) -> GGUFGrid:
    """Block ``b`` of an [out, nb(, k)] grid as an [out, 1(, k)] one."""

    def part(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[:, b : b + 1]

    return GGUFGrid(part(grid.d), part(grid.dmin), part(grid.sub_scale), part(grid.sub_min))


def _concat(grids: list[GGUFGrid]) -> GGUFGrid:
    """[out, 1(, k)] grids, one per block, as one [out, nb(, k)] grid."""

    def cat(name: str) -> Tensor | None:
        parts = [getattr(g, name) for g in grids]
        return None if parts[0] is None else torch.cat(parts, dim=1)

    return GGUFGrid(cat("d"), cat("dmin"), cat("sub_scale"), cat("sub_min"))
