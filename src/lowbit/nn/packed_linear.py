"""Packed quantized linear layers: the weight is held as real low-bit codes in memory.

A ``PackedLinear`` is the packed face of a :class:`~lowbit.nn.quant_linear.FakeQuantLinear`:
the same integer weight (2-8 bits, symmetric or with integer zeros, per output channel or in
groups along the input), the same online input transform and activation quantizer in front,
and the same output bit for bit. Its buffers are what a checkpoint stores:

* ``qdata``: uint8 ``[ceil(out * in * bits / 8)]``, the unsigned codes of the row-major weight
  as one little-endian bit stream (:mod:`lowbit.formats.packing`, the canonical layout);
* ``scale``: ``[out, n_groups]`` in the scale dtype (fp16 for every weight recipe);
* ``zero``: uint8 ``[out, n_groups]`` integer zero points, asymmetric formats only.

The product runs on a backend chosen per module (``backend``, see
:mod:`lowbit.kernels.dispatch`): ``"reference"`` dequantizes the whole weight in fp32
(:meth:`IntQuantized.dequantize`), casts it to the input's dtype and calls ``F.linear``; it is
the oracle for faster backends. ``"auto"`` picks per device and input.

:func:`pack_model` swaps every ``FakeQuantLinear`` that holds a quantized weight for a
``PackedLinear`` (freeing the float weight); :func:`unpack_model` goes back.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized
from lowbit.formats.packing import packed_words_per_row
from lowbit.kernels.dispatch import backend_names, packed_matmul
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module

__all__ = ["PackedLinear", "pack_model", "unpack_model", "set_backend"]

_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class PackedLinear(nn.Module):
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
            :func:`lowbit.kernels.dispatch.backend_names` (``"reference"``, ``"auto"``, ...).

    Buffers are allocated empty (zeros); :meth:`from_quantized` or ``load_state_dict`` fill them.
    """

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
        backend: str = "reference",
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
        if backend not in backend_names():
            raise LowbitError(f"unknown backend {backend!r}; choose one of {backend_names()}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.scale_dtype, self.weight_dtype = scale_dtype, weight_dtype
        self.backend = backend
        groups = 1 if group_size is None else in_features // group_size
        n_bytes = packed_words_per_row(in_features * out_features, bits)
        self.register_buffer("qdata", torch.zeros(n_bytes, dtype=torch.uint8, device=device))
        self.register_buffer(
            "scale", torch.ones(out_features, groups, dtype=scale_dtype, device=device)
        )
        zero = None if symmetric else torch.zeros(out_features, groups, dtype=torch.uint8)
        self.register_buffer("zero", None if zero is None else zero.to(device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=weight_dtype, device=device), False)
            if bias
            else None
        )
        self.input_transform = input_transform
        self.act_quantizer = act_quantizer

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
        backend: str = "reference",
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

    # -- compute --------------------------------------------------------------------------------
    def dequantize_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """[out, in] weight in ``dtype`` (default: ``weight_dtype``), decoded in fp32."""
        return self.quantized_weight.dequantize(dtype or self.weight_dtype)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.act_quantizer is not None:
            x = self.act_quantizer(x)
        return packed_matmul(self, x)  # [..., out]

    # -- accounting -----------------------------------------------------------------------------
    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features

    def storage_bits(self) -> int:
        """Exact bits of the weight with its statistics (as the container counts), plus bias."""
        bias_bits = 0 if self.bias is None else self.bias.numel() * self.bias.element_size() * 8
        return self.quantized_weight.storage_bits() + bias_bits

    def memory_bytes(self) -> int:
        """Bytes this layer's weight, statistics and bias occupy in memory (measured)."""
        tensors = [self.qdata, self.scale, self.zero, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def weight_format(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"int{self.bits} {group} {'sym' if self.symmetric else 'asym'}"

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, weight={self.weight_format()} "
            f"packed, backend={self.backend}"
        )


def pack_model(model: nn.Module) -> int:
    """Swap every ``FakeQuantLinear`` holding a quantized weight for a ``PackedLinear``, in place.

    The float weights are released; outputs are unchanged bit for bit. Returns the number of
    layers packed.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, FakeQuantLinear) and module.quantized_weight is not None
    ]
    for name, module in targets:
        packed = PackedLinear.from_quantized(
            module.quantized_weight,
            module.bias,
            input_transform=module.input_transform,
            act_quantizer=module.act_quantizer,
            weight_dtype=module.weight.dtype,
        )
        replace_module(model, name, packed.to(module.weight.device))
    return len(targets)


def unpack_model(model: nn.Module) -> int:
    """Swap every ``PackedLinear`` for the ``FakeQuantLinear`` of the same weight (the simulated
    face: float weights in memory, faster on CPU). Returns the number of layers swapped."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)]
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
    """Set the backend of every ``PackedLinear`` in ``model``; returns how many there are."""
    if backend not in backend_names():
        raise LowbitError(
            f"unknown backend {backend!r}; choose one of {', '.join(backend_names())}"
        )
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for layer in layers:
        layer.backend = backend
    return len(layers)
