"""How a packed linear computes ``x @ Wᵀ``: backends chosen per module, never globally.

A :class:`WeightBackend` says whether it can run a layer on an input (and if not, why, in a
sentence), converts the layer's canonical packed tensors into the layout its kernel wants
(``prepare``, once per layer and device, cached on the layer), and multiplies. ``"reference"``
(dequantize in fp32, ``F.linear``) runs everything and is the oracle the others are tested
against. A layer's ``backend`` is a backend name or ``"auto"``: the first backend of
:data:`AUTO_ORDER` for the input's device that supports the layer and the input.

Backends register themselves with :func:`register_backend`; their modules are imported lazily
(:data:`_BACKEND_MODULES`) so that ``import lowbit`` never imports Triton.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from lowbit.errors import LowbitError

__all__ = [
    "WeightBackend",
    "register_backend",
    "get_backend",
    "backend_names",
    "choose",
    "packed_matmul",
    "AUTO_ORDER",
]

_REGISTRY: dict[str, WeightBackend] = {}

#: where each backend lives (imported on first use)
_BACKEND_MODULES: dict[str, str] = {
    "reference": __name__,
    "torch-cpu": "lowbit.kernels.torch_cpu",
    "triton": "lowbit.kernels.triton_int",
}

#: preference of ``backend="auto"`` per device type (first supported wins)
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("torch-cpu", "reference"),
    "cuda": ("triton", "reference"),
}


class WeightBackend:
    """One way to multiply by a packed integer weight. Subclasses set ``name``."""

    name: ClassVar[str] = ""

    def unsupported(self, layer, x: Tensor) -> str | None:
        """Why this backend cannot run ``layer`` on ``x`` (a sentence), or None if it can."""
        return None

    def prepare(self, layer) -> dict[str, Tensor]:
        """The layer's weight in this backend's layout (computed once per layer and device)."""
        return {}

    def matmul(self, layer, x: Tensor, prepared: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """``x [M, K] @ Wᵀ + bias -> [M, N]`` in ``x``'s dtype (bias ``[N]`` in that dtype)."""
        raise NotImplementedError


class ReferenceBackend(WeightBackend):
    """Dequantize the whole weight in fp32, cast to the input's dtype, ``F.linear``."""

    name = "reference"

    def matmul(self, layer, x: Tensor, prepared: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        return F.linear(x, layer.dequantize_weight(x.dtype), bias)


def register_backend(backend: WeightBackend) -> WeightBackend:
    """Make ``backend`` available by its name."""
    if not backend.name:
        raise LowbitError(f"{type(backend).__name__} has no name")
    _REGISTRY[backend.name] = backend
    return backend


register_backend(ReferenceBackend())


def backend_names() -> tuple[str, ...]:
    """Every backend name a layer accepts, ``"auto"`` included."""
    return ("auto", *_BACKEND_MODULES)


def get_backend(name: str) -> WeightBackend:
    """The backend called ``name`` (importing its module on first use)."""
    if name not in _BACKEND_MODULES:
        raise LowbitError(f"unknown backend {name!r}; choose one of {', '.join(backend_names())}")
    if name not in _REGISTRY:
        try:
            importlib.import_module(_BACKEND_MODULES[name])
        except ImportError as err:
            raise LowbitError(f"backend {name!r} is not available here ({err})") from err
    return _REGISTRY[name]


def choose(layer, x: Tensor) -> WeightBackend:
    """The backend that runs ``layer`` on ``x``: its own, or the first that fits for ``auto``."""
    if layer.backend != "auto":
        backend = get_backend(layer.backend)
        reason = backend.unsupported(layer, x)
        if reason is not None:
            raise LowbitError(f"backend {backend.name!r} cannot run this layer: {reason}")
        return backend
    for name in AUTO_ORDER.get(x.device.type, ("reference",)):
        try:
            backend = get_backend(name)
        except LowbitError:
            continue
        if backend.unsupported(layer, x) is None:
            return backend
    return get_backend("reference")


def packed_matmul(layer, x: Tensor) -> Tensor:
    """``x [..., K] @ Wᵀ + b -> [..., N]`` with the layer's backend; prepared layouts are cached
    on the layer per backend and device (they follow the canonical buffers, not replace them)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise LowbitError(f"packed linears take fp16, bf16 or fp32 inputs, not {x.dtype}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])  # [M, K]
    backend = choose(layer, x2d)
    key = (backend.name, x2d.device, layer.qdata.data_ptr())
    cache: dict[Any, dict[str, Tensor]] = layer.__dict__.setdefault("_prepared", {})
    if key not in cache:
        cache.clear()  # one prepared layout per layer: a new device or backend replaces it
        cache[key] = backend.prepare(layer)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    out = backend.matmul(layer, x2d, cache[key], bias)  # [M, N]
    return out.reshape(*lead, out.shape[-1])
