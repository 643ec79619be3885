"""The ``mixed`` recipe: the 2/4/16-bit weights of Li et al., 2024 (2-bit groups, the most
sensitive groups of each matrix in 4 bits, a few fp16 outliers in 2-bit groups, 2-order scales).

Weights only (activations and the KV cache stay as they are; compose with ``rotate`` and any
KV recipe: ``rotate+mixed+kvquant``). Calibrated layer by layer with GPTQ under the mixed format
(:func:`lowbit.algorithms.mixed.mixed_quantize`), or rounded to nearest (``w_algo=rtn``, the
4-bit groups then chosen by the weights' energy). Simulated like ``gptq``: each linear holds its
dequantized weight and the exact storage of its packed form (:class:`~lowbit.nn.mixed_linear.
MixedLinear`, what ``packed=True``, ``lowbit quantize`` and checkpoints hold). The per-layer
choices are left on the model as ``model.lowbit_weight_report``.

The preset ``mixed-2-4-16`` is the paper's setting: 25 % 4-bit groups, 0.2 % outliers, g1 = g2
= 16 (2.91 bits by eq. 10; every stored bit counted, 3.07 at 4096 x 4096, see
docs/results/mixed.md).

Optional QAT (``qat_steps > 0``, Li et al. §3.3): the 4-bit groups and outliers are chosen on the
float model's Hessians, the block linears are fine-tuned for ``qat_steps`` steps with the
mixed format fake-quantized in the forward pass (straight-through estimator), then GPTQ
quantizes the fine-tuned weights with the same 4-bit groups (:mod:`lowbit.algorithms.qat`).
The loss is next-token cross-entropy on the calibration text, so the model also adapts to that
text: perplexity on text like it falls more than the distance to the float model does
(docs/results/mixed.md measures both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from lowbit.algorithms.mixed import MixedWeightSpec
from lowbit.algorithms.weights import quantize_linears
from lowbit.errors import LowbitError
from lowbit.recipes.base import (
    QuantizeContext,
    Recipe,
    check_gptq_settings,
    refuse_global_overrides,
)
from lowbit.recipes.linear_settings import GPTQRecipeSettings
from lowbit.recipes.registry import register, register_preset
from lowbit.settings import Count

# settings besides GPTQ's that apply to the whole run and cannot differ per layer
_GLOBAL_SETTINGS = ("w_algo", "qat_steps", "qat_lr", "qat_seqlen")


@register
@dataclass
class MixedRecipe(GPTQRecipeSettings, Recipe):
    """2/4/16-bit intra-matrix mixed-precision weights.

    Settings:
        frac_4bit: share of each matrix's 16-channel column groups in 4 bits, by eq. 9's
            sensitivity (0 to 1).
        outlier_fraction: share of each matrix's weights kept in fp16, all in 2-bit groups.
        g2: rows per second-order scale group.
        mse_clip: search a shrunk range per row group before the second order.
        w_algo: gptq (layer by layer) or rtn.
        act_order, block_size, damp: GPTQ's (see the ``gptq`` recipe).
        sequential: calibrate each block on the quantized previous blocks' outputs.
        qat_steps: fine-tuning steps with the format fake-quantized (0 = no QAT).
        qat_lr: Adam learning rate of the fine-tuning (Adam moves a weight by about this much a
            step, so ``qat_steps * qat_lr`` bounds how far a weight can cross its rounding
            boundaries).
        qat_seqlen: tokens per fine-tuning sample (cut from the calibration samples).
    """

    method = "mixed"
    roles = frozenset({"weights"})
    paper = "2/4/16 mixed precision (Li et al., 2024)"

    frac_4bit: float = 0.25
    outlier_fraction: float = 0.002
    g2: int = 16
    mse_clip: bool = True
    w_algo: Literal["gptq", "rtn"] = "gptq"
    # no RTN guard (every calibration sample goes into the Hessians; RTN would choose other
    # 4-bit groups): GPTQ settings mixed does not offer (not in its saved JSON)
    guard: ClassVar[bool] = False
    heldout_fraction: ClassVar[float] = 0.125
    qat_steps: Count = 0
    qat_lr: float = 1e-4
    qat_seqlen: int = 512

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.w_algo == "gptq" or self.qat_steps > 0

    @property
    def gptq_weights(self) -> bool:
        return self.w_algo == "gptq"

    @property
    def streams(self) -> bool:  # type: ignore[override]
        return self.qat_steps == 0  # QAT trains through the whole model

    def validate(self) -> None:
        if not 0.0 <= self.frac_4bit <= 1.0:
            raise LowbitError(f"frac_4bit must be in [0, 1], not {self.frac_4bit}")
        if not 0.0 <= self.outlier_fraction <= 0.05:
            raise LowbitError(f"outlier_fraction must be in [0, 0.05], not {self.outlier_fraction}")
        check_gptq_settings(self)
        for name in ("g2", "qat_seqlen"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LowbitError(f"{name} must be a positive integer, not {value!r}")
        if isinstance(self.qat_steps, bool) or self.qat_steps < 0:
            raise LowbitError(f"qat_steps must be 0 (off) or positive, not {self.qat_steps!r}")
        if self.w_algo not in ("gptq", "rtn"):
            raise LowbitError(f"w_algo must be gptq or rtn, not {self.w_algo!r}")
        if not 0 < self.qat_lr < float("inf"):
            raise LowbitError(f"qat_lr must be a positive finite number, not {self.qat_lr}")

    def weight_spec(self) -> MixedWeightSpec:
        return MixedWeightSpec(self.frac_4bit, self.outlier_fraction, self.g2, self.mse_clip)

    def apply(self, model, context: QuantizeContext) -> None:
        fixed = (*self.gptq_setting_names(), *_GLOBAL_SETTINGS)
        refuse_global_overrides(self.method, context.overrides, fixed)

        def spec_for(fqn: str) -> MixedWeightSpec:
            return context.recipe_for(self, fqn).weight_spec()

        if self.qat_steps > 0:
            from lowbit.algorithms.qat import mixed_qat

            model.lowbit_qat_report = mixed_qat(
                model, context.adapter, context.calibration, spec_for,
                steps=self.qat_steps, lr=self.qat_lr, seqlen=self.qat_seqlen,
                damp=self.damp, filter_fn=context.selected, device=context.device,
                progress=context.progress,
            )  # fmt: skip
            chosen = model.lowbit_qat_report.is4
            base = spec_for

            def spec_for(fqn: str) -> MixedWeightSpec:  # the groups QAT trained with
                spec = base(fqn)
                return MixedWeightSpec(
                    spec.frac_4bit, spec.outlier_fraction, spec.g2, spec.mse_clip, chosen[fqn]
                )

        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=spec_for,
            algo=self.w_algo,
            calibration=context.calibration,
            filter_fn=context.selected,
            gptq=self.gptq_settings(),
            progress=context.progress,
            hooks=context.blocks,
            resume_dir=context.resume_dir,
            recipe=context.resume_fingerprint(self),
            device=context.device,
        )


register_preset("mixed-2-4-16", "mixed", {"frac_4bit": 0.25, "outlier_fraction": 0.002, "g2": 16})
