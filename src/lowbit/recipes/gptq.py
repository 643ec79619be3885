"""The ``gptq`` recipe: GPTQ integer weights (no rotation), optional per-token activations.

Weights are calibrated layer by layer (:func:`lowbit.algorithms.weights.quantize_linears`);
with ``guard`` each layer keeps whichever of GPTQ and RTN has the smaller output error on
held-out calibration samples. Fake-quantized like ``rtn``: weights hold their dequantized
values, their packed storage is recorded exactly. The per-layer choices are left on the model
as ``model.lowbit_weight_report`` (a :class:`~lowbit.algorithms.weights.WeightQuantReport`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.algorithms.weights import quantize_linears
from lowbit.recipes.base import (
    OFF_BITS,
    QuantizeContext,
    Recipe,
    check_gptq_settings,
    refuse_global_overrides,
)
from lowbit.recipes.linear_settings import (
    GPTQRecipeSettings,
    LinearQuantSettings,
    check_activation_groups,
)
from lowbit.recipes.registry import register


@register
@dataclass
class GPTQRecipe(GPTQRecipeSettings, LinearQuantSettings, Recipe):
    """GPTQ weights (per output channel or per group) and per-token activations.

    Settings: rtn's and GPTQ's (:class:`~lowbit.recipes.linear_settings.GPTQRecipeSettings`),
    each described in :mod:`lowbit.recipes.settings_help` (``lowbit recipes`` prints them).
    """

    method = "gptq"
    needs_calibration = True
    roles = frozenset({"weights", "activations"})
    streams = True
    distributes = True
    paper = "GPTQ (Frantar et al., 2023)"

    gptq_weights = True

    def validate(self) -> None:
        self.validate_linear_settings()
        check_gptq_settings(self)

    def nothing_to_do(self) -> str | None:
        if self.w_bits == OFF_BITS:
            return (
                "w_bits=16 leaves every weight in float, so GPTQ has nothing to calibrate "
                "(weight bits are 2-8; rtn with w_bits=16 quantizes activations alone)"
            )
        return None

    def apply(self, model, context: QuantizeContext) -> None:
        refuse_global_overrides(self.method, context.overrides, self.gptq_setting_names())
        check_activation_groups(model, context, self)  # fail before the long calibration
        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=lambda fqn: context.recipe_for(self, fqn).weight_spec(),
            algo="gptq",
            calibration=context.calibration,
            act_quantizer_for=lambda fqn: context.recipe_for(self, fqn).act_quantizer(),
            filter_fn=context.selected,
            gptq=self.gptq_settings(),
            progress=context.progress,
            hooks=context.blocks,
            resume_dir=context.resume_dir,
            recipe=context.resume_fingerprint(self),
            device=context.device,
            group=context.group,
        )
