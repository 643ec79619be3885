"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized so that the layer's output on calibration inputs changes least.

Pure tensor math: a weight ``W [out, in]``, the Hessian ``H = 2/N Σ x xᵀ [in, in]`` of the
inputs it multiplies, and an integer format (:class:`~lowbit.algorithms.int_spec.IntWeightSpec`,
which calls :func:`gptq_quantize`). Nothing here knows a model (see :mod:`lowbit.calibrate` for
where ``H`` comes from).

GPTQ's prologue, :func:`prepare_hessian` (dead inputs, act-order, the dampened Cholesky factor of
``H⁻¹``), is shared with SpQR (:mod:`lowbit.algorithms.spqr`) and the mixed 2/4/16 format
(:mod:`lowbit.algorithms.mixed`), and :class:`GPTQSettings` is how
:func:`~lowbit.algorithms.weights.quantize_linears` runs any of them.

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
  :class:`~lowbit.errors.LowbitError` (with ``damp = 0``, an exact Hessian, one try). The
  factorisation runs in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.algorithms import gptq_native
from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized, int_qrange, int_scale_zero
from lowbit.formats.packing import pack_bits
from lowbit.mapped import discard_tail

__all__ = [
    "GPTQSettings",
    "GPTQResult",
    "PreparedHessian",
    "gptq_quantize",
    "inverse_hessian_factor",
    "one_thread_on_cpu",
    "prepare_hessian",
]


@dataclass(frozen=True, kw_only=True)
class GPTQSettings:
    """How :func:`~lowbit.algorithms.weights.quantize_linears` runs GPTQ (for any weight format:
    each spec's ``gptq()`` reads the loop's settings, the driver the run's).

    Attributes:
        act_order: visit columns by decreasing ``H[j, j]`` (largest input energy first).
        block_size: columns updated together before the lazy batch update of the rest.
        damp: initial dampening relative to ``mean(diag H)``, grown x10 while the Cholesky
            factorisation fails.
        static_groups: integer formats: every group's scale up front (see the module
            docstring); None = ``act_order``.
        guard: per layer, keep the spec's uncalibrated ``guard_candidate`` (RTN for integers)
            where its output error on held-out calibration samples is the smaller.
        heldout_fraction: share of the calibration samples the guard holds out (at least one).
        sequential: calibrate block ``i + 1`` on the outputs of the quantized block ``i`` (two
            passes per block); False: on the float block's outputs (one pass per block).
    """

    act_order: bool = True
    block_size: int = 128
    damp: float = 0.01
    static_groups: bool | None = None
    guard: bool = True
    heldout_fraction: float = 0.125
    sequential: bool = True

    def __post_init__(self) -> None:
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise LowbitError(f"block_size must be a positive integer, not {size!r}")
        if not 0.0 < self.damp < 1.0:
            raise LowbitError(f"damp must be in (0, 1), not {self.damp}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise LowbitError(f"heldout_fraction must be in (0, 1), not {self.heldout_fraction}")


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


@dataclass
class PreparedHessian:
    """GPTQ's prologue of one Hessian (:func:`prepare_hessian`).

    Attributes:
        upper: [K, K] float64 upper Cholesky factor ``U`` of the dampened inverse of the
            Hessian in visiting order: ``Uᵀ U = (P H Pᵀ + λI)⁻¹``, dead inputs' ``H[j, j]``
            set to 1 first.
        perm: [K] int64 visiting order (``perm[i]`` is the column visited i-th), or None for
            the natural order.
        dead: [K] bool, original order: inputs with ``H[j, j] == 0`` (never nonzero).
        damp: the relative dampening used (``damp · 10**retries``).
    """

    upper: Tensor | None
    perm: Tensor | None
    dead: Tensor
    damp: float

    def visiting(self, weight: Tensor) -> Tensor:
        """A float32 copy of ``weight`` [out, K] with the dead inputs' columns zeroed (the
        output does not depend on them), columns in visiting order: [out, K]."""
        w = weight.detach().float().clone()  # [out, K]
        w[:, self.dead] = 0.0
        return w if self.perm is None else w[:, self.perm]

    def visiting_transposed(self, weight: Tensor) -> Tensor:
        """``visiting(weight).T.contiguous()`` made in one copy: Wᵀ [K, out] float32, rows in
        visiting order, the dead inputs' rows zero (the column loop's working matrix; at
        Llama-3-8B's down_proj each extra copy is 235 MB)."""
        source = weight.detach().T  # [K, out], a view
        if self.perm is None:
            wt = source.clone(memory_format=torch.contiguous_format)
        else:
            wt = source.index_select(0, self.perm)  # [K, out], contiguous
        wt = wt.float()
        wt[self.dead if self.perm is None else self.dead[self.perm]] = 0.0
        return wt

    def in_original_order(self, rows: Tensor) -> Tensor:
        """The column loop's ``rows`` [K, out] (visiting order) as a contiguous [out, K] in
        original column order, in one copy."""
        columns = rows.T  # [out, K], a view
        if self.perm is None:
            return columns.contiguous()
        return columns[:, torch.argsort(self.perm)]

    def take_upper(self) -> Tensor:
        """``upper`` in float32 for the column loop, [K, K], written over the float64 factor
        (:func:`_float32_in_place`: no second matrix beside it, 0.8 GB at K = 14336); so
        ``upper`` and :meth:`inverse_diagonal` are gone after."""
        upper, self.upper = _float32_in_place(self.upper), None
        return upper

    def inverse_diagonal(self) -> Tensor:
        """``diag((H + λI)⁻¹)`` float32 [K] in visiting order: ``(Uᵀ U)_jj = Σ_i U_ij²``."""
        return self.upper.square().sum(0).float()


def prepare_hessian(
    hessian: Tensor,
    damp: float = 0.01,
    act_order: bool = True,
    *,
    max_damp_tries: int = 6,
    order_of: Callable[[Tensor], Tensor] | None = None,
) -> PreparedHessian:
    """GPTQ's prologue: dead inputs, visiting order, dampened Cholesky factor of ``H⁻¹``.

    Args:
        hessian: [K, K] ``2/N Σ x xᵀ`` of the inputs (not modified).
        damp: initial dampening relative to ``mean(diag H)`` (:func:`inverse_hessian_factor`).
        act_order: visit columns by decreasing ``H[j, j]`` (dead ones count as 1).
        max_damp_tries: factorisations tried (``damp`` x 10 each time) before an error.
        order_of: instead of act-order's, the visiting order [K] as a function of the
            diagonal [K] float64 (dead entries set to 1): the mixed format's dynamic groups
            visit whole groups at a time.

    Returns:
        :class:`PreparedHessian`.
    """
    diagonal = hessian.detach().diagonal().double()  # [K] (a copy)
    dead = diagonal == 0  # [K]
    diagonal[dead] = 1.0  # as GPTQ: a dead input's weights are zeroed, H stays invertible
    if order_of is not None:
        perm = order_of(diagonal)
    elif act_order:
        perm = torch.argsort(diagonal, descending=True, stable=True)
    else:
        perm = None
    upper, damp_used = inverse_hessian_factor(
        hessian.detach(), damp, max_damp_tries, order=perm, dead=dead
    )
    return PreparedHessian(upper, perm, dead, damp_used)


# rows gathered at a time into the factorisation's buffer: a [rows, K] float64 temporary
_GATHER_ROWS = 256


def inverse_hessian_factor(
    hessian: Tensor,
    damp: float = 0.01,
    max_damp_tries: int = 6,
    *,
    order: Tensor | None = None,
    dead: Tensor | None = None,
) -> tuple[Tensor, float]:
    """Upper Cholesky factor ``U`` of the dampened inverse Hessian: ``Uᵀ U = (H + λI)⁻¹``.

    With P the order reversal and P H P = L Lᵀ: H⁻¹ = (P L⁻¹ P)ᵀ (P L⁻¹ P), and P L⁻¹ P is
    upper triangular with a positive diagonal, so it is U: one factorisation and one triangular
    inverse (torch.cholesky_inverse is ~20x slower on CPU at n = 1536). Both run in place on one
    column-major float64 buffer, so one [n, n] float64 matrix is held besides the input (1.6 GB
    at Llama-3-8B's n = 14336) with temporaries of [n, 256].

    Args:
        hessian: [n, n] symmetric positive semi-definite, any float dtype (not modified).
        damp: initial ``λ / mean(diag H)``; multiplied by 10 after each failed factorisation.
            0 (an exact Hessian) is tried once.
        max_damp_tries: factorisations tried before giving up.
        order: [n] the visiting order: ``U`` factors ``H[order][:, order]`` (None: as is).
        dead: [n] bool, original order: diagonal entries to read as 1 (zero in ``hessian``).

    Returns:
        ``(U [n, n] float64 column-major, damp used)``.
    """
    n = hessian.shape[0]
    device = hessian.device
    # the reversed visiting order: buffer row i is H's row reversed[i]
    forward = order if order is not None else torch.arange(n, device=device)
    reversed_order = forward.flip(0)
    ones = None if dead is None else dead[reversed_order]  # [n] bool, buffer order
    buffer = torch.empty(n, n, dtype=torch.float64, device=device).T  # [n, n] column-major

    def fill() -> Tensor:
        """``P H P`` (visiting order, reversed) into ``buffer``; returns its diagonal."""
        for lo in range(0, n, _GATHER_ROWS):
            rows = reversed_order[lo : lo + _GATHER_ROWS]
            buffer[lo : lo + len(rows)] = hessian[rows][:, reversed_order]
        diagonal = buffer.diagonal()
        if ones is not None:
            diagonal[ones] = 1.0
        return diagonal.clone()  # [n] undamped

    diagonal = fill()
    mean_diag = diagonal.flip(0).mean().item()  # summed in visiting order
    if not mean_diag > 0:
        raise LowbitError("the Hessian has no positive diagonal entry; no calibration input?")
    info = torch.empty((), dtype=torch.int32, device=device)
    relative = damp
    for attempt in range(max_damp_tries if damp > 0 else 1):
        if attempt:
            fill()  # a failed factorisation overwrote the buffer
        buffer.diagonal().copy_(diagonal + relative * mean_diag)
        torch.linalg.cholesky_ex(buffer, out=(buffer, info))  # lower L, in place
        if info.item() == 0:
            _invert_lower_in_place(buffer)  # L⁻¹
            _reverse_in_place(buffer.T)  # U = P L⁻¹ P
            if _all_finite(buffer.T):
                return buffer, relative
        relative *= 10.0
    raise LowbitError(
        f"the Hessian is not positive definite even with dampening {relative / 10:g} x mean "
        "diagonal; the calibration data may be degenerate"
    )


def _all_finite(matrix: Tensor) -> bool:
    """``torch.isfinite(matrix).all()`` for a matrix [n, m], a block of rows at a time:
    ``isfinite`` of a float matrix takes its absolute value, a whole copy (0.8 GB for a float32
    Hessian at n = 14336)."""
    return all(
        bool(torch.isfinite(matrix[lo : lo + _GATHER_ROWS]).all())
        for lo in range(0, matrix.shape[0], _GATHER_ROWS)
    )


def _invert_lower_in_place(lower: Tensor) -> None:
    """``lower`` [n, n] lower triangular (zeros above) replaced by its inverse, one block column
    of ``_GATHER_ROWS`` at a time from the last: with the trailing block T already inverted,
    ``[[A, 0], [B, T]]⁻¹ = [[A⁻¹, 0], [-T⁻¹ B A⁻¹, T⁻¹]]``. Temporaries are [n, block]: a solve
    against the identity (what torch offers) needs a second [n, n] matrix. ``T⁻¹ B`` is taken
    a block of rows at a time over the columns where ``T⁻¹`` is not zero: n³/3 multiply-adds
    in all, where one product with the whole square ``T⁻¹`` takes twice that."""
    n = lower.shape[0]
    step = _GATHER_ROWS
    product = torch.empty(n, step, dtype=lower.dtype, device=lower.device)  # rows of T⁻¹ B
    for start in range((n - 1) // step * step, -1, -step):
        end = min(start + step, n)
        block = lower[start:end, start:end]  # A [b, b]
        eye = torch.eye(end - start, dtype=lower.dtype, device=lower.device)
        block_inverse = torch.linalg.solve_triangular(block, eye, upper=False)  # A⁻¹ [b, b]
        below = lower[end:, start:end]  # B [n - end, b]
        rows = n - end
        if rows:
            t_inv_b = product[:rows, : end - start]  # [n - end, b]
            for lo in range(0, rows, step):
                hi = min(lo + step, rows)  # T⁻¹'s rows lo:hi are zero beyond column hi
                torch.mm(lower[end + lo : end + hi, end : end + hi], below[:hi], out=t_inv_b[lo:hi])
            below.copy_(t_inv_b.neg_().mm(block_inverse))
        block.copy_(block_inverse)


def _float32_in_place(matrix: Tensor) -> Tensor:
    """``matrix.float()`` for a float64 [n, n] matrix contiguous in either order, written into
    the first half of its own storage (same strides); the pages of the second half are given
    back (:func:`lowbit.mapped.discard_tail`). ``matrix`` is overwritten.

    A slab of ``_GATHER_ROWS`` storage rows is read into a float32 temporary before its float32
    bytes ``[4·lo·n, 4·hi·n)`` are written: below every float64 byte not yet read (``8·hi·n``).
    """
    n = matrix.shape[0]
    column_major = not matrix.is_contiguous()
    rows = matrix.T if column_major else matrix  # [n, n] in storage order
    if not rows.is_contiguous() or matrix.dtype != torch.float64:
        return matrix.float()
    out = torch.empty(0, dtype=torch.float32, device=matrix.device)
    out.set_(rows.untyped_storage(), rows.storage_offset() * 2, (n, n), (n, 1))  # [n, n]
    for lo in range(0, n, _GATHER_ROWS):
        hi = min(lo + _GATHER_ROWS, n)
        out[lo:hi] = rows[lo:hi].float()
    discard_tail(out, (rows.storage_offset() * 2 + n * n) * 4)
    return out.T if column_major else out


def _reverse_in_place(matrix: Tensor) -> None:
    """``matrix.copy_(matrix.flip(0, 1))`` for a contiguous [n, n] matrix, a [rows, n]
    temporary at a time instead of a whole copy."""
    n = matrix.shape[0]
    step = _GATHER_ROWS
    top = 0
    while n - top - step >= top + step:  # a block at the top, its mirror at the bottom
        bottom = n - top - step
        saved = matrix[top : top + step].clone()
        matrix[top : top + step] = matrix[bottom : bottom + step].flip(0, 1)
        matrix[bottom : bottom + step] = saved.flip(0, 1)
        top += step
    middle = matrix[top : n - top]  # rows whose mirrors lie among them
    middle.copy_(middle.flip(0, 1).clone())


def _stats(weight: Tensor, spec, group_size: int | None):
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
    spec,
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
        spec: the integer format, an :class:`~lowbit.algorithms.int_spec.IntWeightSpec`
            (bits, group size along ``in``, symmetric, MSE clip search, scale rule; it calls
            this function, so it is not imported here).
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
    if not _all_finite(hessian):
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
    with one_thread_on_cpu(weight.device):
        return _gptq(weight, hessian, spec, static, block_size, act_order, damp, max_damp_tries)


def _gptq(weight, hessian, spec, static, block_size, act_order, damp, max_damp_tries):
    """:func:`gptq_quantize` after its checks."""
    out_features, in_features = weight.shape
    group = spec.group_size
    qmin = int_qrange(spec.bits, spec.symmetric)[0]
    # [out, G] each (G = 1 per channel), from the original weight (dead columns included)
    scale, scale16, zero = _stats(weight.detach().float(), spec, group)
    prepared = prepare_hessian(hessian, damp, act_order, max_damp_tries=max_damp_tries)
    perm = prepared.perm
    # Work on Wᵀ [in, out]: a column of W is a contiguous row, so the per-column rank-1
    # updates touch contiguous memory. Statistics are transposed the same way: [G, out].
    wt = prepared.visiting_transposed(weight)  # [in, out], visiting order
    upper = prepared.take_upper()  # [in, in]
    inv_scale_t = torch.reciprocal(scale).T.contiguous()  # codes are x * (1/scale), as in intq
    scale16_t = scale16.T.contiguous()  # [G, out]
    zero_t = None if zero is None else zero.T.contiguous()
    original = perm if perm is not None else torch.arange(in_features, device=wt.device)
    group_of = (original // group if group is not None else original * 0).tolist()
    codes_t = torch.empty_like(wt)  # [in, out] fp32 integer values, visiting order
    values_t = torch.empty_like(wt)  # [in, out] dequantized, visiting order

    _quantize_columns(
        wt, upper, block_size, group, static, spec, group_of,
        inv_scale_t, scale16_t, zero_t, codes_t, values_t,
    )  # fmt: skip
    del wt, upper  # done with: the factor alone is 0.8 GB at in = 14336

    values = prepared.in_original_order(values_t)  # [out, in] fp32
    del values_t
    offset = -qmin  # symmetric codes are stored unsigned, shifted by 2**(b-1)
    codes = prepared.in_original_order(codes_t.add_(offset).to(torch.uint8))  # [out, in] uint8
    del codes_t
    scale16 = scale16_t.T.contiguous()
    zero = None if zero_t is None else zero_t.T.contiguous()
    quantized = IntQuantized(
        qdata=pack_bits(codes.reshape(-1), spec.bits),  # row-major
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
    return GPTQResult(quantized, values, prepared.damp, int(prepared.dead.sum()))


@contextmanager
def one_thread_on_cpu(device: torch.device):
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
    dynamic = group is not None and not static
    rows_of = torch.tensor(group_of, dtype=torch.int64, device=wt.device)  # [in] stats rows
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block = wt[start:end]  # [b, out], updated in place
        errors = torch.empty_like(block)  # [b, out]
        block_u = upper[start:end, start:end]  # [b, b]
        i = 0
        while i < end - start:
            col = start + i
            stop = end - start  # the columns up to the next dynamic group share their grid
            if dynamic:
                stop = min(stop, col - col % group + group - start)
            if dynamic and col % group == 0:
                # dynamic group: statistics of this group's weights as updated so far
                s, s16, z = _stats(wt[col : col + group].T, spec, None)  # [out, 1] each
                g = group_of[col]
                scale16_t[g], inv_scale_t[g] = s16[:, 0], torch.reciprocal(s[:, 0])
                if zero_t is not None:
                    zero_t[g] = z[:, 0]
            compiled = gptq_native.quantize_columns(
                block, block_u, i, stop, errors, codes_t[start:end], values_t[start:end],
                rows_of[start:end], gptq_native.GRID_INT, inv_scale_t, scale16_t, zero_t,
                qmin, qmax,
            )  # fmt: skip
            if not compiled:  # the torch loop: the same steps, a column at a time
                for j in range(i, stop):
                    g = group_of[start + j]
                    x = block[j]  # [out]
                    q = torch.round(x * inv_scale_t[g])
                    if zero_t is not None:
                        q += zero_t[g]
                    q.clamp_(qmin, qmax)
                    dq = (q - zero_t[g]) * scale16_t[g] if zero_t is not None else q * scale16_t[g]
                    codes_t[start + j], values_t[start + j] = q, dq
                    err = (x - dq) / block_u[j, j]  # [out]
                    block[j:].addr_(block_u[j, j:], err, alpha=-1.0)  # rank-1 update [b - j, out]
                    errors[j] = err
            i = stop
        wt[end:] -= (
            upper[start:end, end:].T @ errors
        )  # lazy update of later columns [in - end, out]
