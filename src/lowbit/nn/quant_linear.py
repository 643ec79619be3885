"""Simulated quantized linear layers (fake-quant: quantized values held in float).

A ``FakeQuantLinear`` replaces an ``nn.Linear``: its weight holds the dequantized values of a
quantized weight (so it multiplies exactly like the packed weight would), it keeps the packed
container itself (codes and statistics: for accounting, saving, and turning it into the packed
face, :mod:`lowbit.nn.packed_linear`), and it can transform and quantize its
input (online Hadamard, per-token activation quantization) before the product.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.nn.spec import Rebuildable, register_module
from lowbit.settings import dtype_from_name, dtype_name


@register_module
class FakeQuantLinear(Rebuildable, nn.Module):
    """y = quantize_act(transform(x)) @ W_dq^T + b.

    Args:
        weight: [out, in] dequantized weight (float): ``quantized_weight.dequantize()``.
        bias: [out] or None.
        quantized_weight: the weight container ``weight`` was dequantized from, in any format
            with a packed module (:class:`~lowbit.formats.intq.IntQuantized` for integers; None:
            the weight is unquantized and stored in its dtype).
        input_transform: module applied to the input first (e.g. an online Hadamard), or None.
        act_quantizer: module that fake-quantizes the input, or None.
        weight_format: short description of the weight format, for repr and reports.

    A checkpoint stores a quantized one as the packed module of its weight's format; an
    unquantized one (a float linear behind an online transform) as a ``FloatLinear`` spec.
    """

    spec_name = "FloatLinear"
    spec_fields = {"in_features": int, "out_features": int, "bias": bool, "dtype": torch.dtype}

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        quantized_weight: Any = None,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        weight_format: str = "float",
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.quantized_weight = quantized_weight
        self.input_transform = input_transform
        self.act_quantizer = act_quantizer
        self.weight_format = weight_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.act_quantizer is not None:
            x = self.act_quantizer(x)
        return F.linear(x, self.weight, self.bias)

    def storage_bits(self) -> int:
        """Exact bits to store this layer's parameters (weight with metadata, plus bias)."""
        if self.quantized_weight is None:
            weight_bits = self.weight.numel() * self.weight.element_size() * 8
        else:
            weight_bits = self.quantized_weight.storage_bits()
        bias_bits = 0 if self.bias is None else self.bias.numel() * self.bias.element_size() * 8
        return weight_bits + bias_bits

    def spec(self) -> dict[str, Any]:
        if self.quantized_weight is not None:
            raise TypeError("a quantized FakeQuantLinear is stored as its packed module")
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
            "dtype": dtype_name(self.weight.dtype),
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> FakeQuantLinear:
        dtype = dtype_from_name(spec["dtype"])
        weight = torch.zeros(spec["out_features"], spec["in_features"], dtype=dtype)
        bias = torch.zeros(spec["out_features"], dtype=dtype) if spec["bias"] else None
        return cls(weight, bias, weight_format="float")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight={self.weight_format}"


def replace_module(root: nn.Module, fqn: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule named ``fqn`` was."""
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
