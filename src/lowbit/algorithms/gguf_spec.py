"""llama.cpp's block grids as :func:`~lowbit.algorithms.weights.quantize_linears` drives them.

:class:`GGUFWeightSpec` quantizes a weight onto one 32-weight llama.cpp type
(:mod:`lowbit.formats.gguf_blocks`) by RTN or GPTQ, so a GGUF export stores exactly the weight
lowbit simulated. GPTQ here is the column loop of :mod:`lowbit.algorithms.gptq` with the
format's grids: without act-order each block's grid is fitted from the error-updated weights
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
    BLOCK,
    GGUFQuantized,
    block_type,
    fit_block_scales,
    round_to_grid,
)

__all__ = ["GGUFWeightSpec"]


@dataclass(frozen=True)
class GGUFWeightSpec:
    """A weight on the llama.cpp block type ``type_name`` (Q8_0, Q5_0, Q4_0, Q5_1, Q4_1,
    IQ4_NL)."""

    type_name: str

    def __post_init__(self) -> None:
        block_type(self.type_name)  # one sentence for an unknown name

    def check(self, weight: Tensor, name: str = "weight") -> None:
        if weight.shape[-1] % BLOCK:
            raise LowbitError(
                f"{self.type_name} stores blocks of {BLOCK} weights; the input width "
                f"{weight.shape[-1]} of {name} is not a multiple of {BLOCK}"
            )

    def describe(self) -> str:
        return f"gguf {self.type_name}"

    # -- the WeightSpec contract (lowbit.algorithms.weights) -----------------------------------
    def rtn(self, weight: Tensor) -> GGUFQuantized:
        """Each block's grid fitted by least squares, every weight rounded to nearest."""
        self.check(weight)
        kind = block_type(self.type_name)
        out = weight.shape[0]
        blocks = weight.detach().float().reshape(out, -1, BLOCK)  # [out, nb, 32]
        scale, minimum = fit_block_scales(blocks, kind)  # [out, nb, 1] each
        codes, _ = round_to_grid(blocks, kind, scale, minimum)  # [out, nb, 32]
        return GGUFQuantized.from_codes(kind, codes.reshape(weight.shape), scale, minimum)

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
        nb = n // BLOCK
        prepared = prepare_hessian(hessian, settings.damp, settings.act_order)
        perm = prepared.perm
        wt = prepared.visiting(weight).T.contiguous()  # [in, out], visiting order
        upper = prepared.upper.float()  # [in, in]
        device = weight.device
        scale_t = torch.zeros(nb, out, device=device)  # [nb, out] each block's grid, filled below
        min_t = torch.zeros(nb, out, device=device) if kind.affine else None
        if perm is not None:  # grids fixed in advance, from the original weight
            s, m = fit_block_scales(weight.detach().float().reshape(out, nb, BLOCK), kind)
            scale_t.copy_(s[..., 0].T)
            if min_t is not None:
                min_t.copy_(m[..., 0].T)
        original = perm.tolist() if perm is not None else list(range(n))
        codes_t = torch.empty(n, out, dtype=torch.long, device=device)  # [in, out], visiting order
        values_t = torch.empty(n, out, device=device)  # [in, out], visiting order
        size = settings.block_size
        for start in range(0, n, size):
            end = min(start + size, n)
            block = wt[start:end]  # [b, out], updated in place
            errors = torch.empty_like(block)  # [b, out]
            block_u = upper[start:end, start:end]  # [b, b]
            for i in range(end - start):
                col = start + i
                g = original[col] // BLOCK
                if perm is None and col % BLOCK == 0:
                    # this block's grid, from its weights as updated so far: [out, 1, 32]
                    s, m = fit_block_scales(wt[col : col + BLOCK].T.unsqueeze(1), kind)
                    scale_t[g] = s[:, 0, 0]
                    if min_t is not None:
                        min_t[g] = m[:, 0, 0]
                x = block[i]  # [out]
                m = None if min_t is None else min_t[g]
                q, dq = round_to_grid(x, kind, scale_t[g], m)
                codes_t[col], values_t[col] = q, dq
                err = (x - dq) / block_u[i, i]  # [out]
                block[i:].addr_(block_u[i, i:], err, alpha=-1.0)  # rank-1 update [b - i, out]
                errors[i] = err
            wt[end:] -= upper[start:end, end:].T @ errors  # lazy update [in - end, out]
        if perm is not None:
            inverse = torch.argsort(perm)
            codes_t, values_t = codes_t[inverse], values_t[inverse]
        quantized = GGUFQuantized.from_codes(
            kind, codes_t.T, scale_t.T, None if min_t is None else min_t.T
        )
        return quantized, values_t.T.contiguous(), prepared.damp
