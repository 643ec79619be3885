"""Packed quantized linear layers: the weight is held as real low-bit codes in memory.

:class:`PackedLinearBase` is what every packed weight format shares: the bias, the online input
transform and activation quantizer in front (as on a
:class:`~lowbit.nn.quant_linear.FakeQuantLinear`), the backend that multiplies (chosen per module,
:mod:`lowbit.kernels.dispatch`), accounting, and the JSON spec a checkpoint rebuilds it from.
A format subclasses it with its buffers, its container (``quantized_weight``, the simulated
face's source of truth), a ``format_kind`` that backends are registered for and its own spec
fields (``format_fields``), and registers itself with ``@register_module``
(:mod:`lowbit.nn.spec`); :func:`pack_model`, :func:`unpack_model`, checkpoints and resume
directories then handle it.

``PackedLinear`` is the integer format (2-8 bits, symmetric or with integer zeros, per output
channel or in groups along the input). Its buffers are what a checkpoint stores:

* ``qdata``: uint8 ``[ceil(out * in * bits / 8)]``, the unsigned codes of the row-major weight
  as one little-endian bit stream (:mod:`lowbit.formats.packing`, the canonical layout);
* ``scale``: ``[out, n_groups]`` in the scale dtype (fp16 for every weight recipe);
* ``zero``: uint8 ``[out, n_groups]`` integer zero points, asymmetric formats only.

Every format's ``"reference"`` backend dequantizes the whole weight in fp32 (the container's
``dequantize``), casts it to the input's dtype and calls ``F.linear``: the output equals the
simulated face's bit for bit, and it is the oracle for faster backends.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized
from lowbit.formats.packing import packed_words_per_row
from lowbit.kernels.dispatch import backend_names, packed_matmul, register_layer
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module
from lowbit.nn.spec import MODULES, Rebuildable, StoredFloatBuffers, register_module
from lowbit.settings import dtype_from_name, dtype_name

__all__ = [
    "PackedLinearBase",
    "PackedLinear",
    "packed_format_for",
    "packed_formats",
    "pack_model",
    "unpack_model",
    "set_backend",
]

_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class PackedLinearBase(Rebuildable, StoredFloatBuffers):
    """y = act_quantizer(input_transform(x)) @ Wᵀ + b, W held packed by a subclass.

    Casting the model's dtype casts the bias and the modules in front, never the packed
    buffers (:class:`~lowbit.nn.spec.StoredFloatBuffers`).

    Subclasses set ``format_kind`` (the key backends are registered under), ``container_type``
    (the weight container they pack, with ``dequantize``, ``storage_bits``, ``to``) and
    ``format_fields`` (the annotation of each field of :meth:`format_spec`, for checking
    checkpoints), and implement :meth:`from_quantized`, :attr:`quantized_weight`, :meth:`format_spec` (and
    :meth:`format_kwargs` where a field is not a keyword as it is) and :meth:`weight_format`.
    They call :meth:`_init_linear` from ``__init__``.
    """

    format_kind: ClassVar[str] = ""
    container_type: ClassVar[type] = object
    format_fields: ClassVar[dict[str, Any]] = {}
    optional_fields = ("backend",)

    def _init_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        weight_dtype: torch.dtype,
        bias: bool,
        input_transform: nn.Module | None,
        act_quantizer: nn.Module | None,
        backend: str,
        device: torch.device | str | None,
    ) -> None:
        if backend not in backend_names():
            raise LowbitError(f"unknown backend {backend!r}; choose one of {backend_names()}")
        self.in_features, self.out_features = in_features, out_features
        self.weight_dtype = weight_dtype
        self.backend = backend
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=weight_dtype, device=device), False)
            if bias
            else None
        )
        self.input_transform = input_transform
        self.act_quantizer = act_quantizer
        self._handle = register_layer(self)

    def __setstate__(self, state: dict[str, Any]) -> None:  # copies get their own handle
        super().__setstate__(state)
        self._handle = register_layer(self)

    def _apply(self, fn, recurse: bool = True):
        """The packed buffers keep their dtype (:class:`StoredFloatBuffers`); ``weight_dtype``
        follows a cast of the model, as a float weight would (``fn`` of an empty tensor)."""
        result = super()._apply(fn, recurse)
        probe = fn(torch.empty(0, dtype=self.weight_dtype))
        if isinstance(probe, Tensor) and probe.dtype.is_floating_point:
            self.weight_dtype = probe.dtype
        return result

    # -- what a format provides -------------------------------------------------------------------
    @classmethod
    def from_quantized(
        cls,
        weight: Any,
        bias: Tensor | None = None,
        *,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        weight_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ) -> PackedLinearBase:
        """The packed layer of a weight container (its tensors copied into buffers)."""
        raise NotImplementedError

    @property
    def quantized_weight(self) -> Any:
        """The weight as its container (views of the buffers)."""
        raise NotImplementedError

    def format_spec(self) -> dict[str, Any]:
        """The format's own JSON fields of :meth:`spec` (keyword arguments of ``__init__``)."""
        raise NotImplementedError

    @classmethod
    def format_kwargs(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """:meth:`format_spec`'s fields as ``__init__`` keywords (default: as they are)."""
        return fields

    def weight_format(self) -> str:
        """Short description of the weight format, for repr and reports."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------------
    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        """The fields every packed linear has, its format's own, and the backend."""
        common = {"in_features": int, "out_features": int, "weight_dtype": torch.dtype}
        return {**common, **cls.format_fields, "bias": bool, "backend": str}

    def spec(self) -> dict[str, Any]:
        """JSON settings from which :meth:`from_spec` builds this module empty (buffers of the
        right shapes and dtypes, filled by a checkpoint); without ``class`` and ``backend``."""
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            **self.format_spec(),
            "weight_dtype": dtype_name(self.weight_dtype),
            "bias": self.bias is not None,
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> PackedLinearBase:
        """An empty module from :meth:`spec`'s output (``class`` and ``backend`` optional)."""
        common = ("class", "in_features", "out_features", "weight_dtype", "bias", "backend")
        fields = {key: value for key, value in spec.items() if key not in common}
        return cls(
            spec["in_features"],
            spec["out_features"],
            weight_dtype=dtype_from_name(spec["weight_dtype"]),
            bias=spec["bias"],
            backend=spec.get("backend", "auto"),
            **cls.format_kwargs(fields),
        )

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """[out, in] weight in ``dtype`` (default: ``weight_dtype``), decoded in fp32."""
        return self.quantized_weight.dequantize(dtype or self.weight_dtype)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.act_quantizer is not None:
            x = self.act_quantizer(x)
        if torch.compiler.is_compiling():  # one opaque node (lowbit.kernels.dispatch)
            return torch.ops.lowbit.packed_matmul(x, self._handle, self.out_features)
        group = self.__dict__.get("shared_input")  # lowbit.nn.shared_input
        if group is not None:
            return group(self, x)  # [..., out], computed with its siblings'
        return packed_matmul(self, x)  # [..., out]

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features

    def storage_bits(self) -> int:
        """Exact bits of the weight with its statistics (as the container counts), plus bias."""
        bias_bits = 0 if self.bias is None else self.bias.numel() * self.bias.element_size() * 8
        return self.quantized_weight.storage_bits() + bias_bits

    def memory_bytes(self) -> int:
        """Bytes this layer's packed buffers and bias occupy in memory (measured)."""
        tensors = [*self.buffers(recurse=False), self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def storage_key(self) -> tuple[int, ...]:
        """Addresses of the packed buffers: a backend's prepared layout is valid while they
        stay (loading a checkpoint copies into them; moving the module replaces them)."""
        return tuple(b.data_ptr() for b in self._buffers.values() if b is not None)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, weight={self.weight_format()} "
            f"packed, backend={self.backend}"
        )


def packed_formats() -> dict[str, type[PackedLinearBase]]:
    """Every registered packed format, by checkpoint name."""
    return {n: c for n, c in MODULES.items() if issubclass(c, PackedLinearBase)}


def packed_format_for(weight: Any) -> type[PackedLinearBase]:
    """The packed module class of a weight container."""
    for cls in packed_formats().values():
        if isinstance(weight, cls.container_type):
            return cls
    raise LowbitError(f"lowbit has no packed linear for a {type(weight).__name__} weight")


@register_module
class PackedLinear(PackedLinearBase):
    """y = act_quantizer(input_transform(x)) @ dequantize(qdata, scale, zero)ᵀ + b.

    Args:
        in_features, out_features: the weight is ``[out_features, in_features]``.
        bits: code width, 2-8.
        group_size: input channels per scale; None = one scale per output channel.
        symmetric: codes ``q - 2**(bits-1)`` times the scale; else ``(q - zero) * scale``.
        scale_dtype: dtype the scales are stored in.
        weight_dtype: dtype the dequantized weight has by default (the float model's).
        bias: whether the layer has a bias (a float parameter ``[out]``).
        input_transform, act_quantizer: modules applied to the input first (as on
            ``FakeQuantLinear``), or None.
        backend: how the product is computed: a name from
            :func:`lowbit.kernels.dispatch.backend_names`; ``"auto"`` (the default) picks the
            fastest that runs the layer on the input's device and dtype, ``"reference"`` is the
            oracle.

    Buffers are allocated empty (zeros); :meth:`from_quantized` or ``load_state_dict`` fill them.
    """

    format_kind = "int"
    container_type = IntQuantized
    format_fields = {
        "bits": int, "group_size": int | None, "symmetric": bool, "scale_dtype": torch.dtype,
    }  # fmt: skip

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int,
        group_size: int | None = None,
        symmetric: bool = True,
        scale_dtype: torch.dtype = torch.float16,
        weight_dtype: torch.dtype = torch.float32,
        bias: bool = False,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
            raise LowbitError(f"a packed linear holds 2-8 bit codes, not bits={bits!r}")
        if group_size is not None and (group_size < 1 or in_features % group_size):
            raise LowbitError(
                f"group size {group_size} does not divide the input width {in_features}"
            )
        if scale_dtype not in _SCALE_DTYPES:
            raise LowbitError(f"scales are stored as fp16, bf16 or fp32, not {scale_dtype}")
        self._init_linear(
            in_features, out_features, weight_dtype=weight_dtype, bias=bias,
            input_transform=input_transform, act_quantizer=act_quantizer, backend=backend,
            device=device,
        )  # fmt: skip
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.scale_dtype = scale_dtype
        groups = 1 if group_size is None else in_features // group_size
        n_bytes = packed_words_per_row(in_features * out_features, bits)
        self.register_buffer("qdata", torch.zeros(n_bytes, dtype=torch.uint8, device=device))
        self.register_buffer(
            "scale", torch.ones(out_features, groups, dtype=scale_dtype, device=device)
        )
        zero = None if symmetric else torch.zeros(out_features, groups, dtype=torch.uint8)
        self.register_buffer("zero", None if zero is None else zero.to(device))

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_quantized(
        cls,
        weight: IntQuantized,
        bias: Tensor | None = None,
        *,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        weight_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ) -> PackedLinear:
        """The packed layer of a 2-d weight container (as RTN and GPTQ produce)."""
        if len(weight.shape) != 2 or weight.axis not in (-1, 1):
            raise LowbitError("a packed linear needs a [out, in] weight with scales per row")
        if weight.scale_q is not None or weight.zero_dtype is not None:
            raise LowbitError("double-quantized scales have no packed linear yet")
        out_features, in_features = weight.shape
        layer = cls(
            in_features,
            out_features,
            bits=weight.bits,
            group_size=weight.group_size,
            symmetric=weight.symmetric,
            scale_dtype=weight.scale_dtype,
            weight_dtype=weight_dtype or weight.dtype,
            bias=bias is not None,
            input_transform=input_transform,
            act_quantizer=act_quantizer,
            backend=backend,
            device=weight.qdata.device,
        )
        layer.qdata = weight.qdata.clone()
        # the container keeps its stats in fp32 holding values of the storage dtype: exact casts
        layer.scale = weight.scale.to(weight.scale_dtype)  # [out, G]
        if weight.zero is not None:
            layer.zero = weight.zero.to(torch.uint8)  # [out, G], integers 0..2**bits - 1
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @property
    def quantized_weight(self) -> IntQuantized:
        """The weight as an :class:`IntQuantized` container (views of the buffers)."""
        return IntQuantized(
            qdata=self.qdata,
            scale=self.scale.float(),
            zero=None if self.zero is None else self.zero.float(),
            bits=self.bits,
            symmetric=self.symmetric,
            axis=-1,
            group_size=self.group_size,
            shape=torch.Size((self.out_features, self.in_features)),
            dtype=self.weight_dtype,
            scale_dtype=self.scale_dtype,
        )

    def format_spec(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "scale_dtype": dtype_name(self.scale_dtype),
        }

    @classmethod
    def format_kwargs(cls, fields: dict[str, Any]) -> dict[str, Any]:
        return {**fields, "scale_dtype": dtype_from_name(fields["scale_dtype"])}

    def weight_format(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"int{self.bits} {group} {'sym' if self.symmetric else 'asym'}"


def pack_model(model: nn.Module) -> int:
    """Swap every ``FakeQuantLinear`` holding a quantized weight for the packed module of its
    format (``PackedLinear`` for integer weights), in place.

    The float weights are released; outputs are unchanged bit for bit. Returns the number of
    layers packed.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, FakeQuantLinear) and module.quantized_weight is not None
    ]
    for name, module in targets:
        packed = packed_format_for(module.quantized_weight).from_quantized(
            module.quantized_weight,
            module.bias,
            input_transform=module.input_transform,
            act_quantizer=module.act_quantizer,
            weight_dtype=module.weight.dtype,
        )
        replace_module(model, name, packed.to(module.weight.device))
    return len(targets)


def unpack_model(model: nn.Module) -> int:
    """Swap every packed linear for the ``FakeQuantLinear`` of the same weight (the simulated
    face: float weights in memory, faster on CPU). Returns the number of layers swapped."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinearBase)]
    for name, module in targets:
        weight = module.quantized_weight
        simulated = FakeQuantLinear(
            weight.dequantize(module.weight_dtype),
            module.bias,
            quantized_weight=weight,
            input_transform=module.input_transform,
            act_quantizer=module.act_quantizer,
            weight_format=module.weight_format(),
        )
        replace_module(model, name, simulated)
    return len(targets)


def set_backend(model: nn.Module, backend: str) -> int:
    """Set the backend of every packed linear in ``model``; returns how many there are."""
    if backend not in backend_names():
        raise LowbitError(
            f"unknown backend {backend!r}; choose one of {', '.join(backend_names())}"
        )
    layers = [m for m in model.modules() if isinstance(m, PackedLinearBase)]
    for layer in layers:
        layer.backend = backend
    return len(layers)
