"""The weight algorithm of the 2/4/16 mixed-precision paper (Li et al., 2024): which column
groups get 4 bits, which weights stay fp16, and GPTQ (or RTN) under the mixed 2/4-bit format of
:mod:`lowbit.formats.mixed`.

Pure tensor math on a weight ``W [N, K]`` and the Hessian ``H = 2/N Σ x xᵀ [K, K]`` of its
inputs (from :mod:`lowbit.calibrate`); nothing here knows a model.

* **Sensitivity** (eq. 9): ``S_i = Σ_{m<16} Σ_rows w² / ([H⁻¹]_jj)²`` over the 16 input
  channels ``j = 16 i + m`` of column group ``i``, with ``H⁻¹`` GPTQ's dampened inverse (the
  same dampening GPTQ then uses). Without a Hessian (RTN) ``H⁻¹ = I``: the groups' energy.
* **Mixing**: the ``round(frac_4bit * G)`` most sensitive groups are 4-bit, the rest 2-bit.
  The 2-bit groups' triplet positions with a 4-bit scale code go to their most sensitive
  third (:func:`lowbit.formats.mixed.triplet_order`).
* **Exclusive outliers**: ``round(outlier_fraction * N * K)`` weights, all in 2-bit groups,
  kept in fp16. Chosen greedily by what leaving a weight out of its row group's range saves:
  ``(R² - R'²) Σ_j 1 / [H⁻¹]_jj`` (the group's range before and after, times the OBS weight of
  its columns: a uniform grid's squared rounding error grows with ``R²``). Only a group's
  current largest or smallest weight can shrink its range; each round takes the best half of
  the remaining budget, then ranges are recomputed.
* **GPTQ**: statistics are fixed up front from the original weight (static groups, so
  act-order only changes the visiting order); each column is rounded with its group's width,
  scale and zero, and an outlier keeps its (updated) value in fp16 with its code at the zero
  point. The error fed back is that of the stored value, so the returned weight equals the
  container's ``dequantize()`` bit for bit. Dead inputs (``H[j, j] == 0``) are zeroed as in
  GPTQ.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.algorithms.gptq import GPTQSettings, one_thread_on_cpu, prepare_hessian
from lowbit.errors import LowbitError
from lowbit.formats.mixed import (
    GROUP,
    MixedQuantized,
    _padded_groups,
    group_statistics,
    mixed_rtn,
    mixed_statistics,
)

__all__ = [
    "MixedWeightSpec",
    "MixedResult",
    "inverse_hessian_diagonal",
    "group_sensitivity",
    "choose_4bit_groups",
    "choose_outliers",
    "mixed_quantize",
]


def inverse_hessian_diagonal(hessian: Tensor, damp: float = 0.01) -> tuple[Tensor, float]:
    """``diag((H + λI)⁻¹)`` fp32 ``[K]`` with GPTQ's dampening (dead inputs set to 1 first)
    and the relative dampening used."""
    prepared = prepare_hessian(hessian, damp, act_order=False)
    return prepared.inverse_diagonal(), prepared.damp


def group_sensitivity(weight: Tensor, hinv_diag: Tensor | None = None) -> Tensor:
    """Eq. 9: ``S_i = Σ_m Σ_rows w² / ([H⁻¹]_jj)²`` per 16-channel column group, fp32 ``[G]``
    (``hinv_diag`` ``[K]``; None = 1)."""
    w2 = weight.float().square()  # [N, K]
    if hinv_diag is not None:
        w2 = w2 / hinv_diag.float().square()
    return _padded_groups(w2).sum((0, 2))  # [G]


def choose_4bit_groups(sensitivity: Tensor, frac_4bit: float) -> Tensor:
    """``[G]`` bool: the ``round(frac_4bit * G)`` groups of largest sensitivity (ties: the
    earlier group)."""
    g = sensitivity.numel()
    n4 = round(frac_4bit * g)
    is4 = torch.zeros(g, dtype=torch.bool, device=sensitivity.device)
    if n4:
        is4[torch.argsort(sensitivity, descending=True, stable=True)[:n4]] = True
    return is4


def choose_outliers(
    weight: Tensor, is4: Tensor, count: int, importance: Tensor | None = None
) -> Tensor:
    """``[N, K]`` bool: ``count`` weights of 2-bit groups to keep in fp16 (module doc).

    Args:
        weight: ``[N, K]``.
        is4: ``[G]`` bool, the 4-bit groups (never chosen from).
        count: how many (at most the 2-bit groups' weights).
        importance: ``[K]`` per-column weight of a rounding error (``1 / [H⁻¹]_jj``); None = 1.
    """
    n, k = weight.shape
    groups = _padded_groups(weight)  # [N, G, 16]
    two = torch.nonzero(~is4).squeeze(1)
    real = torch.zeros(groups.shape[1] * GROUP, dtype=torch.bool, device=weight.device)
    real[:k] = True
    real = real.view(-1, GROUP)[two]  # [n2, 16] real columns of the 2-bit groups
    count = min(count, int(real.sum()) * n)
    selected = torch.zeros(n, two.numel(), GROUP, dtype=torch.bool, device=weight.device)
    if count <= 0 or two.numel() == 0:
        return torch.zeros(n, k, dtype=torch.bool, device=weight.device)
    values = groups[:, two]  # [N, n2, 16]
    if importance is None:
        col_weight = real.float().sum(1)  # [n2]
    else:
        imp = torch.zeros(groups.shape[1] * GROUP, device=weight.device)
        imp[:k] = importance.float()
        col_weight = imp.view(-1, GROUP)[two].sum(1)
    inf = float("inf")
    left = count
    while left > 0:
        out = selected | ~real  # left out of the range: chosen, or padding
        hi = torch.where(out, -inf, values).topk(2, -1)  # [N, n2, 2]
        lo = torch.where(out, inf, values).topk(2, -1, largest=False)
        hi1, hi2 = hi.values[..., 0].clamp(min=0), hi.values[..., 1].clamp(min=0)
        lo1, lo2 = lo.values[..., 0].clamp(max=0), lo.values[..., 1].clamp(max=0)
        full = (hi1 - lo1).square()
        gain_hi = full - (hi2 - lo1).square()  # [N, n2]: leave the largest out
        gain_lo = full - (hi1 - lo2).square()
        take_hi = gain_hi >= gain_lo
        gain = torch.where(take_hi, gain_hi, gain_lo) * col_weight
        where = torch.where(take_hi, hi.indices[..., 0], lo.indices[..., 0])  # [N, n2]
        gain = torch.where(torch.isfinite(gain), gain, 0.0).flatten()
        step = min(left, max(1, math.ceil(left / 2)))
        best = gain.topk(step)
        picks = best.indices[best.values > 0]
        if picks.numel() == 0:
            break
        rows, grp = picks // two.numel(), picks % two.numel()
        selected[rows, grp, where.flatten()[picks]] = True
        left -= picks.numel()
    mask = torch.zeros(n, groups.shape[1], GROUP, dtype=torch.bool, device=weight.device)
    mask[:, two] = selected
    return mask.view(n, -1)[:, :k]


@dataclass
class MixedResult:
    """What :func:`mixed_quantize` returns.

    Attributes:
        quantized: the packed weight.
        weight: ``[N, K]`` fp32 dequantized weight (``quantized.dequantize()`` bit for bit).
        damp: relative dampening used (None for RTN).
        sensitivity: ``[G]`` eq. 9's sensitivity of each column group.
        is4: ``[G]`` bool, the 4-bit groups.
        seconds: wall time.
    """

    quantized: MixedQuantized
    weight: Tensor
    damp: float | None
    sensitivity: Tensor
    is4: Tensor
    seconds: float


@dataclass(frozen=True, eq=False)
class MixedWeightSpec:
    """How a weight is quantized in the mixed 2/4-bit format (a weight spec of
    :func:`lowbit.algorithms.weights.quantize_linears`).

    Attributes:
        frac_4bit: share of the 16-channel column groups in 4 bits (0 to 1).
        outlier_fraction: share of all weights kept in fp16, chosen in 2-bit groups (0 to 0.05).
        g2: rows per second-order scale group.
        mse_clip: search a shrunk range per row group before the second order.
        is4: a fixed ``[G]`` choice of 4-bit groups (e.g. the one QAT trained with); None =
            eq. 9's choice from the layer's Hessian.
    """

    frac_4bit: float = 0.25
    outlier_fraction: float = 0.002
    g2: int = 16
    mse_clip: bool = True
    is4: Tensor | None = None

    def check(self, weight: Tensor, name: str = "weight") -> None:
        if not 0.0 <= self.frac_4bit <= 1.0:
            raise LowbitError(f"frac_4bit must be in [0, 1], not {self.frac_4bit}")
        if not 0.0 <= self.outlier_fraction <= 0.05:
            raise LowbitError(f"outlier_fraction must be in [0, 0.05], not {self.outlier_fraction}")
        if isinstance(self.g2, bool) or not isinstance(self.g2, int) or self.g2 < 1:
            raise LowbitError(f"g2 must be a positive integer, not {self.g2!r}")
        if weight.dim() != 2:
            raise LowbitError(f"{name} must be a [out, in] matrix, not {tuple(weight.shape)}")
        if weight.shape[1] > 65536:
            raise LowbitError(f"{name} is {weight.shape[1]} wide; outlier columns fit 16 bits")
        groups = math.ceil(weight.shape[1] / GROUP)
        if self.is4 is not None and self.is4.shape != (groups,):
            raise LowbitError(f"the fixed 4-bit groups of {name} must be a [{groups}] mask")

    def describe(self) -> str:
        clip = ", mse-clip" if self.mse_clip else ""
        return (
            f"mixed 2/4-bit ({self.frac_4bit:.0%} 4-bit groups, {self.outlier_fraction:.2%} "
            f"fp16 outliers, g1 16, g2 {self.g2}{clip})"
        )

    def rtn(self, weight: Tensor) -> MixedQuantized:
        return mixed_quantize(weight, None, self).quantized

    def gptq(
        self, weight: Tensor, hessian: Tensor, settings: GPTQSettings
    ) -> tuple[MixedQuantized, Tensor, float]:
        """GPTQ under the mixed format: ``(container, its dequantized weight, damp)``."""
        result = mixed_quantize(
            weight,
            hessian,
            self,
            block_size=settings.block_size,
            act_order=settings.act_order,
            damp=settings.damp,
        )
        return result.quantized, result.weight, result.damp

    def guard_candidate(self, weight: Tensor) -> MixedQuantized | None:
        """None: no RTN guard. RTN has no Hessian, so it would choose other 4-bit groups and
        outliers than GPTQ; the whole-model comparison is the RTN row of
        docs/results/mixed.md."""
        return None

    def matches(self, weight) -> bool:
        """Whether a stored container is in this format (resumed blocks are checked)."""
        if not isinstance(weight, MixedQuantized) or weight.g2 != self.g2:
            return False
        return weight.n4 == round(self.frac_4bit * weight.groups) or self.is4 is not None


def mixed_quantize(
    weight: Tensor,
    hessian: Tensor | None,
    spec: MixedWeightSpec,
    *,
    block_size: int = 128,
    act_order: bool = True,
    damp: float = 0.01,
    dynamic: bool = False,
) -> MixedResult:
    """Quantize one weight in the mixed format: GPTQ with a Hessian, RTN without.

    Args:
        weight: ``[N, K]`` float weight (not modified).
        hessian: ``[K, K]`` ``2/N Σ x xᵀ`` of its inputs, or None for RTN.
        spec: the format's settings.
        block_size, act_order, damp: GPTQ's (see :func:`lowbit.algorithms.gptq.gptq_quantize`).
    """
    start = time.perf_counter()
    spec.check(weight)
    n, k = weight.shape
    w = weight.detach().float().clone()  # [N, K]
    hinv = None
    used = None
    if hessian is not None:
        if hessian.shape != (k, k):
            raise LowbitError(f"the Hessian has shape {tuple(hessian.shape)}; expected ({k}, {k})")
        if not bool(torch.isfinite(hessian).all()):
            raise LowbitError("the Hessian contains NaN or Inf")
        natural = prepare_hessian(hessian, damp, act_order=False)
        w[:, natural.dead] = 0.0
        hinv, used = natural.inverse_diagonal(), natural.damp
    sensitivity = group_sensitivity(w, hinv)
    is4 = spec.is4.to(w.device) if spec.is4 is not None else None
    if is4 is None:
        is4 = choose_4bit_groups(sensitivity, spec.frac_4bit)
    count = round(spec.outlier_fraction * n * k)
    outliers = choose_outliers(w, is4, count, None if hinv is None else 1.0 / hinv)
    stats = mixed_statistics(
        w, is4, outliers, g2=spec.g2, mse_clip=spec.mse_clip, priority=sensitivity
    )
    if hessian is None:
        codes, sparse = mixed_rtn(w, stats, outliers)
    else:
        with one_thread_on_cpu(w.device):
            codes, sparse = _gptq(
                w, hessian, stats, outliers, block_size, act_order, used, dynamic, spec.mse_clip
            )
    quantized = MixedQuantized.from_parts(codes, stats, sparse, (n, k), weight.dtype)
    g = stats.scale.shape[1]
    dense = (codes.float().view(n, g, GROUP) - stats.zero[..., None]) * stats.scale[..., None]
    values = dense.view(n, -1)[:, :k] + sparse
    return MixedResult(
        quantized, values, used, sensitivity, is4, seconds=time.perf_counter() - start
    )


def _visiting_order(h_diag: Tensor, k: int, act_order: bool, dynamic: bool) -> Tensor:
    """Columns in GPTQ's visiting order. Static statistics: by decreasing ``H[j, j]`` (GPTQ's
    act-order). Dynamic ones: whole groups at a time (a group's statistics are taken when it is
    reached), groups by decreasing ``Σ H[j, j]``, columns within a group likewise."""
    if not act_order:
        return torch.arange(k, device=h_diag.device)
    if not dynamic:
        return torch.argsort(h_diag, descending=True, stable=True)
    energy = _padded_groups(h_diag[None].float()).sum((0, 2))  # [G]
    groups = torch.argsort(energy, descending=True, stable=True).tolist()
    if k % GROUP:  # the partial group last: every other group stays 16-aligned in the order
        groups.remove(k // GROUP)
        groups.append(k // GROUP)
    order = []
    for g in groups:
        cols = torch.arange(g * GROUP, min(g * GROUP + GROUP, k), device=h_diag.device)
        order.append(cols[torch.argsort(h_diag[cols], descending=True, stable=True)])
    return torch.cat(order)


def _gptq(w, hessian, stats, outliers, block_size, act_order, damp, dynamic, mse_clip):
    """GPTQ's column loop under the mixed format -> (codes [N, 16 G] uint8, sparse [N, K]
    fp32 fp16-rounded outlier values). ``stats`` is filled in place when ``dynamic`` (each
    group's statistics from its weights as updated when it is reached), else used as is."""
    n, k = w.shape
    prepared = prepare_hessian(  # from the damp the diagonal needed
        hessian, damp, order_of=lambda diag: _visiting_order(diag, k, act_order, dynamic)
    )
    order = prepared.perm  # [K]
    upper = prepared.take_upper()  # [K, K]
    wt = w.T[order].contiguous()  # [K, N] in visiting order (dead columns already zero)
    out_t = outliers.T[order].contiguous()  # [K, N]
    col_group = (order // GROUP).tolist()
    has_outlier = out_t.any(1).tolist()
    qmax = stats.qmax().tolist()
    clipped = stats.clipped()
    scale_t = stats.scale.T.contiguous()  # [G, N]
    inv_t = torch.reciprocal(scale_t)
    zero_t = stats.zero.T.contiguous()
    codes_t = torch.empty_like(wt)
    values_t = torch.empty_like(wt)
    if dynamic and block_size % GROUP:
        raise LowbitError(f"block_size must be a multiple of {GROUP} with dynamic statistics")
    previous = -1
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        block = wt[start:end]  # [b, N], updated in place
        errors = torch.empty_like(block)
        block_u = upper[start:end, start:end]
        for i in range(end - start):
            col = start + i
            g = col_group[col]
            if dynamic and g != previous:  # the group's columns follow: take its statistics
                width = min(GROUP, k - g * GROUP)
                values = torch.zeros(n, 1, GROUP, device=w.device)
                within = order[col : col + width] - g * GROUP  # natural positions
                values[:, 0, within] = block[i : i + width].T
                mask = torch.zeros(n, 1, GROUP, dtype=torch.bool, device=w.device)
                mask[:, 0, :width] = outliers[:, g * GROUP : g * GROUP + width]
                bits = 4 if qmax[g] == 15.0 else 2
                code, zero, s2, z2, scale = group_statistics(
                    values, bits, mask, stats.g2, clipped[g : g + 1], mse_clip
                )
                stats.code[:, g], stats.zero[:, g] = code[:, 0], zero[:, 0]
                stats.s2[:, g], stats.z2[:, g], stats.scale[:, g] = s2[:, 0], z2[:, 0], scale[:, 0]
                scale_t[g], zero_t[g], inv_t[g] = scale[:, 0], zero[:, 0], 1.0 / scale[:, 0]
            previous = g
            x = block[i]  # [N]
            z = zero_t[g]
            q = (torch.round(x * inv_t[g]) + z).clamp_(0.0, qmax[g])
            dq = (q - z) * scale_t[g]
            if has_outlier[col]:
                keep = out_t[col]
                q = torch.where(keep, z, q)
                dq = torch.where(keep, x.half().float(), dq)
            codes_t[col], values_t[col] = q, dq
            err = (x - dq) / block_u[i, i]
            block[i:].addr_(block_u[i, i:], err, alpha=-1.0)
            errors[i] = err
        wt[end:] -= upper[start:end, end:].T @ errors
    inverse = torch.argsort(order)
    codes = codes_t[inverse].T  # [N, K]
    values = values_t[inverse].T
    g = stats.scale.shape[1]
    full = stats.zero.repeat_interleave(GROUP, 1).clone()  # [N, 16 G]: padding at the zero
    full[:, :k] = codes
    sparse = torch.where(outliers, values, torch.zeros((), device=w.device))
    return full.to(torch.uint8).view(n, g * GROUP), sparse
