"""Runtime modules a checkpoint rebuilds, found by name: :data:`MODULES` and the JSON specs.

Every module lowbit puts into a model and a checkpoint must restore (packed linears of each
weight format, float linears behind an online transform, online Hadamards, activation and query
quantizers) is a :class:`Rebuildable`: it gives its settings as a JSON dict (:meth:`spec`),
describes their types (:attr:`spec_fields`, annotations as :mod:`lowbit.settings` reads them)
and is built empty from them (:meth:`from_spec`: buffers of the right shapes and dtypes, which
the checkpoint's tensors fill). Derived state (Hadamard factors) is recomputed by the
constructor, never stored. A spec on disk is ``{"class": name, **settings}``.

A module class registers itself with ``@register_module``; :data:`MODULES`' builtins table
names the module that defines each of lowbit's own, so :func:`build_module` finds any class a
checkpoint names from the name alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from lowbit.errors import LowbitError
from lowbit.registry import Registry
from lowbit.settings import check_fields

__all__ = [
    "Rebuildable",
    "StoredFloatBuffers",
    "MODULES",
    "register_module",
    "spec_name",
    "build_module",
]


class Rebuildable:
    """Mixin of a runtime module that a checkpoint rebuilds from JSON.

    Subclasses set :attr:`spec_fields` and implement :meth:`spec` and :meth:`from_spec`; a class
    whose checkpoint name differs from its Python name sets :attr:`spec_name`.
    """

    #: the JSON type of every setting :meth:`spec` returns (annotations; :mod:`lowbit.settings`)
    spec_fields: ClassVar[dict[str, Any]] = {}
    #: settings a spec may leave out (the constructor has a default for them)
    optional_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        """Every field a spec of this class has, with its annotation."""
        return cls.spec_fields

    def spec(self) -> dict[str, Any]:
        """JSON settings from which :meth:`from_spec` builds this module empty."""
        raise NotImplementedError

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> nn.Module:
        """An empty module of this structure (fields checked against :meth:`spec_schema`)."""
        raise NotImplementedError


class StoredFloatBuffers(nn.Module):
    """A module whose float buffers are stored data (fp16 scales, codebooks, ranges).

    ``model.to(dtype)``, ``.half()``, ``.bfloat16()`` and transformers' ``dtype=`` at load time
    cast the model's parameters; rounding these buffers too would change what was quantized, so
    they keep their dtype (buffers are created with an explicit dtype, never the default one).
    Device moves still apply.
    """

    def _apply(self, fn, recurse: bool = True):
        stored = {n: b for n, b in self._buffers.items() if b is not None and b.is_floating_point()}
        result = super()._apply(fn, recurse)
        for name, before in stored.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)  # [same shape], stored dtype
        return result


def spec_name(cls: type) -> str:
    """The name a checkpoint calls a rebuildable class by."""
    return cls.__dict__.get("spec_name", cls.__name__)


#: every rebuildable module class by checkpoint name
MODULES: Registry[str, type[Rebuildable]] = Registry(
    "lowbit module",
    key=spec_name,
    builtins={
        "PackedLinear": "lowbit.nn.packed_linear",
        "SpQRLinear": "lowbit.nn.spqr_linear",
        "MixedLinear": "lowbit.nn.mixed_linear",
        "GGUFLinear": "lowbit.nn.gguf_linear",
        "FloatLinear": "lowbit.nn.quant_linear",
        "ActivationQuantizer": "lowbit.nn.act_quant",
        "OnlineHadamard": "lowbit.transforms.hadamard",
        "CrossHeadHadamard": "lowbit.transforms.rotate",
        "BFPQueryQuantizer": "lowbit.kv.bfp_quant",
    },
)

#: class decorator: make a :class:`Rebuildable` module class known to checkpoints
register_module = MODULES.register


def build_module(spec: Any) -> nn.Module:
    """An empty module from a checkpoint's spec (``{"class": name, **settings}``), its fields
    checked first, so a damaged spec is a LowbitError naming the field."""
    name = spec.get("class") if isinstance(spec, dict) else None
    if not isinstance(name, str):
        raise LowbitError(f"the checkpoint has a module spec without a class: {spec!r}"[:200])
    cls = MODULES.get(name)
    check_fields(spec, cls.spec_schema(), name, optional=cls.optional_fields)
    return cls.from_spec(spec)
