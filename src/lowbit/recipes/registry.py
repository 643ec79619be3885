"""Recipe registry and named presets.

``get_recipe("rtn", w_bits="4")`` builds a method's recipe with settings; a preset name such as
``"w4a16-g64"`` stands for a method plus settings (the papers' and the baseline table's rows).
"""

from __future__ import annotations

from typing import Any

from lowbit.errors import LowbitError
from lowbit.recipes.base import Recipe

_METHODS: dict[str, type[Recipe]] = {}

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


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: make a recipe available by its ``method`` name."""
    if not cls.method:
        raise TypeError(f"{cls.__name__} has no method name")
    _METHODS[cls.method] = cls
    return cls


def _load_builtin_methods() -> None:
    """Import every module of ``lowbit.recipes``: importing a recipe module registers it."""
    import importlib
    import pkgutil

    import lowbit.recipes as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in ("base", "registry", "compose"):
            importlib.import_module(f"lowbit.recipes.{info.name}")


def list_recipes() -> dict[str, type[Recipe]]:
    _load_builtin_methods()
    return dict(sorted(_METHODS.items()))


def get_recipe(name: str, **settings: Any) -> Recipe:
    """A recipe by method or preset name, with settings applied (strings are parsed).

    Names joined by ``+`` (``"rotate+gptq+kvquant"``) build a
    :class:`~lowbit.recipes.compose.ComposedRecipe` that applies them in order.
    """
    from lowbit.recipes.compose import SEPARATOR, ComposedRecipe

    if SEPARATOR in name:
        recipe = ComposedRecipe([get_recipe(part) for part in name.split(SEPARATOR)])
        recipe.validate()
        return recipe.with_settings(**settings) if settings else recipe
    methods = list_recipes()
    if name in methods:
        recipe = methods[name]()
    elif name in PRESETS:
        method, preset = PRESETS[name]
        recipe = methods[method]().with_settings(**preset)
    else:
        raise LowbitError(
            f"unknown recipe {name!r}; methods: {', '.join(methods)}; presets: {', '.join(PRESETS)}"
        )
    recipe.validate()
    return recipe.with_settings(**settings) if settings else recipe


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Rebuild a recipe saved with ``Recipe.to_dict()``."""
    from lowbit.recipes.compose import ComposedRecipe

    if data.get("method") == "compose":
        return ComposedRecipe.from_dict(data)
    methods = list_recipes()
    method = data.get("method")
    if method not in methods:
        raise LowbitError(f"unknown recipe method {method!r} in saved data")
    return methods[method].from_dict(data)
