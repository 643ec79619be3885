"""The package's structure, checked: layers that import only downward, no import circles, and
registries whose builtins tables say exactly what each module registers.

Every ``import`` of a lowbit module counts, at module level or inside a function (a lazy import
is still a dependency). The layers are docs/ARCHITECTURE.md's table, lowest first.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lowbit
from lowbit.kernels.dispatch import BACKENDS
from lowbit.kv.quantizer import KV_QUANTIZERS
from lowbit.nn.spec import MODULES
from lowbit.recipes.registry import RECIPES

SRC = Path(lowbit.__file__).parent

#: lowest first; a module may import its own layer and the layers below it
LAYERS = [
    {
        "errors",
        "version",
        "registry",
        "settings",
        "atomic",
        "files",
        "checksum",
        "mapped",
        "native",
    },
    {"formats"},
    {"kernels"},
    {"nn"},
    {"data", "calibrate"},
    {"models"},
    {"transforms"},
    {"kv"},
    {"algorithms"},
    {"recipes"},
    {"io"},
    {"api"},
    {"eval", "generate"},  # eval.run evaluates recipes through lowbit.api
    {"cli", "__main__", "__init__"},
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """lowbit module -> the lowbit modules it imports (anywhere in its code)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        graph[name] = {t for t in targets if t in modules and t != name and t != "lowbit"}
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and ARCHITECTURE.md")


def test_every_import_goes_down_or_stays_in_its_layer():
    graph = import_graph()
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if _layer(target) > _layer(source)
    )
    assert upward == []


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert circles == []


@pytest.mark.parametrize(
    "registry", [MODULES, BACKENDS, KV_QUANTIZERS, RECIPES], ids=lambda registry: registry.kind
)
def test_each_builtin_module_registers_exactly_what_the_table_says(registry):
    for module in sorted(set(registry.builtins.values())):
        importlib.import_module(module)
    registered = dict(registry.items())
    assert set(registered) == set(registry.builtins)
    for name, entry in registered.items():
        defined_in = getattr(entry, "__module__", None) or type(entry).__module__
        assert defined_in == registry.builtins[name], name
