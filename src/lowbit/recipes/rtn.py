"""The ``rtn`` recipe: round-to-nearest integer weights and per-token integer activations.

Fake-quantized (simulated): weights hold their dequantized values; the storage they would take
packed is recorded exactly for the bits accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.algorithms.weights import quantize_linears
from lowbit.recipes.base import OFF_BITS, QuantizeContext, Recipe
from lowbit.recipes.linear_settings import LinearQuantSettings, check_activation_groups
from lowbit.recipes.registry import register


@register
@dataclass
class RTNRecipe(LinearQuantSettings, Recipe):
    """Round-to-nearest weights (per output channel or per group) and per-token activations.

    Settings: those of :class:`~lowbit.recipes.linear_settings.LinearQuantSettings`.
    """

    method = "rtn"
    roles = frozenset({"weights", "activations"})
    streams = True

    def validate(self) -> None:
        self.validate_linear_settings()

    def nothing_to_do(self) -> str | None:
        if self.w_bits == OFF_BITS and self.a_bits == OFF_BITS:
            return (
                "w_bits=16 and a_bits=16 leave weights and activations in float (the fp "
                "recipe is the float model; weight bits are 2-8)"
            )
        return None

    def apply(self, model, context: QuantizeContext) -> None:
        check_activation_groups(model, context, self)
        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=lambda fqn: context.recipe_for(self, fqn).weight_spec(),
            algo="rtn",
            act_quantizer_for=lambda fqn: context.recipe_for(self, fqn).act_quantizer(),
            filter_fn=context.selected,
            progress=context.progress,
            hooks=context.blocks,
        )
