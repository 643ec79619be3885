"""Packed layers without a CPU kernel, decoded once for a run in place of their packed buffers.

SpQR's and the 2/4/16 format's groups of 16 input columns fit none of torch's packed CPU
kernels, so on the CPU their product is a dense ``F.linear`` by the decoded weight (the
``torch-cpu`` backend of :mod:`lowbit.kernels.torch_cpu_decoded`). Kept beside the packed
buffers, that copy makes the layer larger than the bf16 model's. :func:`decode_for_run` swaps
each such layer for a :class:`DecodedLinear`: the same weight, decoded once in the run's dtype
(bit for bit the backend's), with the packed buffers released. The layer still counts the bits
its format stores; it cannot be saved or exported (its packed form is gone): load the checkpoint
again for that.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.kernels.dispatch import get_backend
from lowbit.nn.packed_linear import PackedLinearBase
from lowbit.nn.quant_linear import replace_module

__all__ = ["DecodedLinear", "decode_for_run", "decodes_on_the_cpu", "check_not_decoded"]


class DecodedLinear(nn.Module):
    """y = act_quantizer(input_transform(x)) @ Wᵀ + b, W a packed layer's weight decoded once.

    Args:
        packed: the packed layer it replaces (its weight is decoded in ``dtype``; its bias,
            input transform and activation quantizer are taken over).
        dtype: the dtype the run computes in (bf16 or fp16; the weight's one rounding from
            fp32, as the reference backend rounds it).
    """

    def __init__(self, packed: PackedLinearBase, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.weight = nn.Parameter(packed.dequantize_weight(dtype), requires_grad=False)  # [N, K]
        self.bias = packed.bias
        self.input_transform = packed.input_transform
        self.act_quantizer = packed.act_quantizer
        self.packed_storage_bits = packed.storage_bits()  # what its checkpoint stores
        self.packed_format = packed.weight_format()

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.act_quantizer is not None:
            x = self.act_quantizer(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def storage_bits(self) -> int:
        """The bits the packed layer stores (weight with statistics, plus bias)."""
        return self.packed_storage_bits

    def spec(self) -> dict[str, Any]:
        raise LowbitError(
            f"a layer decoded for the run ({self.packed_format}) has released its packed "
            "weight; load the checkpoint again to save or export it"
        )

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, weight={self.packed_format} "
            f"decoded to {str(self.weight.dtype).removeprefix('torch.')}"
        )


def decodes_on_the_cpu(layer: PackedLinearBase) -> bool:
    """Whether ``torch-cpu`` multiplies this layer's format by its whole decoded weight."""
    try:
        backend = get_backend("torch-cpu", layer.format_kind)
    except LowbitError:
        return False
    return getattr(backend, "decodes_whole_weight", False)


def decode_for_run(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Swap every packed layer that the CPU runs from its decoded weight (SpQR, 2/4/16) for a
    :class:`DecodedLinear` in ``dtype`` (None: the model's), releasing its packed buffers.

    Only for bf16 and fp16 runs on the CPU with the ``auto`` or ``torch-cpu`` backend (an fp32
    run decodes per call and keeps no copy). Returns the number of layers swapped.
    """
    dtype = dtype or model.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, PackedLinearBase)
        and module.backend in ("auto", "torch-cpu")
        and all(b.device.type == "cpu" for b in module.buffers())
        and decodes_on_the_cpu(module)
    ]
    for name, module in targets:
        replace_module(model, name, DecodedLinear(module, dtype))
    return len(targets)


def check_not_decoded(model: nn.Module, verb: str) -> None:
    """Refuse, with one sentence, to ``verb`` a model that holds layers decoded for a run."""
    for name, module in model.named_modules():
        if isinstance(module, DecodedLinear):
            raise LowbitError(
                f"cannot {verb} this model: {name} ({module.packed_format}) was decoded for "
                "the run and its packed weight released; load the checkpoint again"
            )
