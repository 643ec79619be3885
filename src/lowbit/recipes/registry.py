"""Recipe registry and named presets.

``get_recipe("rtn", w_bits="4")`` builds a method's recipe with settings; a preset name such as
``"w4a16-g64"`` stands for a method plus settings (the papers' and the baseline table's rows);
names joined by ``+`` compose. Methods are a :class:`~lowbit.registry.Registry`: each recipe
class registers itself with ``@register``, and :data:`RECIPES`' builtins table names the module
of each of lowbit's own, so a checkpoint's recipe is found from its name alone.
"""

from __future__ import annotations

from typing import Any

from lowbit.errors import LowbitError
from lowbit.recipes.base import Recipe
from lowbit.recipes.compose import SEPARATOR, ComposedRecipe
from lowbit.registry import Registry

#: every method's recipe class by method name
RECIPES: Registry[str, type[Recipe]] = Registry(
    "recipe method",
    key=lambda cls: cls.method,
    builtins={
        "fp": "lowbit.recipes.fp",
        "rtn": "lowbit.recipes.rtn",
        "gptq": "lowbit.recipes.gptq",
        "quarot": "lowbit.recipes.quarot",
        "rotate": "lowbit.recipes.rotate",
        "learn-rotate": "lowbit.recipes.learn_rotate",
        "kv-int": "lowbit.recipes.kv_int",
        "kivi": "lowbit.recipes.kivi",
        "kvquant": "lowbit.recipes.kvquant",
        "ksort-bfp": "lowbit.recipes.ksort_bfp",
        "spqr": "lowbit.recipes.spqr",
        "mixed": "lowbit.recipes.mixed",
        "gguf": "lowbit.recipes.gguf",
    },
)

#: class decorator: make a recipe class available by its ``method`` name
register = RECIPES.register

# preset name -> (method, settings)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "w8a16": ("rtn", {"w_bits": 8}),
    "w4a16": ("rtn", {"w_bits": 4}),
    "w4a16-g128": ("rtn", {"w_bits": 4, "w_group": 128}),
    "w4a16-g64": ("rtn", {"w_bits": 4, "w_group": 64}),
    "w8a8": ("rtn", {"w_bits": 8, "a_bits": 8}),
    "w8a4": ("rtn", {"w_bits": 8, "a_bits": 4}),
    "w4a4": ("rtn", {"w_bits": 4, "a_bits": 4}),
    "w4a16-gptq": ("gptq", {"w_bits": 4}),
    "w4a16-g64-gptq": ("gptq", {"w_bits": 4, "w_group": 64}),
    "quarot-rtn": ("quarot", {"w_algo": "rtn"}),  # W4A4KV4, round-to-nearest weights
    "quarot-w4a16": ("quarot", {"a_bits": 16, "kv_bits": 16}),  # GPTQ weights on the rotated model
}


def register_preset(name: str, method: str, settings: dict[str, Any]) -> None:
    """Make ``name`` stand for ``method`` with ``settings`` (e.g. a paper's configuration)."""
    if name in PRESETS and PRESETS[name] != (method, settings):
        raise ValueError(f"preset {name!r} is already defined differently")
    PRESETS[name] = (method, settings)


def list_recipes() -> dict[str, type[Recipe]]:
    """Every method's recipe class, by name."""
    return dict(sorted(RECIPES.items()))


def get_recipe(name: str, **settings: Any) -> Recipe:
    """A recipe by method or preset name, with settings applied (strings are parsed).

    Names joined by ``+`` (``"rotate+gptq+kvquant"``) build a
    :class:`~lowbit.recipes.compose.ComposedRecipe` that applies them in order.
    """
    if SEPARATOR in name:
        recipe = ComposedRecipe([get_recipe(part) for part in name.split(SEPARATOR)])
        recipe.validate()
        return recipe.with_settings(**settings) if settings else recipe
    if name not in RECIPES and name not in PRESETS:
        list_recipes()  # a recipe module registers its own presets (spqr-w3-1pct) on import
    if name in RECIPES:
        recipe = RECIPES.get(name)()
    elif name in PRESETS:
        method, preset = PRESETS[name]
        recipe = RECIPES.get(method)().with_settings(**preset)
    else:
        methods = ", ".join(sorted(RECIPES.names()))
        raise LowbitError(
            f"unknown recipe {name!r}; methods: {methods}; presets: {', '.join(PRESETS)}"
        )
    recipe.validate()
    return recipe.with_settings(**settings) if settings else recipe


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Rebuild a recipe saved with ``Recipe.to_dict()`` (a composition: its parts in order)."""
    if not isinstance(data, dict):
        raise LowbitError(f"saved recipe data must be a JSON object, not {data!r}"[:200])
    if data.get("method") != "compose":
        if data.get("method") not in RECIPES:
            raise LowbitError(f"unknown recipe method {data.get('method')!r} in saved data")
        return RECIPES.get(data["method"]).from_dict(data)
    if data.get("version") != ComposedRecipe.version:
        raise LowbitError(
            f"composed recipe version {data.get('version')} cannot be read by this lowbit "
            f"(it reads version {ComposedRecipe.version})"
        )
    parts = data.get("parts")
    if not isinstance(parts, list):
        raise LowbitError("a composed recipe's data has no list of parts")
    recipe = ComposedRecipe([recipe_from_dict(part) for part in parts])
    recipe.validate()
    return recipe
