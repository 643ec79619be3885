"""How a packed linear computes ``x @ Wᵀ``: backends chosen per module, never globally.

A :class:`WeightBackend` multiplies by one packed weight format (its ``format_kind``: ``"int"``
for :class:`~lowbit.nn.packed_linear.PackedLinear`, others for the formats that register their
own packed modules). It says whether it can run a layer on an input (and if not, why, in a
sentence), converts the layer's canonical packed tensors into the layout its kernel wants
(``prepare``, once per layer and device, cached on the layer), and multiplies. A backend name
such as ``"triton"`` stands for one backend per format kind; ``"reference"`` (dequantize in
fp32 with the layer's container, ``F.linear``) runs every kind and is the oracle the others are
tested against. A layer's ``backend`` is a backend name or ``"auto"``: the first backend of
:data:`AUTO_ORDER` for the input's device that exists for the layer's kind and supports the
layer and the input.

Backends register themselves with :func:`register_backend` where they are defined;
:data:`BACKENDS`' builtins table names the module of each of lowbit's own (imported on first
use, so that ``import lowbit`` never imports Triton). Adding a backend is its module plus one
line in that table.

Under ``torch.compile`` a packed linear calls :func:`packed_matmul` through one opaque custom op,
``torch.ops.lowbit.packed_matmul(x, layer_handle, out_features)``: the graph keeps every packed
linear as a single node instead of tracing (and guarding on) the dispatch, so a decode step is
one graph (CUDA graphs included) whatever the backend, and the rest of the model is compiled
around it. The handle finds the layer in a registry of live packed linears
(:func:`register_layer`).
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.registry import Registry

__all__ = [
    "WeightBackend",
    "register_backend",
    "get_backend",
    "backend_names",
    "choose",
    "packed_matmul",
    "prepare_layer",
    "forget_prepared",
    "register_layer",
    "AUTO_ORDER",
    "BACKENDS",
    "ANY_KIND",
]

#: a format kind that stands for every kind (the reference backend's)
ANY_KIND = "*"

#: every backend by (name, format kind); "reference" is registered for ANY_KIND
BACKENDS: Registry[tuple[str, str], WeightBackend] = Registry(
    "backend",
    key=lambda backend: (backend.name, backend.format_kind) if backend.name else None,
    builtins={
        ("reference", ANY_KIND): __name__,
        ("torch-cpu", "int"): "lowbit.kernels.torch_cpu",
        ("triton", "int"): "lowbit.kernels.triton_int",
        ("torch-cpu", "spqr"): "lowbit.kernels.torch_cpu_decoded",
        ("triton", "spqr"): "lowbit.kernels.triton_spqr",
        ("torch-cpu", "mixed"): "lowbit.kernels.torch_cpu_decoded",
        ("triton", "mixed"): "lowbit.kernels.triton_mixed",
    },
)

#: what get_backend found per (name, format kind); emptied when a registration changes
_RESOLVED: dict[tuple[str, str], WeightBackend] = {}

#: preference of ``backend="auto"`` per device type (first supported wins)
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("torch-cpu", "reference"),
    "cuda": ("triton", "reference"),
}


class WeightBackend:
    """One way to multiply by one packed weight format. Subclasses set ``name`` and
    ``format_kind``."""

    name: ClassVar[str] = ""
    format_kind: ClassVar[str] = "int"

    def unsupported(self, layer, x: Tensor) -> str | None:
        """Why this backend cannot run ``layer`` on ``x`` (a sentence), or None if it can; it
        may depend on ``x``'s device, dtype and row count (:func:`packed_matmul` keeps the
        choice while those stay)."""
        return None

    def prepare(self, layer) -> dict[str, Tensor]:
        """The layer's weight in this backend's layout (computed once per layer and device)."""
        return {}

    def matmul(self, layer, x: Tensor, prepared: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """``x [M, K] @ Wᵀ + bias -> [M, N]`` in ``x``'s dtype (bias ``[N]`` in that dtype)."""
        raise NotImplementedError

    def prepare_group(self, layers: list) -> dict[str, Any] | None:
        """One layout for one layer or for layers that read one input (q/k/v, gate/up),
        multiplied in one call by :meth:`matmul_layout`; its ``"columns"`` holds each layer's
        ``(start, n)`` in the product. None where this backend has no such layout (the
        default). :mod:`lowbit.nn.run_linear` runs a model from these layouts alone."""
        return None

    def matmul_layout(self, x: Tensor, prepared: dict[str, Any]) -> Tensor:
        """``x [M, K]`` times every weight of a :meth:`prepare_group` layout: ``[M, N']``,
        each layer's output at its ``columns``, no bias."""
        raise NotImplementedError


class ReferenceBackend(WeightBackend):
    """Dequantize the whole weight in fp32, cast to the input's dtype, ``F.linear``."""

    name = "reference"
    format_kind = ANY_KIND

    def matmul(self, layer, x: Tensor, prepared: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        return F.linear(x, layer.dequantize_weight(x.dtype), bias)


def register_backend(backend: WeightBackend) -> WeightBackend:
    """Make ``backend`` available by its name for its format kind."""
    BACKENDS.register(backend)
    _RESOLVED.clear()
    return backend


register_backend(ReferenceBackend())


def backend_names() -> tuple[str, ...]:
    """Every backend name a layer accepts, ``"auto"`` included."""
    return ("auto", *dict.fromkeys(name for name, _ in BACKENDS.names()))


def get_backend(name: str, format_kind: str = "int") -> WeightBackend:
    """The backend called ``name`` for layers of ``format_kind`` (importing its module on first
    use; remembered, since every packed linear asks on every call)."""
    backend = _RESOLVED.get((name, format_kind))
    if backend is None:
        backend = _RESOLVED[(name, format_kind)] = _resolve(name, format_kind)
    return backend


def _resolve(name: str, format_kind: str) -> WeightBackend:
    if name not in backend_names() or name == "auto":
        raise LowbitError(f"unknown backend {name!r}; choose one of {', '.join(backend_names())}")
    key = (name, format_kind) if (name, format_kind) in BACKENDS else (name, ANY_KIND)
    if key not in BACKENDS:
        raise LowbitError(f"backend {name!r} has no kernel for {format_kind} weights")
    try:
        return BACKENDS.get(key)
    except ImportError as err:
        raise LowbitError(f"backend {name!r} is not available here ({err})") from err


def choose(layer, x: Tensor) -> WeightBackend:
    """The backend that runs ``layer`` on ``x``: its own, or the first that fits for ``auto``."""
    kind = layer.format_kind
    if layer.backend != "auto":
        backend = get_backend(layer.backend, kind)
        reason = backend.unsupported(layer, x)
        if reason is not None:
            raise LowbitError(f"backend {backend.name!r} cannot run this layer: {reason}")
        return backend
    for name in AUTO_ORDER.get(x.device.type, ("reference",)):
        try:
            backend = get_backend(name, kind)
        except LowbitError:
            continue
        if backend.unsupported(layer, x) is None:
            return backend
    return get_backend("reference", kind)


def packed_matmul(layer, x: Tensor) -> Tensor:
    """``x [..., K] @ Wᵀ + b -> [..., N]`` with the layer's backend; prepared layouts are cached
    on the layer per backend and device (they follow the canonical buffers, not replace them).

    The choice of backend and its prepared layout are looked up again only when the layer's
    backend setting, the input's device, dtype or row count, or the layer's buffers change: a
    call in a decode step is one tuple comparison and the backend's product."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])  # [M, K]
    key = (layer.backend, x2d.device, x2d.dtype, x2d.shape[0], layer.storage_key())
    plan = layer.__dict__.get("_plan")
    if plan is None or plan[0] != key or layer.__dict__.get("_prepared") is not plan[3]:
        plan = layer.__dict__["_plan"] = _plan(layer, x2d, key)
    backend, prepared = plan[1], plan[2]
    bias = layer.bias
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    out = backend.matmul(layer, x2d, prepared, bias)  # [M, N]
    return out if len(lead) == 1 else out.reshape(*lead, out.shape[-1])


def _plan(layer, x2d: Tensor, key: tuple) -> tuple:
    """``(key, backend, prepared layout, the layer's prepared cache)`` for inputs like ``x2d``."""
    if x2d.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise LowbitError(f"packed linears take fp16, bf16 or fp32 inputs, not {x2d.dtype}")
    backend = choose(layer, x2d)
    prepared_key = (backend.name, x2d.device, key[4])
    cache: dict[Any, dict[str, Tensor]] = layer.__dict__.setdefault("_prepared", {})
    if prepared_key not in cache:
        cache.clear()  # one prepared layout per layer: a new device or backend replaces it
        cache[prepared_key] = backend.prepare(layer)
    return key, backend, cache[prepared_key], cache


def prepare_layer(layer, dtype: torch.dtype) -> None:
    """Choose ``layer``'s backend and compute its prepared layout now, for inputs of ``dtype`` on
    the device of its buffers, instead of on its first call.

    Under ``torch.compile(mode="reduce-overhead")`` a first call runs inside CUDA graphs' warm-up,
    where anything allocated comes from the graph's private pool; a layout cached there outlives
    the graph and the capture is refused. Prepared beforehand, a compiled step allocates nothing
    that it keeps."""
    device = next((b.device for b in layer._buffers.values() if b is not None), None)
    if device is None or device.type == "meta":
        return
    x2d = torch.empty(1, layer.in_features, device=device, dtype=dtype)  # [1, K], never read
    key = (layer.backend, x2d.device, x2d.dtype, 1, layer.storage_key())
    layer.__dict__["_plan"] = _plan(layer, x2d, key)


def forget_prepared(layer) -> None:
    """Drop ``layer``'s cached backend choice and prepared layout (a copy of its weights in the
    kernel's layout), for a layer run once and not again soon: a layer-major pass over a model
    larger than memory (:mod:`lowbit.eval.streamed`). The next call prepares them again."""
    layer.__dict__.pop("_plan", None)
    layer.__dict__.pop("_prepared", None)


#: live packed linears by handle, for the compiled path's custom op
_LAYERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register_layer(layer) -> int:
    """Make ``layer`` reachable by the custom op; returns its handle (its ``id``)."""
    _LAYERS[id(layer)] = layer
    return id(layer)


@torch.library.custom_op("lowbit::packed_matmul", mutates_args=())
def _packed_matmul_op(x: Tensor, layer_handle: int, out_features: int) -> Tensor:
    """:func:`packed_matmul` of the registered layer, opaque to ``torch.compile``."""
    return packed_matmul(_LAYERS[layer_handle], x)


@_packed_matmul_op.register_fake
def _(x: Tensor, layer_handle: int, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
