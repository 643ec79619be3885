"""One way to find what a checkpoint or a command line names: a :class:`Registry` per kind.

lowbit has five kinds of named things: packed weight formats and the other runtime modules a
checkpoint rebuilds (:data:`lowbit.nn.spec.MODULES`), backends (:data:`lowbit.kernels.dispatch
.BACKENDS`), KV quantizers (:data:`lowbit.kv.quantizer.KV_QUANTIZERS`) and recipes
(:data:`lowbit.recipes.registry.RECIPES`). Each is a :class:`Registry` that works the same way:

* an entry registers itself where it is defined (``@REGISTRY.register`` on the class), so there
  is no list to keep in step with the code;
* the registry's ``builtins`` table says which module defines each of lowbit's own entries, so a
  lookup by name imports that module first: a checkpoint's names are found from the names alone,
  never by the chance of what was imported before (the table is checked by a test: every module
  registers exactly the names it is listed for);
* modules are imported on first use, so ``import lowbit`` stays light (no Triton, no recipes).

Entries from outside lowbit (a user's format, a test's toy format) register the same way and
need no table: their module is imported by whoever uses them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Generic, TypeVar

from lowbit.errors import LowbitError

__all__ = ["Registry"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Registry(Generic[K, T]):
    """Names of one kind (``kind``, for messages) to what they stand for.

    Args:
        kind: what an entry is, in words ("KV quantizer"), for error messages.
        key: the name of an object being registered (e.g. ``lambda cls: cls.kind``).
        builtins: lowbit's own entries: name -> the module that registers it.
    """

    def __init__(self, kind: str, key: Callable[[T], K], builtins: Mapping[K, str]):
        self.kind = kind
        self._key = key
        self.builtins = dict(builtins)
        self._entries: dict[K, T] = {}

    def register(self, obj: T) -> T:
        """Add ``obj`` under its key (usable as a class decorator); returns ``obj``."""
        name = self._key(obj)
        if not name:
            raise TypeError(f"{obj!r} has no {self.kind} name")
        self._entries[name] = obj
        return obj

    def unregister(self, name: K) -> None:
        """Forget a registered entry (tests that register a temporary one)."""
        self._entries.pop(name, None)

    def get(self, name: K) -> T:
        """The entry called ``name``, importing the builtin module that defines it if needed.

        Raises:
            LowbitError: no entry has that name (the message lists the known names).
        """
        if name not in self._entries and name in self.builtins:
            importlib.import_module(self.builtins[name])
            if name not in self._entries:  # the table is wrong: a bug in lowbit, not bad input
                raise RuntimeError(f"{self.builtins[name]} does not register {self.kind} {name!r}")
        if name not in self._entries:
            known = ", ".join(sorted(map(str, self.names())))
            raise LowbitError(f"unknown {self.kind} {name!r}; known: {known}"[:400])
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self.builtins

    def names(self) -> list[K]:
        """Every name, registered or builtin, without importing anything."""
        return list(dict.fromkeys([*self.builtins, *self._entries]))

    def load_builtins(self) -> None:
        """Import every builtin module (for listings)."""
        for module in dict.fromkeys(self.builtins.values()):
            importlib.import_module(module)

    def items(self) -> Iterator[tuple[K, T]]:
        """Every entry, builtins imported first."""
        self.load_builtins()
        return iter(list(self._entries.items()))
