"""llama.cpp's block grids as :func:`~lowbit.algorithms.weights.quantize_linears` drives them.

:class:`GGUFWeightSpec` quantizes a weight onto one llama.cpp type
(:mod:`lowbit.formats.gguf_blocks`) by RTN or GPTQ, so a GGUF export stores exactly the weight
lowbit simulated. GPTQ here is the column loop of :mod:`lowbit.algorithms.gptq` with the
format's grids: without act-order each block's grid (a K type's super-block: every sub-block's
integer scale and minimum and the fp16 super-scales) is fitted from the error-updated weights
when the loop reaches the block's first column (as GPTQ's dynamic groups), then every column
rounds onto it; with act-order every grid is fitted up front from the original weight (the
columns are visited out of block order, so a block's grid must exist before its first column).
Grids are fitted by squared error weighted by the inputs' energy (H's diagonal). After the
loop, the fp16 numbers of every block (scale, and minimum for the affine types; a K type's
super-scales ``d`` and ``dmin``, its integer sub-block scales kept) are solved again by least
squares for the codes the loop chose, against the layer's output error ``tr(ΔW H ΔWᵀ)`` over
the whole row: the loop fixes a grid before the error of later columns lands on its block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.algorithms import gptq_native
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
        wt = prepared.visiting_transposed(weight)  # [in, out], visiting order
        upper = prepared.take_upper()  # [in, in]
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
        # [in] the grid row (sub-block) of each column, in visiting order
        rows_of = torch.tensor(original, dtype=torch.int64, device=weight.device) // sub
        codes_t = torch.empty(n, out, device=weight.device)  # [in, out] codes, visiting order
        values_t = torch.empty(n, out, device=weight.device)  # [in, out], visiting order
        low, top = float(kind.levels[0]), float(len(kind.levels) - 1)
        size = settings.block_size
        for start in range(0, n, size):
            end = min(start + size, n)
            cols = wt[start:end]  # [b, out], updated in place
            errors = torch.empty_like(cols)  # [b, out]
            cols_u = upper[start:end, start:end]  # [b, b]
            i = 0
            while i < end - start:
                col = start + i
                stop = end - start  # the columns up to the next block's grid fit share theirs
                if perm is None:
                    stop = min(stop, col - col % block + block - start)
                if perm is None and col % block == 0:
                    # this block's grid, from its weights as updated so far: [out, 1, block]
                    importance = diagonal[col : col + block].reshape(1, 1, -1).expand(out, 1, -1)
                    blocks = wt[col : col + block].T.unsqueeze(1)
                    keep(col // block, fit_grid(blocks, kind, importance))
                compiled = kind.uniform and gptq_native.quantize_columns(
                    cols, cols_u, i, stop, errors, codes_t[start:end], values_t[start:end],
                    rows_of[start:end], gptq_native.GRID_LEVELS, None, scale_t, min_t, low, top,
                )  # fmt: skip
                if not compiled:  # the torch loop: the same steps, a column at a time
                    for j in range(i, stop):
                        g = original[start + j] // sub
                        x = cols[j]  # [out]
                        grid_min = None if min_t is None else min_t[g]
                        q, dq = round_to_grid(x, kind, scale_t[g], grid_min)
                        codes_t[start + j], values_t[start + j] = q.float(), dq
                        err = (x - dq) / cols_u[j, j]  # [out]
                        cols[j:].addr_(cols_u[j, j:], err, alpha=-1.0)  # rank-1 update
                        errors[j] = err
                i = stop
            wt[end:] -= upper[start:end, end:].T @ errors  # lazy update [in - end, out]
        del wt, upper  # done with: the factor alone is 0.8 GB at in = 14336
        codes = prepared.in_original_order(codes_t.to(torch.uint8))  # [out, in] level indices
        del codes_t
        solved = prepared.in_original_order(values_t)  # [out, in]
        del values_t
        quantized = GGUFQuantized.from_grid(kind, codes, _concat(fits))
        refitted = refit_block_numbers(quantized, weight.detach().float(), hessian.float())
        values = refitted.dequantize(torch.float32)  # [out, in]
        # keep each row's refit only where it lowers that row's output error (fp16 rounding of
        # the solution can cost more than the solve gained on a row that was already optimal)
        worse = _row_error(weight, values, hessian) > _row_error(weight, solved, hessian)
        if bool(worse.any()):
            refitted = _rows_from(refitted, quantized, worse)
            values = torch.where(worse[:, None], solved, values)
        return refitted, values.contiguous(), prepared.damp


def refit_block_numbers(
    quantized: GGUFQuantized, weight: Tensor, hessian: Tensor, rows_per_chunk: int | None = None
) -> GGUFQuantized:
    """Every block's fp16 numbers re-solved by least squares for fixed codes.

    A row's dequantized weight is linear in its blocks' fp16 numbers: ``ŵ = Σ_b d_b u_b (+
    m_b v_b)`` with ``u_b`` the block's levels times its integer sub-block scales and ``v_b`` 1
    (Q4_1, Q5_1) or minus the integer sub-block minimums (K types) on block ``b``. The numbers
    minimising ``(w - ŵ) H (w - ŵ)ᵀ`` solve ``(A H Aᵀ) θ = A H wᵀ`` per row, a system of one
    unknown per block and number; the solution is rounded to fp16.

    Args:
        quantized: codes and grid of an [out, in] weight.
        weight: [out, in] the float weight the output error is measured against.
        hessian: [in, in] ``2/N Σ x xᵀ`` of the layer's inputs.
        rows_per_chunk: rows solved together (None: as many as keep the [rows, numbers, in]
            intermediate near 2**24 elements).
    """
    kind = quantized.kind
    grid = quantized.grid()
    out, n = weight.shape
    nb, blk = n // kind.block, kind.block
    per_weight = n // kind.sub  # sub-blocks per row
    levels = kind.level_tensor(weight.device)[quantized.codes.long()]  # [out, in]
    sub_scale = torch.ones(out, per_weight, device=weight.device)
    if grid.sub_scale is not None:
        sub_scale = grid.sub_scale.reshape(out, per_weight)
    basis = [levels * sub_scale.repeat_interleave(kind.sub, 1)]  # [out, in] per unit d
    numbers = [grid.d]  # [out, nb] each
    if kind.affine:
        minimum = torch.ones(out, per_weight, device=weight.device)
        if grid.sub_min is not None:
            minimum = -grid.sub_min.reshape(out, per_weight)
        basis.append(minimum.repeat_interleave(kind.sub, 1))  # [out, in] per unit dmin
        numbers.append(grid.dmin)
    p = len(basis)
    h = hessian.double().reshape(nb, blk, n)  # [nb, block, in]
    if rows_per_chunk is None:
        rows_per_chunk = max(1, (1 << 24) // (p * nb * n))
    solved = []
    for r0 in range(0, out, rows_per_chunk):
        rows = slice(r0, min(r0 + rows_per_chunk, out))
        # u[r, p, b, :]: basis p of row r over block b's columns: [r, p, nb, blk]
        u = torch.stack([b[rows].double().reshape(-1, nb, blk) for b in basis], 1)
        # uh[r, p, b, :] = u[r, p, b] @ H[block b, :]: [r, p, nb, in]
        uh = torch.einsum("rpbi,bij->rpbj", u, h).reshape(u.shape[0], p * nb, nb, blk)
        gram = torch.einsum("rxcj,rqcj->rxqc", uh, u).reshape(-1, p * nb, p * nb)
        rhs = (uh.reshape(-1, p * nb, n) * weight[rows].double().unsqueeze(1)).sum(-1)
        ridge = 1e-9 * gram.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)  # [r]
        gram = gram + ridge[:, None, None] * torch.eye(p * nb, dtype=gram.dtype, device=gram.device)
        current = torch.cat([x[rows].double() for x in numbers], 1)  # [r, p * nb]
        theta, info = torch.linalg.solve_ex(gram, rhs)
        solved.append(torch.where((info == 0)[:, None], theta, current))
    theta = torch.cat(solved).float().clamp(-65504.0, 65504.0).half().float()  # [out, p * nb]
    refitted = GGUFGrid(
        theta[:, :nb], theta[:, nb:] if kind.affine else None, grid.sub_scale, grid.sub_min
    )
    return GGUFQuantized.from_grid(kind, quantized.codes, refitted)


def _row_error(weight: Tensor, values: Tensor, hessian: Tensor) -> Tensor:
    """[out] each row's output error ``(w - ŵ) H (w - ŵ)ᵀ``."""
    delta = weight.double() - values.double()  # [out, in]
    return ((delta @ hessian.double()) * delta).sum(1)


def _rows_from(base: GGUFQuantized, other: GGUFQuantized, rows: Tensor) -> GGUFQuantized:
    """``base`` with the fp16 numbers of ``other`` on the [out] bool ``rows``."""

    def pick(a: Tensor | None, b: Tensor | None) -> Tensor | None:
        return None if a is None else torch.where(rows[:, None], b, a)

    return GGUFQuantized(
        base.type_name, base.codes, pick(base.scale, other.scale),
        pick(base.minimum, other.minimum), base.sub_scale, base.sub_min,
    )  # fmt: skip


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
