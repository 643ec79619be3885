"""The ``gguf`` recipe: weights on one of llama.cpp's block grids, by GPTQ or RTN.

Every block linear is quantized onto ``gguf_type`` (:mod:`lowbit.formats.gguf_blocks`), so
``lowbit export --format gguf`` writes exactly the weights lowbit evaluated. ``rotate+gguf``
(with the rotation's ``online=false``) puts QuaRot's residual rotation in front of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.algorithms.gguf_spec import GGUFWeightSpec
from lowbit.algorithms.weights import quantize_linears
from lowbit.errors import LowbitError
from lowbit.recipes.base import (
    QuantizeContext,
    Recipe,
    check_gptq_settings,
    refuse_global_overrides,
)
from lowbit.recipes.linear_settings import GPTQRecipeSettings
from lowbit.recipes.registry import register


@register
@dataclass
class GGUFRecipe(GPTQRecipeSettings, Recipe):
    """Weights on a llama.cpp block type (``gguf_type``) by ``w_algo`` (gptq or rtn).

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them). Act-order fixes every block's grid in advance; without it GPTQ fits each block's
    grid when it reaches the block.
    """

    method = "gguf"
    roles = frozenset({"weights"})
    paper = "llama.cpp's block formats, calibrated by GPTQ (Frantar et al., 2023)"

    gguf_type: str = "Q4_0"
    w_algo: str = "gptq"
    act_order: bool = False

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.w_algo == "gptq"

    def validate(self) -> None:
        if self.w_algo not in ("gptq", "rtn"):
            raise LowbitError(f"w_algo must be gptq or rtn, not {self.w_algo!r}")
        self.weight_spec()  # an unknown type is one sentence
        check_gptq_settings(self)

    def weight_spec(self) -> GGUFWeightSpec:
        return GGUFWeightSpec(self.gguf_type.upper())

    def apply(self, model, context: QuantizeContext) -> None:
        refuse_global_overrides(self.method, context.overrides, self.gptq_setting_names())
        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=lambda fqn: context.recipe_for(self, fqn).weight_spec(),
            algo=self.w_algo,
            calibration=context.calibration,
            filter_fn=context.selected,
            gptq=self.gptq_settings(),
            progress=context.progress,
            resume_dir=context.resume_dir if self.w_algo == "gptq" else None,
            recipe=context.resume_fingerprint(self),
            device=context.device,
        )
