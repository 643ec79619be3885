"""The ``fp`` recipe: nothing quantized. The reference row of every table."""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.recipes.base import QuantizeContext, Recipe
from lowbit.recipes.registry import register


@register
@dataclass
class FloatRecipe(Recipe):
    """Leave the model in floating point."""

    method = "fp"

    def apply(self, model, context: QuantizeContext) -> None:
        return None
