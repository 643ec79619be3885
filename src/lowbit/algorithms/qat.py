"""Choices on the float model and a short QAT for the mixed 2/4-bit format (Li et al., 2024, §3.3).

* :func:`choose_on_float`: one calibration walk over the *float* model (one pass per block,
  nothing changed) giving each selected linear's eq. 9 sensitivity per column group, its 4-bit
  groups and its exclusive outliers (:mod:`lowbit.algorithms.mixed`). QAT trains with these;
  the inter-layer baseline of the paper's Table 4 ranks whole matrices by them.
* :func:`mixed_qat`: fine-tune the selected linears' weights with the mixed format
  fake-quantized in the forward pass, ``W + (Q(W) - W).detach()`` (straight-through
  estimator), ``Q`` = round to nearest with the statistics recomputed from the current weights
  each step (min-max ranges, no search) and the 4-bit groups and outliers fixed by
  :func:`choose_on_float`. The loss is next-token cross-entropy on the calibration tokens, cut
  into ``seqlen`` pieces; Adam. Everything else in the model stays frozen. The caller then
  quantizes the fine-tuned weights for real (GPTQ) with the same 4-bit groups.

These run the model (forward and backward), unlike the weight algorithms; they know layers
only through the adapter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lowbit.algorithms.gptq import prepare_hessian
from lowbit.algorithms.mixed import (
    MixedWeightSpec,
    choose_4bit_groups,
    choose_outliers,
    group_sensitivity,
)
from lowbit.algorithms.weights import selected_linears
from lowbit.calibrate.capture import block_linears, calibrate_layer_by_layer
from lowbit.errors import LowbitError
from lowbit.formats.mixed import GROUP, mixed_rtn, mixed_statistics

__all__ = ["FloatChoice", "QATReport", "choose_on_float", "mixed_qat"]


@dataclass
class FloatChoice:
    """What :func:`choose_on_float` found for one linear."""

    sensitivity: Tensor  # [G] eq. 9
    is4: Tensor  # [G] bool
    outliers: Tensor  # [N, K] bool


def choose_on_float(
    model: nn.Module,
    adapter,
    calibration: Tensor,
    spec_for: Callable[[str], MixedWeightSpec | None],
    *,
    damp: float = 0.01,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, FloatChoice]:
    """Each selected linear's sensitivity, 4-bit groups and outliers from the float model's
    Hessians (one walk, one pass per block; the model is not changed).

    Args:
        model, adapter: the model and its adapter.
        calibration: ``[N, S]`` token ids.
        spec_for: ``spec_for(fqn)`` -> the layer's format (its ``frac_4bit`` and
            ``outlier_fraction``), or None to skip the layer.
        damp: GPTQ's relative dampening for ``H⁻¹``.
        filter_fn: ``filter_fn(module, fqn)`` -> whether the linear is considered (None = all).
        device: compute device (default: where the blocks are).
    """
    if calibration is None:
        raise LowbitError("choosing 4-bit groups on the float model needs calibration data")
    specs = {n: spec_for(n) for n in selected_linears(model, adapter, filter_fn)}
    wanted = {n for n, s in specs.items() if s is not None}
    found: dict[str, FloatChoice] = {}

    def linears_of(index: int) -> dict[str, nn.Module]:
        return {n: m for n, m in block_linears(model, adapter, index).items() if n in wanted}

    def record(index: int, collector) -> None:
        for name, module in linears_of(index).items():
            spec = specs[name]
            hessian = collector.accumulators[name].hessian("train")
            natural = prepare_hessian(hessian, damp, act_order=False)
            weight = module.weight.detach().float()
            weight = weight.masked_fill(natural.dead[None, :], 0.0)  # dead inputs
            hinv = natural.inverse_diagonal()  # [K] diag(H⁻¹)
            sensitivity = group_sensitivity(weight, hinv)
            is4 = choose_4bit_groups(sensitivity, spec.frac_4bit)
            count = round(spec.outlier_fraction * weight.numel())
            outliers = choose_outliers(weight, is4, count, 1.0 / hinv)
            found[name] = FloatChoice(sensitivity.cpu(), is4.cpu(), outliers.cpu())

    calibrate_layer_by_layer(
        model, adapter, calibration, record, linears_of=linears_of, sequential=False,
        device=device, progress=progress,
    )  # fmt: skip
    return found


@dataclass
class QATReport:
    """What :func:`mixed_qat` did."""

    is4: dict[str, Tensor] = field(default_factory=dict)  # the 4-bit groups trained with
    losses: list[float] = field(default_factory=list)  # per step
    steps: int = 0
    seconds: float = 0.0
    choose_seconds: float = 0.0


class _FakeMixed(nn.Module):
    """``W -> W + (Q(W) - W).detach()``: the mixed format's RTN face with a straight-through
    gradient (4-bit groups and outliers fixed, statistics from the current weight)."""

    def __init__(self, spec: MixedWeightSpec, is4: Tensor, outliers: Tensor):
        super().__init__()
        self.g2 = spec.g2
        self.register_buffer("is4", is4, persistent=False)
        self.register_buffer("outliers", outliers, persistent=False)

    def forward(self, weight: Tensor) -> Tensor:  # [N, K]
        with torch.no_grad():
            w = weight.detach().float()
            stats = mixed_statistics(w, self.is4, self.outliers, g2=self.g2)
            codes, sparse = mixed_rtn(w, stats, self.outliers)
            n, k = w.shape
            groups = codes.float().view(n, -1, GROUP)  # [N, G, 16]
            dense = (groups - stats.zero[..., None]) * stats.scale[..., None]
            quantized = (dense.view(n, -1)[:, :k] + sparse).to(weight.dtype)
        return weight + (quantized - weight).detach()


def mixed_qat(
    model: nn.Module,
    adapter,
    calibration: Tensor,
    spec_for: Callable[[str], MixedWeightSpec | None],
    *,
    steps: int,
    lr: float = 1e-4,
    seqlen: int = 512,
    damp: float = 0.01,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> QATReport:
    """Fine-tune the selected linears with the mixed format fake-quantized (module doc); the
    model's weights are updated in place and stay float.

    Args:
        model, adapter, spec_for, damp, filter_fn, device: as for :func:`choose_on_float`.
        calibration: ``[N, S]`` token ids; cut into ``seqlen`` pieces, visited in order.
        steps: optimizer steps (one piece each).
        lr: Adam's learning rate.

    Returns:
        :class:`QATReport` (``is4`` is what the real quantization must use).
    """
    if calibration is None:
        raise LowbitError("QAT needs calibration data (calibration=[n_samples, seqlen] ids)")
    if steps < 1 or seqlen < 2 or calibration.shape[1] < seqlen:
        raise LowbitError(
            f"QAT needs steps >= 1 and 2 <= seqlen <= the calibration length "
            f"{calibration.shape[1]}, not steps={steps}, seqlen={seqlen}"
        )
    report = QATReport()
    start = time.perf_counter()
    choices = choose_on_float(
        model, adapter, calibration, spec_for, damp=damp, filter_fn=filter_fn, device=device,
        progress=progress,
    )  # fmt: skip
    report.choose_seconds = time.perf_counter() - start
    report.is4 = {name: choice.is4 for name, choice in choices.items()}
    compute = torch.device(device) if device is not None else next(model.parameters()).device
    home = next(model.parameters()).device
    pieces = calibration[:, : calibration.shape[1] // seqlen * seqlen].reshape(-1, seqlen)

    frozen = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    weights = []
    model.to(compute)
    try:
        for name, choice in choices.items():
            module = model.get_submodule(name)
            spec = spec_for(name)
            fake = _FakeMixed(spec, choice.is4.to(compute), choice.outliers.to(compute))
            parametrize.register_parametrization(module, "weight", fake)
            original = module.parametrizations.weight.original
            original.requires_grad_(True)
            weights.append(original)
        optimizer = torch.optim.Adam(weights, lr=lr)
        was_training = model.training
        model.train()
        for step in range(steps):
            ids = pieces[step % pieces.shape[0]].unsqueeze(0).to(compute)  # [1, seqlen]
            with torch.enable_grad():  # callers (lowbit.quantize) may hold no_grad
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            report.losses.append(float(loss.detach()))
        model.train(was_training)
    finally:
        for name in choices:
            module = model.get_submodule(name)
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        for name in choices:
            model.get_submodule(name).weight.requires_grad_(False)
        model.to(home)
    report.steps = steps
    report.seconds = time.perf_counter() - start
    return report
