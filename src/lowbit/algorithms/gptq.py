"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized so that the layer's output on calibration inputs changes least.

Pure tensor math: a weight ``W [out, in]``, the Hessian ``H = 2/N Σ x xᵀ [in, in]`` of the
inputs it multiplies, and an :class:`~lowbit.algorithms.rtn.IntWeightSpec`. Nothing here knows
a model (see :mod:`lowbit.calibrate` for where ``H`` comes from).

Conventions:

* Scales follow :class:`~lowbit.formats.intq.IntQuantized`: codes are chosen with the fp32
  scale, the scale is stored in fp16, and values are ``q * scale16`` (or ``(q - zero) *
  scale16``). The error fed back to later columns is that of the stored value, so the returned
  dequantized weight equals ``result.quantized.dequantize()`` bit for bit.
* Per channel (``group_size=None``) the row scales come from the whole original row, before any
  update (as in GPTQ).
* Groups, ``static_groups=True``: every group's scale is computed up front from the original
  weight, in original column order. Act-order then only changes the order in which columns are
  visited, never which scale a column uses, so the result is a plain grouped format (no group
  index). ``static_groups=False`` (GPTQ's original): a group's scale is computed from the
  already-updated weights when its first column is reached; only allowed without act-order,
  because with act-order the groups would follow the permuted order and need an index that the
  plain grouped format does not store. Default: static with act-order, dynamic without.
* Dead inputs (``H[j, j] == 0``: the input channel is always zero): the weight column is set to
  0 and ``H[j, j]`` to 1, as in GPTQ; the output does not depend on that column.
* Dampening: ``λ = damp · mean(diag H)`` is added to the diagonal; while the Cholesky
  factorisation fails, ``λ`` is multiplied by 10 (at most ``max_damp_tries`` times), then a
  :class:`~lowbit.errors.LowbitError`. The factorisation runs in float64.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.algorithms.rtn import IntWeightSpec
from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized, int_qrange, int_scale_zero
from lowbit.formats.packing import pack_bits

__all__ = ["GPTQResult", "gptq_quantize", "inverse_hessian_factor"]


@dataclass
class GPTQResult:
    """What :func:`gptq_quantize` returns.

    Attributes:
        quantized: the packed weight (codes, fp16 scales, integer zeros), a plain per-channel or
            grouped :class:`IntQuantized` in original column order.
        weight: [out, in] fp32 dequantized weight; equals ``quantized.dequantize()`` bit for bit.
        damp: the relative dampening finally used (``damp · 10**retries``).
        dead_columns: number of input channels with ``H[j, j] == 0``.
    """

    quantized: IntQuantized
    weight: Tensor
    damp: float
    dead_columns: int

    def storage_bits(self) -> int:
        return self.quantized.storage_bits()


def inverse_hessian_factor(
    hessian: Tensor, damp: float = 0.01, max_damp_tries: int = 6
) -> tuple[Tensor, float]:
    """Upper Cholesky factor ``U`` of the dampened inverse Hessian: ``Uᵀ U = (H + λI)⁻¹``.

    Args:
        hessian: [n, n] symmetric positive semi-definite, no zero diagonal entries.
        damp: initial ``λ / mean(diag H)``; multiplied by 10 after each failed factorisation.
        max_damp_tries: factorisations tried before giving up.

    Returns:
        ``(U [n, n] float64, damp used)``.
    """
    h = hessian.double()
    mean_diag = h.diagonal().mean().item()
    if not mean_diag > 0:
        raise LowbitError("the Hessian has no positive diagonal entry; no calibration input?")
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    # With P the order reversal and P H P = L Lᵀ: H⁻¹ = (P L⁻¹ P)ᵀ (P L⁻¹ P), and P L⁻¹ P is
    # upper triangular with a positive diagonal, so it is U. One factorisation and one
    # triangular solve (torch.cholesky_inverse is ~20x slower on CPU at n = 1536).
    flipped = h.flip(0, 1)
    relative = damp
    for _ in range(max_damp_tries):
        lower, info = torch.linalg.cholesky_ex(flipped + relative * mean_diag * eye)
        if info.item() == 0:
            upper = torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1)
            if bool(torch.isfinite(upper).all()):
                return upper, relative
        relative *= 10.0
    raise LowbitError(
        f"the Hessian is not positive definite even with dampening {relative / 10:g} x mean "
        "diagonal; the calibration data may be degenerate"
    )


def _stats(weight: Tensor, spec: IntWeightSpec, group_size: int | None):
    """fp32 scale [out, G] (for choosing codes), fp16-rounded scale, zero (or None)."""
    scale, zero = int_scale_zero(
        weight,
        spec.bits,
        symmetric=spec.symmetric,
        axis=-1,
        group_size=group_size,
        mse_search=spec.mse_clip,
        scale_rule=spec.scale_rule,
    )
    return scale, scale.to(torch.float16).float(), zero


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    spec: IntWeightSpec,
    *,
    block_size: int = 128,
    act_order: bool = True,
    damp: float = 0.01,
    static_groups: bool | None = None,
    max_damp_tries: int = 6,
) -> GPTQResult:
    """GPTQ-quantize one weight matrix.

    Args:
        weight: [out, in] float weight (not modified).
        hessian: [in, in] ``2/N Σ x xᵀ`` of the inputs the weight multiplies (not modified).
        spec: bits, group size (along ``in``), symmetric, MSE clip search.
        block_size: columns updated together before the lazy batch update of the rest.
        act_order: visit columns by decreasing ``H[j, j]`` (largest input energy first).
        damp: initial dampening relative to ``mean(diag H)``.
        static_groups: see module docstring; None = ``act_order``.
        max_damp_tries: factorisations tried (``damp`` x 10 each time) before an error.

    Returns:
        :class:`GPTQResult`.
    """
    spec.check(weight)
    in_features = weight.shape[1]
    if hessian.shape != (in_features, in_features):
        raise LowbitError(
            f"the Hessian has shape {tuple(hessian.shape)}; a weight of input width "
            f"{in_features} needs ({in_features}, {in_features})"
        )
    if not bool(torch.isfinite(hessian).all()):
        raise LowbitError("the Hessian contains NaN or Inf")
    if block_size < 1:
        raise LowbitError(f"block_size must be at least 1, not {block_size}")
    group = spec.group_size
    static = act_order if static_groups is None else static_groups
    if act_order and group is not None and not static:
        raise LowbitError(
            "act_order with dynamic groups needs a group index that the plain grouped format "
            "does not store; use static_groups=True"
        )
    with _one_thread_on_cpu(weight.device):
        return _gptq(weight, hessian, spec, static, block_size, act_order, damp, max_damp_tries)


def _gptq(weight, hessian, spec, static, block_size, act_order, damp, max_damp_tries):
    """:func:`gptq_quantize` after its checks."""
    out_features, in_features = weight.shape
    group = spec.group_size
    qmin = int_qrange(spec.bits, spec.symmetric)[0]
    w = weight.detach().float().clone()  # [out, in]
    scale, scale16, zero = _stats(w, spec, group)  # [out, G] each (G = 1 per channel)
    h = hessian.detach().double().clone()  # [in, in]
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        w = w[:, perm]
        h = h[perm][:, perm]
    upper, damp_used = inverse_hessian_factor(h, damp, max_damp_tries)
    upper = upper.float()  # [in, in]

    # Work on Wᵀ [in, out]: a column of W is a contiguous row, so the per-column rank-1
    # updates touch contiguous memory. Statistics are transposed the same way: [G, out].
    wt = w.T.contiguous()  # [in, out], visiting order
    inv_scale_t = torch.reciprocal(scale).T.contiguous()  # codes are x * (1/scale), as in intq
    scale16_t = scale16.T.contiguous()  # [G, out]
    zero_t = None if zero is None else zero.T.contiguous()
    original = perm if perm is not None else torch.arange(in_features, device=w.device)
    group_of = (original // group if group is not None else original * 0).tolist()
    codes_t = torch.empty_like(wt)  # [in, out] fp32 integer values, visiting order
    values_t = torch.empty_like(wt)  # [in, out] dequantized, visiting order

    _quantize_columns(
        wt, upper, block_size, group, static, spec, group_of,
        inv_scale_t, scale16_t, zero_t, codes_t, values_t,
    )  # fmt: skip

    if perm is not None:
        inverse_perm = torch.argsort(perm)
        codes_t, values_t = codes_t[inverse_perm], values_t[inverse_perm]
    codes, values = codes_t.T, values_t.T.contiguous()  # [out, in]
    scale16 = scale16_t.T.contiguous()
    zero = None if zero_t is None else zero_t.T.contiguous()
    offset = -qmin  # symmetric codes are stored unsigned, shifted by 2**(b-1)
    quantized = IntQuantized(
        qdata=pack_bits((codes + offset).to(torch.uint8).reshape(-1), spec.bits),  # row-major
        scale=scale16,
        zero=zero,
        bits=spec.bits,
        symmetric=spec.symmetric,
        axis=-1,
        group_size=group,
        shape=weight.shape,
        dtype=torch.float32,
        scale_dtype=torch.float16,
    )
    return GPTQResult(quantized, values, damp_used, int(dead.sum()))


@contextmanager
def _one_thread_on_cpu(device: torch.device):
    """Run GPTQ with one intra-op thread on CPU.

    Its column loop's operations are on vectors of ``out`` elements, too small to gain from
    threads; with threads they lose badly when cores are shared (docs/results/gptq.md).
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _quantize_columns(
    wt, upper, block_size, group, static, spec, group_of,
    inv_scale_t, scale16_t, zero_t, codes_t, values_t,
) -> None:  # fmt: skip
    """GPTQ's column loop on Wᵀ [in, out] in visiting order; fills ``codes_t``, ``values_t``
    (and the statistics of dynamic groups) in place."""
    in_features = wt.shape[0]
    qmin, qmax = int_qrange(spec.bits, spec.symmetric)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block = wt[start:end]  # [b, out], updated in place
        errors = torch.empty_like(block)  # [b, out]
        block_u = upper[start:end, start:end]  # [b, b]
        for i in range(end - start):
            col = start + i
            g = group_of[col]
            if group is not None and not static and col % group == 0:
                # dynamic group: statistics of this group's weights as updated so far
                s, s16, z = _stats(wt[col : col + group].T, spec, None)  # [out, 1] each
                scale16_t[g], inv_scale_t[g] = s16[:, 0], torch.reciprocal(s[:, 0])
                if zero_t is not None:
                    zero_t[g] = z[:, 0]
            x = block[i]  # [out]
            q = torch.round(x * inv_scale_t[g])
            if zero_t is not None:
                q += zero_t[g]
            q.clamp_(qmin, qmax)
            dq = (q - zero_t[g]) * scale16_t[g] if zero_t is not None else q * scale16_t[g]
            codes_t[col], values_t[col] = q, dq
            err = (x - dq) / block_u[i, i]  # [out]
            block[i:].addr_(block_u[i, i:], err, alpha=-1.0)  # rank-1 update [b - i, out]
            errors[i] = err
        wt[end:] -= (
            upper[start:end, end:].T @ errors
        )  # lazy update of later columns [in - end, out]
