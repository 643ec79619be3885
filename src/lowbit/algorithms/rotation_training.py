"""Train learned rotations (SpinQuant's R1 and R2) with the quantizers in the loop.

The model is QuaRot's (``rotate_model`` done); :mod:`lowbit.transforms.learned_rotate` shows
it the fused model's quantization points (inputs of every block linear, values per head) in
the rotated basis, and this loop quantizes them with :func:`ste_fake_quant` while minimising
the KL divergence from the float model's next-token distribution (or SpinQuant's next-token
cross-entropy) on the calibration tokens cut into ``seqlen`` pieces, one piece a step, visited
in order. Adam trains the Cayley parameters (and down_proj's input scales and the weight
corrections ΔW, when the rotations hold them); the model's own weights stay frozen (ΔW is added
to them in the loop and fused after).

In the loop, as SpinQuant trains for GPTQ weights: activations (per token, symmetric) and values
(per token and head, asymmetric) are quantized; weights stay float (GPTQ
quantizes them afterwards, seeing the learned rotation) unless ``w_bits`` puts them in the loop
too (for round-to-nearest weights after), and keys are not quantized (R1 and R2
do not change the keys, so their quantization error is noise the rotations cannot reduce).
The activations are clipped at QuaRot's ratio, or (``learn_clip``) at one ratio per layer and
kind of point (:data:`~lowbit.transforms.learned_rotate.ACTIVATION_POINTS`), the sigmoid of a
parameter trained beside the rotations from that start; the learned ratios are reported for the
deployed activation quantizers, which then clip exactly as the loop did.

Resumable: with a resume directory the state (parameters, Adam's moments, losses) is written
every ``save_every`` steps through :class:`~lowbit.calibrate.resume.BlockCheckpoints`, and a
rerun with the same fingerprint continues from the last one, with the same result.
"""

from __future__ import annotations

import functools
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from lowbit.calibrate.resume import BlockCheckpoints, run_fingerprint
from lowbit.errors import LowbitError
from lowbit.formats.intq import int_qrange
from lowbit.models.adapter import adapter_for
from lowbit.transforms.learned_rotate import (
    ACTIVATION_POINTS,
    LearnedRotations,
    quantized_in_rotated_basis,
)

__all__ = [
    "LearnedClips",
    "RotationTrainingReport",
    "RotationTrainingSettings",
    "ste_fake_quant",
    "train_rotations",
]

OFF_BITS = 16
_TINY = torch.finfo(torch.float32).tiny
STATE_NAME = "rotations"
LOSSES = ("ce", "kl")
#: how every learning rate moves over the steps: held, or cosine-decayed to zero at the last
SCHEDULES = ("constant", "cosine")


class _RoundSTE(torch.autograd.Function):
    """Round to nearest (ties to even) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def ste_fake_quant(x: Tensor, bits: int, *, symmetric: bool, clip_ratio: float = 1.0) -> Tensor:
    """Integer fake-quantization of each row of ``x`` [..., n] with a straight-through round.

    The forward pass equals :func:`lowbit.formats.intq.fake_quant_int` (absmax scale, codes
    clamped, a row of zeros kept exact) to float rounding; the gradient reaches ``x`` both
    directly and through the scale (the row's range), so a rotation that shrinks a row's
    outliers lowers the loss.
    """
    qmin, qmax = int_qrange(bits, symmetric)
    xf = x.float()
    if symmetric:
        scale = xf.abs().amax(dim=-1, keepdim=True) * clip_ratio / qmax  # [..., 1]
        zero = None
    else:
        lo = xf.amin(dim=-1, keepdim=True).clamp(max=0.0) * clip_ratio
        hi = xf.amax(dim=-1, keepdim=True).clamp(min=0.0) * clip_ratio
        scale = (hi - lo) / qmax  # [..., 1]
        zero = torch.round(-lo.detach() / scale.detach().clamp_min(_TINY)).clamp(0, qmax)
    scale = torch.where(scale < _TINY, torch.ones_like(scale), scale)
    codes = _RoundSTE.apply(xf / scale) if zero is None else _RoundSTE.apply(xf / scale) + zero
    codes = codes.clamp(qmin, qmax)
    out = codes * scale if zero is None else (codes - zero) * scale
    return out.to(x.dtype)


_POINT_COLUMN = {point: i for i, point in enumerate(ACTIVATION_POINTS)}  # LearnedClips' columns


class LearnedClips(nn.Module):
    """One activation clip ratio per layer and kind of point, ``sigmoid(logit)`` in (0, 1).

    Args:
        num_layers: decoder layers.
        start: every ratio's initial value, in (0, 1).
        device: where the parameter is made.
    """

    def __init__(self, num_layers: int, start: float, *, device: torch.device | None = None):
        super().__init__()
        start = min(start, 1 - 1e-3)  # a ratio of 1 is sigmoid(inf)
        logit = math.log(start / (1 - start))
        shape = (num_layers, len(ACTIVATION_POINTS))
        self.logits = nn.Parameter(torch.full(shape, logit, device=device))  # [L, P]

    def ratio(self, layer: int, point: str) -> Tensor:
        """The clip ratio of ``point`` in ``layer`` (a 0-dim tensor that carries gradient)."""
        return torch.sigmoid(self.logits[layer, _POINT_COLUMN[point]])

    def ratios(self) -> list[dict[str, float]]:
        """Per layer, ``{point: ratio}``."""
        values = torch.sigmoid(self.logits.detach()).tolist()  # [L][P]
        return [dict(zip(ACTIVATION_POINTS, row, strict=True)) for row in values]


@dataclass
class RotationTrainingSettings:
    """What the loop trains for and how long.

    Attributes:
        steps: optimizer steps (one calibration piece each).
        seqlen: tokens per piece.
        lr: Adam's learning rate on the Cayley parameters. Adam moves every entry about this
            much a step and R1 has hidden² of them, so it stays small (the choice is measured
            in docs/results/rotations.md).
        a_bits, a_clip_ratio: activation quantizer in the loop (16: off).
        learn_clip: learn one activation clip ratio per layer and kind of point, starting at
            ``a_clip_ratio`` (with a_bits below 16).
        clip_lr: Adam's learning rate on the clip ratios' logits.
        scale_lr: Adam's learning rate on down_proj's log input scales (when learned).
        weight_lr: Adam's learning rate on the weight corrections ΔW (when learned).
        v_bits, v_clip_ratio: value quantizer in the loop (16: off).
        w_bits: weights in the loop, per output channel, symmetric, absmax (16: off, float
            weights, as for GPTQ afterwards; 4 for round-to-nearest weights after).
        loss: ``"kl"``, the KL divergence from the float model's next-token distribution (a
            second forward pass each step, without gradient), which measures only what the
            quantizers change, not the text's own uncertainty; or ``"ce"``, SpinQuant's
            next-token cross-entropy on the calibration tokens.
        lr_schedule: ``"constant"``, or ``"cosine"``: every learning rate times
            ``(1 + cos(π · step / steps)) / 2``, a function of the step alone (a resumed run
            takes it up where it stopped).
        save_every: steps between resume states (with a resume directory).
        bf16: run the model's matrix products in bfloat16 (CPU autocast); weights stay as
            they are.
    """

    steps: int = 100
    seqlen: int = 256
    lr: float = 5e-5
    a_bits: int = 4
    a_clip_ratio: float = 0.9
    learn_clip: bool = False
    clip_lr: float = 3e-2
    scale_lr: float = 1e-2
    weight_lr: float = 1e-5
    v_bits: int = 4
    v_clip_ratio: float = 0.95
    w_bits: int = OFF_BITS
    loss: str = "kl"
    lr_schedule: str = "constant"
    save_every: int = 10
    bf16: bool = False

    def check(self, calibration: Tensor | None) -> None:
        if calibration is None:
            raise LowbitError("training rotations needs calibration tokens ([N, S] ids)")
        rates = {
            "lr": self.lr, "clip_lr": self.clip_lr, "scale_lr": self.scale_lr,
            "weight_lr": self.weight_lr,
        }  # fmt: skip
        if self.steps < 1 or self.save_every < 1 or min(rates.values()) <= 0:
            raise LowbitError(
                f"rotation training needs steps >= 1, save_every >= 1 and positive learning "
                f"rates, not steps={self.steps}, save_every={self.save_every}, "
                + ", ".join(f"{name}={rate}" for name, rate in rates.items())
            )
        if not 2 <= self.seqlen <= calibration.shape[1]:
            raise LowbitError(
                f"rotation training seqlen must be 2 to the calibration length "
                f"{calibration.shape[1]}, not {self.seqlen}"
            )
        if self.loss not in LOSSES:
            raise LowbitError(f"rotation training loss must be one of {LOSSES}, not {self.loss!r}")
        if self.lr_schedule not in SCHEDULES:
            raise LowbitError(
                f"rotation training lr_schedule must be one of {SCHEDULES}, not "
                f"{self.lr_schedule!r}"
            )
        if self.a_bits == self.v_bits == self.w_bits == OFF_BITS:
            raise LowbitError(
                "rotation training needs activations, values or weights quantized in the loop "
                "(a_bits, v_bits or w_bits below 16): with none there is nothing to learn"
            )


@dataclass
class RotationTrainingReport:
    """What :func:`train_rotations` did."""

    steps: int = 0
    resumed_from: int = 0  # the step a resume state continued from (0: a fresh start)
    losses: list[float] = field(default_factory=list)  # per step, from step 0
    seconds: float = 0.0  # this process's training time
    peak_rss_mb: float = 0.0  # the process's peak resident memory when training ended
    #: per layer ``{point: ratio}``, the learned activation clips (empty: not learned)
    clip_ratios: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _quantizer(bits: int, symmetric: bool, clip: float):
    if bits == OFF_BITS:
        return None
    return functools.partial(ste_fake_quant, bits=bits, symmetric=symmetric, clip_ratio=clip)


def _activation_quantizer(settings: RotationTrainingSettings, clips: LearnedClips | None):
    """The loop's ``activation(x, layer, point)``: QuaRot's clip everywhere, or the learned
    one of each point."""
    if settings.a_bits == OFF_BITS:
        return None
    if clips is None:
        quantize = _quantizer(settings.a_bits, True, settings.a_clip_ratio)
        return lambda x, layer, point: quantize(x)
    return lambda x, layer, point: ste_fake_quant(
        x, settings.a_bits, symmetric=True, clip_ratio=clips.ratio(layer, point)
    )


def _lr_factor(settings: RotationTrainingSettings, step: int) -> float:
    """What ``step``'s learning rates are, as a fraction of the settings' own."""
    if settings.lr_schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * step / settings.steps))


def _loss(model: nn.Module, ids: Tensor, kind: str, paused) -> Tensor:
    """The step's loss on ``ids`` [1, S] of the model with its quantization points on:
    next-token cross-entropy (``"ce"``), or the KL divergence from the float model's next-token
    distribution, per token (``"kl"``; the float model is the same model inside ``paused()``,
    its rotations being orthogonal)."""
    if kind == "ce":
        return model(input_ids=ids, labels=ids).loss
    with torch.no_grad(), paused():
        target = F.log_softmax(model(input_ids=ids).logits.float(), dim=-1)  # [1, S, V]
    log_probs = F.log_softmax(model(input_ids=ids).logits.float(), dim=-1)  # [1, S, V]
    return F.kl_div(log_probs, target, log_target=True, reduction="none").sum(-1).mean()


def _state_tensors(trained: nn.ModuleDict, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """What a resume state holds: the trained parameters and Adam's moments."""
    tensors = {f"param.{name}": p for name, p in trained.named_parameters()}
    state = optimizer.state_dict()["state"]
    tensors.update({f"adam.{i}.{key}": value for i, s in state.items() for key, value in s.items()})
    return tensors


def _restore(trained: nn.ModuleDict, optimizer, tensors: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, param in trained.named_parameters():
            param.copy_(tensors[f"param.{name}"])
    full = optimizer.state_dict()
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("adam."):
            _, index, what = key.split(".")
            state.setdefault(int(index), {})[what] = value
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def train_rotations(
    model: nn.Module,
    rotations: LearnedRotations,
    calibration: Tensor,
    settings: RotationTrainingSettings,
    *,
    resume_dir: str | Path | None = None,
    recipe: dict | None = None,
    progress: bool = False,
    on_step=None,
) -> RotationTrainingReport:
    """Train ``rotations`` in place on ``model`` (rotated by ``rotate_model``, float, frozen).

    Args:
        model: the rotated model; its weights are not changed.
        rotations: the learnable transforms (their parameters are trained).
        calibration: [N, S] token ids, cut into ``settings.seqlen`` pieces.
        settings: the loop's quantizers and length.
        resume_dir: where to keep resume states (None: none).
        recipe: the caller's recipe, for the resume fingerprint.
        progress: show a progress bar.
        on_step: ``on_step(step, loss)`` after each step (after its state is saved).

    Returns:
        RotationTrainingReport, with the learned clip ratios when ``settings.learn_clip``.
    """
    settings.check(calibration)
    start = time.perf_counter()
    device = next(model.parameters()).device
    pieces = calibration[:, : calibration.shape[1] // settings.seqlen * settings.seqlen]
    pieces = pieces.reshape(-1, settings.seqlen)  # [P, seqlen]
    rotations.to(device)
    clips = None
    if settings.learn_clip and settings.a_bits != OFF_BITS:
        layers = adapter_for(model).num_layers
        clips = LearnedClips(layers, settings.a_clip_ratio, device=device)
    trained = nn.ModuleDict({"rotations": rotations})  # what the resume state holds
    groups = [{"params": rotations.rotation_parameters(), "lr": settings.lr}]
    if rotations.learns_scales:
        groups.append({"params": [rotations.down_log_scales], "lr": settings.scale_lr})
    if rotations.learns_weights:
        groups.append({"params": list(rotations.weight_deltas.values()), "lr": settings.weight_lr})
    if clips is not None:
        trained["clips"] = clips
        groups.append({"params": [clips.logits], "lr": settings.clip_lr})
    optimizer = torch.optim.Adam(groups)
    base_lrs = [group["lr"] for group in groups]
    report = RotationTrainingReport(steps=settings.steps)
    checkpoints = None
    if resume_dir is not None:
        fingerprint = run_fingerprint(
            model, calibration, layers={}, options=asdict(settings), recipe=recipe, device=device
        )
        checkpoints = BlockCheckpoints(resume_dir, fingerprint)
        saved = checkpoints.load_state(STATE_NAME)
        if saved is not None:
            tensors, record = saved
            _restore(trained, optimizer, tensors)
            report.resumed_from = int(record["step"])
            report.losses = list(record["losses"])
            print(  # say so, as a resumed GPTQ run does: it is quicker, its bar starts part-way
                f"lowbit: resuming from {resume_dir}: the rotation training continues at step "
                f"{report.resumed_from} of {settings.steps}, where an earlier run saved it",
                file=sys.stderr,
            )

    activation = _activation_quantizer(settings, clips)
    value = _quantizer(settings.v_bits, False, settings.v_clip_ratio)
    weight = _quantizer(settings.w_bits, True, 1.0)
    frozen = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    bar = tqdm(
        total=settings.steps, initial=report.resumed_from, desc="learn rotations",
        disable=not progress, leave=False,
    )  # fmt: skip
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        with (
            torch.enable_grad(),
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.bf16),
            quantized_in_rotated_basis(
                model, rotations, activation=activation, value=value, weight=weight
            ) as paused,
        ):
            for step in range(report.resumed_from, settings.steps):
                ids = pieces[step % pieces.shape[0]].unsqueeze(0).to(device)  # [1, seqlen]
                loss = _loss(model, ids, settings.loss, paused)
                if not math.isfinite(float(loss.detach())):
                    raise LowbitError(
                        f"the rotation training diverged: its loss is {float(loss.detach())} at "
                        f"step {step + 1} of {settings.steps} (lr={settings.lr}, weight_lr="
                        f"{settings.weight_lr}); lower lr or weight_lr"
                    )
                loss.backward()
                factor = _lr_factor(settings, step)
                for group, lr in zip(optimizer.param_groups, base_lrs, strict=True):
                    group["lr"] = lr * factor
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                report.losses.append(float(loss.detach()))
                bar.update(1)
                bar.set_postfix(loss=f"{report.losses[-1]:.3f}")
                done = step + 1
                if checkpoints is not None and (
                    done % settings.save_every == 0 or done == settings.steps
                ):
                    checkpoints.save_state(
                        STATE_NAME,
                        _state_tensors(trained, optimizer),
                        {"step": done, "losses": report.losses},
                    )
                if on_step is not None:
                    on_step(step, report.losses[-1])
    finally:
        bar.close()
        model.train(was_training)
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    if clips is not None:
        report.clip_ratios = clips.ratios()
    report.seconds = time.perf_counter() - start
    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return report
