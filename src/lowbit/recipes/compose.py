"""Recipes applied one after another: ``rotate+gptq+kvquant`` is one recipe.

A composed recipe holds its parts and applies them in order on the same model: a transform
(``rotate``), then a weight method, then a KV-cache method. Each part sees only the settings
and per-layer overrides it has; a ``--set key=value`` goes to every part that has ``key``. What
a part learns per layer for the parts after it (``learn-rotate``'s activation clips) reaches
them as per-layer settings, under the user's overrides. The checkpoint stores the parts' own
``to_dict()``; the per-layer values live in the quantized modules.

What may compose follows from what each part does, not from a list of pairs: every recipe
declares the :data:`~lowbit.recipes.base.ROLES` it plays (``rotate``: rotation; ``gptq``:
weights and activations; ``kivi``: the KV cache; ``quarot``: all four), and a composition is
refused when it is built (before any model is touched) if two parts play one role
(``gptq+gptq``, ``rtn+gptq``, ``kivi+kvquant``, ``quarot+rotate``) or a part plays a role that
comes before one an earlier part played (``gptq+rotate``, ``kivi+gptq``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowbit.errors import LowbitError
from lowbit.recipes.base import ROLES, QuantizeContext, Recipe

__all__ = ["ComposedRecipe", "SEPARATOR"]

SEPARATOR = "+"


@dataclasses.dataclass
class ComposedRecipe(Recipe):
    """``parts`` applied in order.

    Args:
        parts: two or more recipes, at most one per role, in the order of
            :data:`~lowbit.recipes.base.ROLES` (rotation, weights, activations, KV cache).
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

    @property
    def streams(self) -> bool:  # type: ignore[override]
        return all(part.streams for part in self.parts)

    @property
    def roles(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset().union(*(part.roles for part in self.parts))

    def played_roles(self) -> frozenset[str]:
        return frozenset().union(*(part.played_roles() for part in self.parts))

    # -- data -----------------------------------------------------------------------------------
    def validate(self) -> None:
        if len(self.parts) < 2:
            raise LowbitError("a composed recipe needs at least two parts")
        for part in self.parts:
            part.validate()
        check_roles(self.parts)

    def check_does_something(self) -> None:
        """Every part must do something (a part that does nothing is a setting gone wrong)."""
        for index, part in enumerate(self.parts, 1):
            reason = part.nothing_to_do()
            if reason is not None:
                raise LowbitError(
                    f"{_label(index, part)} of {self.method!r} with these settings does "
                    f"nothing: {reason}"
                )

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
        """Each value goes to every part that has the setting; one no part has is an error, as
        is a part left with nothing to do."""
        recipe = self.for_layer(**values)
        recipe.check_does_something()
        return recipe

    def for_layer(self, **values: Any) -> ComposedRecipe:
        """Each part's own :meth:`~lowbit.recipes.base.Recipe.for_layer` of the values it has."""
        unknown = sorted(set(values) - set(self.field_types()))
        if unknown:
            raise LowbitError(
                f"recipe {self.method!r} has no setting {unknown[0]!r}; its settings are: "
                f"{', '.join(self.field_types())}"
            )
        recipe = ComposedRecipe([part.for_layer(**_own(part, values)) for part in self.parts])
        recipe.validate()
        return recipe

    # -- work -----------------------------------------------------------------------------------
    def check_model(self, model, context: QuantizeContext) -> None:
        for part in self.parts:
            part.check_model(model, context)

    def apply(self, model, context: QuantizeContext) -> None:
        self.check_model(model, context)  # every part's cheap checks before any part's work
        learned: dict[str, dict[str, Any]] = {}  # what earlier parts learned, per layer
        for part in self.parts:
            layers = {**learned, **context.overrides}  # the user's overrides applied last
            overrides = {p: own for p, v in layers.items() if (own := _own(part, v))}
            part_context = dataclasses.replace(context, overrides=overrides)
            learned.update(part.apply(model, part_context) or {})

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        sizes = [part.kv_bytes_per_token(adapter, context_length) for part in self.parts]
        sizes = [size for size in sizes if size is not None]
        return sizes[-1] if sizes else None


def check_roles(parts: list[Recipe]) -> None:
    """Refuse parts that play one role twice, or that play their roles out of the order of
    :data:`~lowbit.recipes.base.ROLES`, with one sentence naming the two parts."""
    order = list(ROLES)
    played: dict[str, tuple[int, Recipe]] = {}  # role -> (1-based index, part) that played it
    for index, part in enumerate(parts, 1):
        roles = sorted(part.played_roles(), key=order.index)
        for role in roles:
            if role in played:
                does, why = ROLES[role]
                first = _label(*played[role])
                raise LowbitError(f"{first} and {_label(index, part)} both {_plural(does)}: {why}")
        for role in roles:
            later = [r for r in played if order.index(r) > order.index(role)]
            if later:
                earlier_role = min(later, key=order.index)
                earlier_index, earlier = played[earlier_role]
                raise LowbitError(
                    f"{_label(index, part)} must come before {_label(earlier_index, earlier)}: "
                    "a composition rotates, then quantizes weights and activations, then the "
                    f"KV cache ({part.method} {ROLES[role][0]}, {earlier.method} "
                    f"{ROLES[earlier_role][0]})"
                )
        played.update(dict.fromkeys(roles, (index, part)))


def _label(index: int, part: Recipe) -> str:
    return f"{part.method!r} (part {index})"


def _plural(does: str) -> str:
    """A role's phrase for two parts: ``quantizes the weights`` -> ``quantize the weights``."""
    verb, _, rest = does.partition(" ")
    return f"{verb[:-1]} {rest}"


def _own(part: Recipe, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that are settings of ``part``."""
    types = part.field_types()
    return {key: value for key, value in values.items() if key in types}
