"""SpQR: GPTQ column by column into bi-level small groups, with the weights that fit no group
moved to a sparse fp16 matrix (Dettmers et al., 2024, summarised in §2 of Crnčević's master's
thesis on an SpQR inference kernel, 2025).

Pure tensor math on a weight ``W [out, in]``, the Hessian ``H = 2/N Σ x xᵀ`` of its inputs and
an :class:`SpQRSpec`; the format is :class:`~lowbit.formats.spqr.SpQRQuantized`.

The column loop is GPTQ's (:mod:`lowbit.algorithms.gptq`: its prologue ``prepare_hessian``
zeroes dead inputs and gives the upper Cholesky factor ``U`` of the dampened ``H⁻¹``; errors
``(w − ŵ) / U_jj`` are pushed onto later columns, lazy block updates), with:

* **act-order**: columns are visited by decreasing ``H_jj`` and the weight is *stored* in that
  order, so groups are runs of ``beta1`` visited columns; the permutation is stored and the
  kernel gathers the input through it (as Crnčević's fused kernel does).
* **bi-level groups**: when a group's first column is reached, each row's min-max scale and
  zero over the group's current (updated) weights are computed without the group's likely
  outliers, then quantized to ``stat_bits`` per tile of ``beta2`` rows with fp16 second-order
  statistics (SpQR). Then, beyond SpQR, each row picks the (scale code, zero code) pair among
  all ``2**(2 stat_bits)`` that the tile's second-order statistics decode to which minimises
  its saliency-weighted error ``Σ ((w − ŵ) / U_jj)²`` over its kept weights (64 pairs at 3
  bits; rounding the min-max statistics to the nearest codes is one of them). Codes are chosen
  with the decoded fp16 statistics.
* **outliers** by the OBS saliency ``((w − ŵ) / U_jj)² = (w − ŵ)² / [H⁻¹]_jj`` (the inverse of
  the Hessian of the columns not yet quantized, as GPTQ sees it) against a threshold τ. Before
  a group's statistics are fitted, its likely outliers are found either by SpQR's leave-one-out
  test (``simplified=False``: a weight is likely when leaving it out of the min-max fit lowers
  the group's saliency-weighted error by more than τ) or, ``simplified=True``, as the weights
  whose saliency under the statistics of the whole group exceeds τ; both are excluded from the
  statistics. Then each column's weights with saliency above τ become outliers: the code is
  kept, the fp16 residual ``w − ŵ`` goes to the sparse matrix, and the error fed back is that
  of ``ŵ + residual``.
* **the budget**: at most ``outlier_fraction`` of the weights. τ is SpQR's relative threshold
  (``tau`` times the mean over columns of ``Var(W[:, j]) / U_jj²``) when given; otherwise it is
  chosen per layer by bisection so that a pre-pass flags the budget: every group fitted as the
  loop fits it (likely outliers excluded at that τ, min-max codes without the pair search) on
  the weights before GPTQ's updates. Either way the count never exceeds the budget: once it
  is spent no further outliers are taken (a column with more candidates than remain keeps its
  most salient ones), and no more weights are excluded from a group's statistics than the
  budget can still take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowbit.algorithms.gptq import GPTQSettings, one_thread_on_cpu, prepare_hessian
from lowbit.errors import LowbitError
from lowbit.formats.spqr import (
    KERNEL_BITS,
    MAX_WIDTH,
    TILE,
    SpQRQuantized,
    decode_fp16,
    fill_degenerate,
    first_order_stats,
    make_outliers,
    quantize_stats,
    weight_codes,
)

__all__ = ["SpQRSpec", "SpQRResult", "spqr_quantize", "spqr_rtn", "MAX_OUTLIER_FRACTION"]

#: the largest outlier budget accepted (beyond it the sparse part costs more than the dense)
MAX_OUTLIER_FRACTION = 0.1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpQRSpec:
    """How a weight matrix is quantized with SpQR.

    Attributes:
        bits: code width (the packed layout and its kernels: 3; the simulated face: 2-8).
        beta1: columns per first-order group (packed: 16).
        beta2: rows per second-order group (packed: 16).
        stat_bits: width of the quantized first-order scales and zeros (packed: 3).
        outlier_fraction: the outlier budget, a share of the weights in [0, 0.1].
        tau: SpQR's relative outlier threshold, or None to derive it from the budget.
        simplified: find a group's likely outliers by saliency instead of leave-one-out.
        sparse_format: how the outliers are stored, ``"csr"`` or ``"ptcsr"``.
    """

    bits: int = KERNEL_BITS
    beta1: int = TILE
    beta2: int = TILE
    stat_bits: int = KERNEL_BITS
    outlier_fraction: float = 0.01
    tau: float | None = None
    simplified: bool = False
    sparse_format: str = "csr"

    def __post_init__(self) -> None:
        for name, low in (("bits", 2), ("stat_bits", 2)):
            value = getattr(self, name)
            if not _is_int(value) or not low <= value <= 8:
                raise LowbitError(f"SpQR {name} must be an integer in 2..8, not {value!r}")
        if not _is_int(self.beta1) or self.beta1 < 2:
            raise LowbitError(
                f"SpQR beta1 (columns per group) must be at least 2, not {self.beta1!r}"
            )
        if not _is_int(self.beta2) or self.beta2 < 1:
            raise LowbitError(
                f"SpQR beta2 (rows per statistics group) must be positive, not {self.beta2!r}"
            )
        fraction = self.outlier_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not (0.0 <= fraction <= MAX_OUTLIER_FRACTION)
        ):
            raise LowbitError(
                f"the SpQR outlier fraction must be between 0 and {MAX_OUTLIER_FRACTION:g} "
                f"(10% of the weights), not {fraction!r}"
            )
        if self.tau is not None and not (isinstance(self.tau, (int, float)) and self.tau > 0):
            raise LowbitError(
                f"the SpQR outlier threshold tau must be positive or None, not {self.tau!r}"
            )
        if self.sparse_format not in ("csr", "ptcsr"):
            raise LowbitError(
                f"SpQR outliers are stored as 'csr' or 'ptcsr', not {self.sparse_format!r}"
            )

    # -- the weight-spec protocol -----------------------------------------------------------------
    def check(self, weight: Tensor, name: str = "weight") -> None:
        if weight.dim() != 2:
            raise LowbitError(f"SpQR quantizes 2-d weights; {name} has shape {tuple(weight.shape)}")
        if weight.shape[1] > MAX_WIDTH:
            raise LowbitError(
                f"SpQR stores 16-bit column indices (outliers, input permutation), so {name} may "
                f"have at most {MAX_WIDTH} input columns, not {weight.shape[1]}"
            )

    def describe(self) -> str:
        budget = f"{100 * self.outlier_fraction:g}% outliers"
        tau = "" if self.tau is None else f", tau {self.tau:g}"
        simple = ", simplified" if self.simplified else ""
        return (
            f"spqr w{self.bits} s{self.stat_bits} beta {self.beta1}/{self.beta2}, {budget}{tau}"
            f"{simple}, {self.sparse_format}"
        )

    def rtn(self, weight: Tensor) -> SpQRQuantized:
        """Without calibration (:func:`spqr_rtn`): the same groups, statistics and outliers
        with an identity Hessian, every group at once."""
        self.check(weight)
        return spqr_rtn(weight, self)

    def gptq(
        self, weight: Tensor, hessian: Tensor, settings: GPTQSettings
    ) -> tuple[SpQRQuantized, Tensor, float]:
        """With GPTQ's ``settings``: ``(container, dequantized weight, damp)``."""
        result = spqr_quantize(
            weight,
            hessian,
            self,
            block_size=settings.block_size,
            act_order=settings.act_order,
            damp=settings.damp,
        )
        return result.quantized, result.weight, result.damp

    def guard_candidate(self, weight: Tensor) -> SpQRQuantized | None:
        """The same groups and budget without calibration (:meth:`rtn`)."""
        return self.rtn(weight)

    def matches(self, weight: Any) -> bool:
        """Whether a stored container is in this format (resumed blocks are checked)."""
        return isinstance(weight, SpQRQuantized) and (
            weight.bits,
            weight.stat_bits,
            weight.beta1,
            weight.beta2,
        ) == (self.bits, self.stat_bits, self.beta1, self.beta2)


@dataclass
class SpQRResult:
    """What :func:`spqr_quantize` returns.

    Attributes:
        quantized: the weight (:class:`SpQRQuantized`, stored in visiting order).
        weight: ``[out, in]`` fp32 dequantized weight in the original column order; equals
            ``quantized.dequantize()`` bit for bit.
        damp: the relative dampening finally used.
        tau: the absolute saliency threshold used.
        dead_columns: input channels with ``H[j, j] == 0``.
    """

    quantized: SpQRQuantized
    weight: Tensor
    damp: float
    tau: float
    dead_columns: int


def spqr_quantize(
    weight: Tensor,
    hessian: Tensor,
    spec: SpQRSpec,
    *,
    block_size: int = 128,
    act_order: bool = True,
    damp: float = 0.01,
    max_damp_tries: int = 6,
) -> SpQRResult:
    """SpQR-quantize one weight matrix (see the module docstring).

    Args:
        weight: ``[out, in]`` float weight (not modified).
        hessian: ``[in, in]`` ``2/N Σ x xᵀ`` of the inputs the weight multiplies.
        spec: the format and the outlier budget.
        block_size: columns per lazy update, rounded down to a multiple of ``beta1`` (at least
            one group), so a group's columns have all earlier updates when it is fitted.
        act_order: visit (and store) columns by decreasing ``H[j, j]``.
        damp: initial dampening relative to ``mean(diag H)`` (0 with an identity Hessian).
        max_damp_tries: factorisations tried (``damp`` x 10 each time) before an error.
    """
    spec.check(weight)
    out_f, in_f = weight.shape
    if hessian.shape != (in_f, in_f):
        raise LowbitError(
            f"the Hessian has shape {tuple(hessian.shape)}; a weight of input width {in_f} "
            f"needs ({in_f}, {in_f})"
        )
    if not bool(torch.isfinite(hessian).all()):
        raise LowbitError("the Hessian contains NaN or Inf")
    if not bool(torch.isfinite(weight).all()):
        raise LowbitError("the weight contains NaN or Inf; SpQR has no code for them")
    if block_size < 1:
        raise LowbitError(f"block_size must be at least 1, not {block_size}")
    block = max(spec.beta1, block_size // spec.beta1 * spec.beta1)
    with one_thread_on_cpu(weight.device):
        return _spqr(weight, hessian, spec, block, act_order, damp, max_damp_tries)


def _spqr(weight, hessian, spec: SpQRSpec, block, act_order, damp, max_damp_tries) -> SpQRResult:
    out_f, in_f = weight.shape
    device = weight.device
    prepared = prepare_hessian(hessian, damp, act_order, max_damp_tries=max_damp_tries)
    perm = prepared.perm
    w = prepared.visiting(weight)  # [out, in], visiting order
    upper = prepared.take_upper()  # [in, in]
    diag = upper.diagonal().clone()  # [in] U_jj

    budget = round(spec.outlier_fraction * out_f * in_f)
    if budget == 0:
        tau = math.inf
    elif spec.tau is not None:
        relative = (w.var(dim=0) / diag.square()).mean() if out_f > 1 else torch.tensor(1.0)
        tau = float(spec.tau * relative)
    else:
        tau = _budget_threshold(w, diag, spec, budget)

    wt = w.T.contiguous()  # [in, out], visiting order
    groups = math.ceil(in_f / spec.beta1)
    tiles = math.ceil(out_f / spec.beta2)
    codes_t = torch.empty(in_f, out_f, device=device)  # [in, out] codes
    outlier_t = torch.zeros(in_f, out_f, device=device)  # [in, out] fp16 residuals (as fp32)
    scale_codes = torch.empty(out_f, groups, dtype=torch.uint8, device=device)
    zero_codes = torch.empty_like(scale_codes)
    second = torch.empty(tiles, groups, 4, dtype=torch.float16, device=device)
    left = budget  # outliers the budget still allows
    s16 = z16 = None

    for start in range(0, in_f, block):
        end = min(start + block, in_f)
        block_w = wt[start:end]  # [b, out], updated in place
        errors = torch.empty_like(block_w)  # [b, out]
        block_u = upper[start:end, start:end]  # [b, b]
        for i in range(end - start):
            col = start + i
            if col % spec.beta1 == 0:
                g = col // spec.beta1
                g_end = min(col + spec.beta1, in_f)
                wg = wt[col:g_end].T.unsqueeze(1)  # [out, 1, g]
                d = diag[col:g_end].unsqueeze(0)  # [1, g]
                fit = _fit_groups(wg, _likely_outliers(wg, d, spec, tau, left), spec, d)
                scale_codes[:, g], zero_codes[:, g], second[:, g] = (
                    fit[0][:, 0],
                    fit[1][:, 0],
                    fit[2][:, 0],
                )
                s16, z16 = fit[3][:, 0], fit[4][:, 0]  # [out] fp16
            x = block_w[i]  # [out]
            q = weight_codes(x, s16, z16, spec.bits)
            final = decode_fp16(q, s16, z16).float()
            if left > 0:
                chosen = _choose_outliers(((x - final) / diag[col]).square(), tau, left)
                if chosen is not None:
                    left -= chosen.numel()
                    residual = (x[chosen] - final[chosen]).half().float()
                    outlier_t[col, chosen] = residual
                    final[chosen] += residual
            codes_t[col] = q
            err = (x - final) / block_u[i, i]  # [out]
            block_w[i:].addr_(block_u[i, i:], err, alpha=-1.0)  # rank-1 update [b - i, out]
            errors[i] = err
        wt[end:] -= upper[start:end, end:].T @ errors  # lazy update [in - end, out]

    residuals = outlier_t.T.contiguous()  # [out, in] visiting order
    quantized = SpQRQuantized(
        codes=codes_t.T.to(torch.uint8).contiguous(),
        scale_codes=scale_codes,
        zero_codes=zero_codes,
        second=second,
        outliers=make_outliers(residuals, residuals != 0, spec.sparse_format),
        perm=None if perm is None else perm.to(torch.int32).to(torch.int16),
        bits=spec.bits,
        stat_bits=spec.stat_bits,
        beta1=spec.beta1,
        beta2=spec.beta2,
        dtype=weight.dtype,
    )
    return SpQRResult(
        quantized,
        quantized.dequantize(torch.float32),
        prepared.damp,
        tau,
        int(prepared.dead.sum()),
    )


def spqr_rtn(weight: Tensor, spec: SpQRSpec) -> SpQRQuantized:
    """SpQR without calibration, vectorised: the column loop of :func:`spqr_quantize` with an
    identity Hessian has no error feedback, so every group is fitted at once (likely outliers
    left out, the best code pair per row, saliency = squared error) and the outliers are the
    weights above τ (when given), or the budget's most salient ones, over the whole matrix. Original column order. Memory:
    groups are processed in chunks of about 2**24 candidate weights."""
    if not bool(torch.isfinite(weight).all()):
        raise LowbitError("the weight contains NaN or Inf; SpQR has no code for them")
    w = weight.detach().float()
    out_f, in_f = w.shape
    ones = torch.ones(in_f, device=w.device)
    budget = round(spec.outlier_fraction * out_f * in_f)
    if budget == 0:
        tau = math.inf
    elif spec.tau is not None:
        tau = float(spec.tau * (w.var(dim=0).mean() if out_f > 1 else 1.0))
    else:
        tau = _budget_threshold(w, ones, spec, budget)
    groups = math.ceil(in_f / spec.beta1)
    scale_codes = torch.empty(out_f, groups, dtype=torch.uint8, device=w.device)
    zero_codes = torch.empty_like(scale_codes)
    second = torch.empty(math.ceil(out_f / spec.beta2), groups, 4, dtype=torch.float16,
                         device=w.device)  # fmt: skip
    dense = torch.empty_like(w)  # [out, in] decoded dense part (fp32 of fp16)
    codes = torch.empty(out_f, in_f, dtype=torch.uint8, device=w.device)
    chunks = list(_group_chunks(out_f, in_f, spec.beta1))
    likely_all = None  # [out, in]: left out of the statistics, the budget's largest at most
    if math.isfinite(tau) and not spec.simplified:
        reduction = torch.full_like(w, -torch.inf)  # [out, in] leave-one-out test
        for g0, g1, width in chunks:
            if width >= 3:
                cols = slice(g0 * spec.beta1, g0 * spec.beta1 + (g1 - g0) * width)
                wg = w[:, cols].reshape(out_f, g1 - g0, width)
                d = ones[: (g1 - g0) * width].view(g1 - g0, width)
                reduction[:, cols] = _loo_reduction(wg, d, spec.bits).flatten(1)
        likely_all = reduction > tau
        if int(likely_all.sum()) > budget:
            flat = torch.where(likely_all, reduction, -torch.inf).reshape(-1)
            likely_all = torch.zeros_like(flat, dtype=torch.bool)
            likely_all[flat.topk(budget).indices] = True
            likely_all = likely_all.view_as(w)
    for g0, g1, width in chunks:
        cols = slice(g0 * spec.beta1, g0 * spec.beta1 + (g1 - g0) * width)
        wg = w[:, cols].reshape(out_f, g1 - g0, width)
        d = ones[: (g1 - g0) * width].view(g1 - g0, width)
        likely = None if likely_all is None else likely_all[:, cols].reshape(wg.shape)
        sc, zc, sec, s16, z16 = _fit_groups(wg, likely, spec, d)
        q = weight_codes(wg, s16.unsqueeze(-1), z16.unsqueeze(-1), spec.bits)  # [out, G, g]
        dense[:, cols] = decode_fp16(q, s16.unsqueeze(-1), z16.unsqueeze(-1)).float().flatten(1)
        codes[:, cols] = q.flatten(1).to(torch.uint8)
        scale_codes[:, g0:g1], zero_codes[:, g0:g1], second[:, g0:g1] = sc, zc, sec
    residuals = torch.zeros_like(w)
    if math.isfinite(tau):
        saliency = (w - dense).square()  # [out, in], U_jj = 1
        # with tau: the weights above it; without: the budget's most salient (the pre-pass's
        # tau decided which weights the statistics left out)
        chosen = saliency > (tau if spec.tau is not None else 0.0)
        if int(chosen.sum()) > budget:
            flat = torch.where(chosen, saliency, -1.0).reshape(-1)
            chosen = torch.zeros_like(flat, dtype=torch.bool)
            chosen[flat.topk(budget).indices] = True
            chosen = chosen.view_as(w)
        residuals = torch.where(chosen, (w - dense).half().float(), residuals)
    return SpQRQuantized(
        codes=codes,
        scale_codes=scale_codes,
        zero_codes=zero_codes,
        second=second,
        outliers=make_outliers(residuals, residuals != 0, spec.sparse_format),
        perm=None,
        bits=spec.bits,
        stat_bits=spec.stat_bits,
        beta1=spec.beta1,
        beta2=spec.beta2,
        dtype=weight.dtype,
    )


def _group_chunks(out_f: int, in_f: int, beta1: int, budget: int = 1 << 20):
    """``(first group, end group, width)`` runs of whole groups (then the partial last one)
    with about ``budget`` weights each (the leave-one-out test holds 16x that)."""
    full = in_f // beta1
    per = max(1, budget // max(1, out_f * beta1))
    for g0 in range(0, full, per):
        yield g0, min(full, g0 + per), beta1
    if in_f % beta1:
        yield full, full + 1, in_f % beta1


def _fit_groups(wg: Tensor, likely: Tensor | None, spec: SpQRSpec, d: Tensor | None = None):
    """Bi-level statistics of groups ``wg [out, G, g]`` without their ``likely`` outliers.

    Returns ``(scale_codes [out, G], zero_codes [out, G], second [T, G, 4], scale16 [out, G],
    zero16 [out, G])``.
    """
    out_f, n_groups, g = wg.shape
    flat = wg.reshape(out_f * n_groups, g)
    keep = None if likely is None else ~likely.reshape(out_f * n_groups, g)
    scale, zero, degenerate = first_order_stats(flat, keep, spec.bits)
    scale, zero = scale.view(out_f, n_groups), zero.view(out_f, n_groups)
    degenerate = degenerate.view(out_f, n_groups)
    if bool(degenerate.any()):
        kept = flat if keep is None else torch.where(keep, flat, torch.inf)
        value = kept.amin(1).view(out_f, n_groups)
        value = torch.where(torch.isfinite(value), value, torch.zeros_like(value))
        scale, zero = fill_degenerate(scale, zero, degenerate, value, spec.beta2)
    sc, ss, sz = quantize_stats(scale, spec.stat_bits, spec.beta2)
    zc, zs, zz = quantize_stats(zero, spec.stat_bits, spec.beta2)
    tile_of = torch.arange(out_f, device=wg.device) // spec.beta2
    if d is not None:  # the main loop: the best code pair per row
        rows = (ss[tile_of], sz[tile_of], zs[tile_of], zz[tile_of])
        sc, zc = _search_codes(wg, keep, d, spec, rows)
    scale16 = decode_fp16(sc, ss[tile_of], sz[tile_of])
    zero16 = decode_fp16(zc, zs[tile_of], zz[tile_of])
    second = torch.stack([ss, zs, sz, zz], dim=-1)  # [T, G, 4]: q_ss, q_zs, q_sz, q_zz
    return sc, zc, second, scale16, zero16


def _search_codes(wg, keep, d, spec, second_rows):
    """Each row's (scale code, zero code) pair among all ``2**(2 stat_bits)`` under the tile's
    second-order statistics, minimising its saliency-weighted error ``Σ ((w − ŵ) / U_jj)²`` over
    the kept weights. Returns ``(scale_codes, zero_codes)`` uint8 ``[out, G]``."""
    ss, sz, zs, zz = (t.unsqueeze(-1) for t in second_rows)  # [out, G, 1]
    levels = torch.arange(2**spec.stat_bits, device=wg.device)
    scales = decode_fp16(levels, ss, sz)  # [out, G, L]
    zeros = decode_fp16(levels, zs, zz).unsqueeze(-1)  # [out, G, L, 1]
    w = wg.unsqueeze(2)  # [out, G, 1, g]
    weight = (1.0 / d.square()).view(1, d.shape[0], 1, d.shape[1])  # [1, G, 1, g]
    if keep is not None:
        weight = weight * keep.view(w.shape).float()
    best_err = best_s = best_z = None
    for a in range(levels.numel()):
        s = scales[..., a, None, None]  # [out, G, 1, 1]
        dq = decode_fp16(weight_codes(w, s, zeros, spec.bits), s, zeros).float()  # [out, G, L, g]
        err = ((w - dq).square() * weight).sum(-1)  # [out, G, L]
        err_z, z_code = err.min(-1)  # [out, G]
        if best_err is None:
            best_err, best_s, best_z = err_z, torch.zeros_like(z_code), z_code
        else:
            better = err_z < best_err
            best_err = torch.where(better, err_z, best_err)
            best_s = torch.where(better, a, best_s)
            best_z = torch.where(better, z_code, best_z)
    return best_s.to(torch.uint8), best_z.to(torch.uint8)


def _plain_quant_error(w: Tensor, bits: int) -> Tensor:
    """``w − dequant(quant(w))`` with plain fp32 min-max statistics over the last axis."""
    flat = w.reshape(-1, w.shape[-1])
    scale, zero, _ = first_order_stats(flat, None, bits)
    scale, zero = scale[:, None], zero[:, None]
    q = torch.round(flat / scale + zero).clamp_(0, 2**bits - 1)
    return (flat - scale * (q - zero)).view_as(w)


def _loo_reduction(wg: Tensor, d: Tensor, bits: int) -> Tensor:
    """SpQR's leave-one-out test for groups ``wg [out, G, g]`` (``U_jj`` ``d [G, g]``): how much
    the group's saliency-weighted error drops when each weight is left out of the min-max fit
    (and not quantized). Returns ``[out, G, g]``."""
    g = wg.shape[-1]
    idx = torch.arange(g, device=wg.device)
    others = idx[1:] - (idx[:, None] >= idx[1:]).to(idx.dtype)  # [g, g - 1]: all but k
    loo = wg[..., others]  # [out, G, g, g - 1]
    loo_error = (_plain_quant_error(loo, bits) / d[:, others]).square().sum(-1)  # [out, G, g]
    base = (_plain_quant_error(wg, bits) / d).square().sum(-1, keepdim=True)  # [out, G, 1]
    return base - loo_error


def _likely_outliers(wg: Tensor, d: Tensor, spec: SpQRSpec, tau: float, left: int) -> Tensor | None:
    """The weights kept out of the statistics of groups ``wg [out, G, g]`` (bool, or None):
    those whose leave-one-out error reduction exceeds ``tau``, the ``left`` largest at most (a
    weight left out that the budget cannot take as an outlier would be clamped). The simplified
    variant (and groups of fewer than 3 columns) keeps every weight in, as SpQR's
    ``simplified_outliers``."""
    if not math.isfinite(tau) or spec.simplified or wg.shape[-1] < 3 or left <= 0:
        return None
    reduction = _loo_reduction(wg, d, spec.bits)
    likely = reduction > tau
    if int(likely.sum()) > left:
        flat = torch.where(likely, reduction, -torch.inf).reshape(-1)
        likely = torch.zeros_like(flat, dtype=torch.bool)
        likely[flat.topk(left).indices] = True
        likely = likely.view_as(reduction)
    return likely


def _choose_outliers(saliency: Tensor, tau: float, left: int) -> Tensor | None:
    """Indices of one column's outliers: saliency above ``tau``, the ``left`` most salient at
    most."""
    candidates = (saliency > tau).nonzero().squeeze(1)
    if candidates.numel() == 0:
        return None
    if candidates.numel() > left:
        candidates = candidates[saliency[candidates].topk(left).indices]
    return candidates


def _saliency_at(w, d, spec, tau, reduction) -> Tensor:
    """Saliency ``[out, G, g]`` of groups ``w [out, G, g]`` fitted without their likely outliers
    at threshold ``tau`` (``reduction``: their leave-one-out test, or None)."""
    likely = None if reduction is None else reduction > tau
    *_, s16, z16 = _fit_groups(w, likely, spec)
    s16, z16 = s16.unsqueeze(-1), z16.unsqueeze(-1)  # [out, G, 1]
    dq = decode_fp16(weight_codes(w, s16, z16, spec.bits), s16, z16).float()
    return ((w - dq) / d).square()


def _budget_threshold(w: Tensor, diag: Tensor, spec: SpQRSpec, budget: int) -> float:
    """The threshold at which a pre-pass over the unupdated weights (every group fitted as the
    column loop fits it, without GPTQ's updates) flags ``budget`` weights: bisection on
    ``log τ``, keeping the largest count not over the budget."""
    out_f, in_f = w.shape
    parts = []  # (weights [out, G, g], U_jj [G, g], leave-one-out reductions or None)
    for g0, g1, width in _group_chunks(out_f, in_f, spec.beta1):
        cols = slice(g0 * spec.beta1, g0 * spec.beta1 + (g1 - g0) * width)
        wg = w[:, cols].reshape(out_f, g1 - g0, width)
        d = diag[cols].view(g1 - g0, width)
        loo = None if spec.simplified or width < 3 else _loo_reduction(wg, d, spec.bits)
        parts.append((wg, d, loo))

    def count(tau: float) -> int:
        return sum(int((_saliency_at(wg, d, spec, tau, loo) > tau).sum()) for wg, d, loo in parts)

    plain = torch.cat([_saliency_at(wg, d, spec, math.inf, None).reshape(-1) for wg, d, _ in parts])
    positive = plain[plain > 0]
    if positive.numel() == 0:
        return math.inf
    log_lo = math.log(float(positive.min())) - 1.0  # flags (almost) everything
    log_hi = math.log(float(positive.max())) + 1.0  # flags nothing
    best_tau, best_count = math.exp(log_hi), 0
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (log_lo + log_hi)
        n = count(math.exp(mid))
        if n > budget:
            log_lo = mid
        else:
            if n >= best_count:
                best_tau, best_count = math.exp(mid), n
            log_hi = mid
        if budget - _BUDGET_SLACK * budget <= best_count <= budget:
            break
    return best_tau


_BISECTION_STEPS = 24
_BUDGET_SLACK = 0.01  # stop once the pre-pass count is within 1% under the budget
