"""The ``learn-rotate`` recipe: QuaRot's rotation with R1 (residual) and R2 (per head) learned
on the calibration text with the quantizers in the loop (SpinQuant, Liu et al., 2024), then
fused, so the model leaves with QuaRot's structure and cost; quantizes nothing. With
``learn_scale`` it also learns a scale per channel of each down_proj input (fused into up_proj
and down_proj), and with ``learn_clip`` one activation clip ratio per layer and kind of point,
which it hands to the weight part that follows (per-layer ``a_clip_ratio``): both free at
inference, both on by default. With ``learn_weights`` it fine-tunes the block linears' weights
in the same loop (a correction ΔW each, fused before the rotations), also free at inference.

``learn-rotate+gptq+kv-int``: the rotation is trained for the activation and value bits it
is given (``a_bits``, ``v_bits``; a composition's ``--set a_bits=8`` reaches the weight part
and this one alike), GPTQ then quantizes the weights of the rotated model. Steps, each done by
the module that owns it: :func:`~lowbit.transforms.rotate.rotate_model` (Hadamard start),
:func:`~lowbit.algorithms.rotation_training.train_rotations` (the loop),
:func:`~lowbit.transforms.learned_rotate.fuse_learned_rotations`. What the training cost is
left on the model as ``model.lowbit_rotation_training``, with the learned clips.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.algorithms.rotation_training import (
    LOSSES,
    SCHEDULES,
    RotationTrainingSettings,
    train_rotations,
)
from lowbit.calibrate.resume import NESTED_DIRECTORIES
from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.recipes.base import (
    OFF_BITS,
    QuantizeContext,
    Recipe,
    check_bits,
    check_clip,
    check_seed,
    resolve_clip,
)
from lowbit.recipes.kv_int import QUAROT_KV_CLIP
from lowbit.recipes.quarot import QuaRotRecipe
from lowbit.recipes.registry import register, register_preset
from lowbit.settings import Count
from lowbit.transforms.learned_rotate import (
    ACTIVATION_POINTS,
    LearnedRotations,
    fuse_learned_rotations,
)
from lowbit.transforms.rotate import rotate_model

DEFAULT_SEQLEN = 256

#: the block weights fine-tuned in the loop, a cosine schedule over 500 steps: the setting
#: measured at half of QuaRot's W4A4KV4 KL to float (docs/results/rotations.md), for over
#: twice the defaults' training time and more memory (the weights' gradients and moments)
register_preset(
    "learn-rotate-ft",
    "learn-rotate",
    {"learn_weights": True, "lr_schedule": "cosine", "steps": 500},
)


@register
@dataclass
class LearnRotateRecipe(Recipe):
    """Learn QuaRot's rotation for the quantizers that follow; quantizes nothing.

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them).
    """

    method = "learn-rotate"
    version = 1
    needs_calibration = True
    roles = frozenset({"rotation"})
    paper = "SpinQuant (Liu et al., 2024)"

    seed: Count = 0
    online_fp16: bool = False
    online: bool = True
    hadamard_block: int | None = None
    learn_heads: bool = True
    a_bits: int = 4
    a_clip_ratio: float | None = None  # 0.9 at 4 bits or fewer, none above
    learn_clip: bool = True  # learn a_clip_ratio per layer and point, from a_clip_ratio
    learn_scale: bool = True  # learn a scale per channel of down_proj's input
    learn_weights: bool = False  # fine-tune the block linears' weights in the loop
    weight_lr: float = 1e-5
    v_bits: int = 4
    kv_clip_ratio: float | None = None  # 0.95 at 4 bits or fewer, none above
    train_w_bits: int = OFF_BITS  # weights in the loop (for RTN weights after); 16: float
    train_loss: str = "kl"  # KL to the float model, or SpinQuant's cross-entropy "ce"
    steps: Count = 300
    seqlen: Count | None = None  # DEFAULT_SEQLEN, or the calibration samples' length if shorter
    lr: float = 5e-5
    lr_schedule: str = "constant"  # or "cosine", every learning rate decayed to zero
    save_every: Count = 10
    bf16: bool = False

    def validate(self) -> None:
        check_seed("seed", self.seed)
        check_bits("a_bits", self.a_bits)
        check_bits("v_bits", self.v_bits)
        check_bits("train_w_bits", self.train_w_bits)
        check_clip("a_clip_ratio", self.a_clip_ratio)
        check_clip("kv_clip_ratio", self.kv_clip_ratio)
        if self.train_loss not in LOSSES:
            raise LowbitError(
                f"learn-rotate train_loss must be one of {LOSSES}, not {self.train_loss!r}"
            )
        if self.lr_schedule not in SCHEDULES:
            raise LowbitError(
                f"learn-rotate lr_schedule must be one of {SCHEDULES}, not {self.lr_schedule!r}"
            )
        if self.a_bits == self.v_bits == self.train_w_bits == OFF_BITS:
            raise LowbitError(
                "learn-rotate needs a_bits, v_bits or train_w_bits below 16: the rotation is "
                "learned for the quantizers in the loop, and with none there is nothing to learn"
            )
        seqlen_ok = self.seqlen is None or self.seqlen >= 2
        rates_ok = self.lr > 0 and self.weight_lr > 0
        if self.steps < 1 or not seqlen_ok or self.save_every < 1 or not rates_ok:
            raise LowbitError(
                f"learn-rotate needs steps >= 1, seqlen >= 2, save_every >= 1, lr > 0 and "
                f"weight_lr > 0, not steps={self.steps}, seqlen={self.seqlen}, "
                f"save_every={self.save_every}, lr={self.lr}, weight_lr={self.weight_lr}"
            )

    def training_settings(self, calibration_length: int) -> RotationTrainingSettings:
        """The loop's settings for calibration samples of ``calibration_length`` tokens."""
        seqlen = self.seqlen or min(DEFAULT_SEQLEN, calibration_length)
        return RotationTrainingSettings(
            steps=self.steps,
            seqlen=seqlen,
            lr=self.lr,
            a_bits=self.a_bits,
            a_clip_ratio=resolve_clip(self.a_clip_ratio, self.a_bits, QuaRotRecipe.paper_a_clip),
            learn_clip=self.learn_clip,
            weight_lr=self.weight_lr,
            v_bits=self.v_bits,
            v_clip_ratio=resolve_clip(self.kv_clip_ratio, self.v_bits, QUAROT_KV_CLIP),
            w_bits=self.train_w_bits,
            loss=self.train_loss,
            lr_schedule=self.lr_schedule,
            save_every=self.save_every,
            bf16=self.bf16,
        )

    def check_model(self, model, context: QuantizeContext) -> None:
        calibration = context.calibration
        if calibration is None:
            raise LowbitError("learn-rotate trains on calibration tokens; none were given")
        if calibration.shape[1] < (self.seqlen or 2):
            raise LowbitError(
                f"learn-rotate trains on calibration pieces of seqlen={self.seqlen} tokens; the "
                f"calibration samples have {calibration.shape[1]}"
            )

    def apply(self, model, context: QuantizeContext) -> dict[str, dict[str, float]] | None:
        self.check_model(model, context)
        report = rotate_model(
            model,
            seed=self.seed,
            online_dtype=torch.float16 if self.online_fp16 else torch.float32,
            online=self.online,
            hadamard_block=self.hadamard_block,
        )
        rotations = LearnedRotations.for_model(
            context.adapter,
            report.o_proj_hadamard,
            heads=self.learn_heads,
            scales=self.learn_scale,
            weights=self.learn_weights,
            seed=self.seed,
        )
        resume = None
        if context.resume_dir is not None:
            resume = Path(context.resume_dir) / NESTED_DIRECTORIES[0]
        training = model.lowbit_rotation_training = train_rotations(
            model,
            rotations,
            context.calibration,
            self.training_settings(context.calibration.shape[1]),
            resume_dir=resume,
            recipe=context.resume_fingerprint(self),
            progress=context.progress,
        )
        fuse_learned_rotations(model, rotations)
        report.residual += " x learned R1" + (", learned R2 per head" if self.learn_heads else "")
        report.residual += ", learned down_proj input scales" if self.learn_scale else ""
        report.residual += ", fine-tuned weights" if self.learn_weights else ""
        context.transformed(model)
        return _clip_overrides(model, training.clip_ratios) or None


def _clip_overrides(model, clip_ratios: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Learned clips (per layer ``{point: ratio}``, a training report's ``clip_ratios``) as
    per-layer ``a_clip_ratio`` settings, ``{linear's name: {"a_clip_ratio": ratio}}``."""
    if not clip_ratios:
        return {}
    names = {module: name for name, module in model.named_modules()}
    overrides = {}
    for view, ratios in zip(adapter_for(model).blocks(), clip_ratios, strict=True):
        for point, ratio in ratios.items():
            for linear in ACTIVATION_POINTS[point]:
                overrides[names[getattr(view, linear)]] = {"a_clip_ratio": ratio}
    return overrides
