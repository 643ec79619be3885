"""Recipes applied one after another: ``rotate+gptq+kvquant`` is one recipe.

A composed recipe holds its parts and applies them in order on the same model: a transform
(``rotate``), then a weight method, then a KV-cache method. Each part sees only the settings
and per-layer overrides it has; a ``--set key=value`` goes to every part that has ``key``. The
checkpoint stores the parts' own ``to_dict()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowbit.errors import LowbitError
from lowbit.recipes.base import QuantizeContext, Recipe

__all__ = ["ComposedRecipe", "SEPARATOR"]

SEPARATOR = "+"


@dataclasses.dataclass
class ComposedRecipe(Recipe):
    """``parts`` applied in order.

    Args:
        parts: two or more recipes (at most one of them may quantize the KV cache: a second
            is refused when it installs its cache).
    """

    parts: list[Recipe] = dataclasses.field(default_factory=list)

    version = 1

    @property
    def method(self) -> str:  # type: ignore[override]
        return SEPARATOR.join(part.method for part in self.parts)

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return any(part.needs_calibration for part in self.parts)

    @property
    def gptq_weights(self) -> bool:
        return any(getattr(part, "gptq_weights", False) for part in self.parts)

    # -- data -----------------------------------------------------------------------------------
    def validate(self) -> None:
        if len(self.parts) < 2:
            raise LowbitError("a composed recipe needs at least two parts")
        for part in self.parts:
            part.validate()

    def settings(self) -> dict[str, Any]:
        return {part.method: part.settings() for part in self.parts}

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": "compose",
            "version": self.version,
            "parts": [part.to_dict() for part in self.parts],
        }

    def field_types(self) -> dict[str, Any]:  # type: ignore[override]
        types: dict[str, Any] = {}
        for part in self.parts:
            types.update(part.field_types())
        return types

    def with_settings(self, **values: Any) -> ComposedRecipe:
        """Each value goes to every part that has the setting; one no part has is an error."""
        unknown = sorted(set(values) - set(self.field_types()))
        if unknown:
            raise LowbitError(
                f"recipe {self.method!r} has no setting {unknown[0]!r}; its settings are: "
                f"{', '.join(self.field_types())}"
            )
        parts = [part.with_settings(**_own(part, values)) for part in self.parts]
        recipe = ComposedRecipe(parts)
        recipe.validate()
        return recipe

    # -- work -----------------------------------------------------------------------------------
    def apply(self, model, context: QuantizeContext) -> None:
        for part in self.parts:
            overrides = {p: _own(part, v) for p, v in context.overrides.items()}
            part.apply(model, dataclasses.replace(context, overrides=overrides))

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        sizes = [part.kv_bytes_per_token(adapter, context_length) for part in self.parts]
        sizes = [size for size in sizes if size is not None]
        return sizes[-1] if sizes else None


def _own(part: Recipe, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that are settings of ``part``."""
    types = part.field_types()
    return {key: value for key, value in values.items() if key in types}
