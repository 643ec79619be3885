"""The packed face of a weight on a llama.cpp block grid: :class:`GGUFLinear`.

Its buffers are :class:`~lowbit.formats.gguf_blocks.GGUFQuantized`'s tensors (one code byte per
weight, fp16 scales, fp16 minimums for the affine types, int8 sub-block scales and minimums for
the K types), so a saved lowbit model keeps the
exact blocks ``lowbit export --format gguf`` writes. On the CPU it runs through the
``reference`` backend (decode, then ``F.linear``); llama.cpp is the fast path for these grids.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.formats.gguf_blocks import GGUFQuantized, block_type
from lowbit.nn.packed_linear import PackedLinearBase
from lowbit.nn.spec import register_module

__all__ = ["GGUFLinear"]


@register_module
class GGUFLinear(PackedLinearBase):
    """y = act_quantizer(input_transform(x)) @ dequantize(codes, scale, minimum)ᵀ + b.

    Args:
        in_features, out_features: the weight is ``[out_features, in_features]``.
        type_name: the llama.cpp type (Q8_0, Q5_0, Q4_0, Q5_1, Q4_1, IQ4_NL, Q6_K, Q5_K, Q4_K,
            Q3_K, Q2_K).
        (the others as :class:`~lowbit.nn.packed_linear.PackedLinear`'s)
    """

    format_kind = "gguf"
    container_type = GGUFQuantized
    format_fields = {"type_name": str}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        type_name: str,
        weight_dtype: torch.dtype = torch.float32,
        bias: bool = False,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        backend: str = "reference",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        kind = block_type(type_name)
        self._init_linear(
            in_features, out_features, weight_dtype=weight_dtype, bias=bias,
            input_transform=input_transform, act_quantizer=act_quantizer, backend=backend,
            device=device,
        )  # fmt: skip
        self.type_name = kind.name
        blocks = in_features // kind.block
        subs = in_features // kind.sub if kind.super_block else 0

        def buffer(name: str, cols: int, dtype: torch.dtype, present: bool) -> None:
            value = torch.zeros(out_features, cols, dtype=dtype, device=device)
            self.register_buffer(name, value if present else None)

        buffer("codes", in_features, torch.uint8, True)  # [out, in]
        buffer("scale", blocks, torch.float16, True)  # [out, in / block]
        buffer("minimum", blocks, torch.float16, kind.affine)  # [out, in / block]
        buffer("sub_scale", subs, torch.int8, kind.super_block)  # [out, in / sub]
        buffer("sub_min", subs, torch.int8, kind.super_block and kind.affine)  # [out, in / sub]

    @classmethod
    def from_quantized(
        cls, weight: GGUFQuantized, bias=None, *, input_transform=None, act_quantizer=None,
        weight_dtype=None, backend="reference",
    ) -> GGUFLinear:  # fmt: skip
        out_features, in_features = weight.shape
        layer = cls(
            in_features, out_features, type_name=weight.type_name,
            weight_dtype=weight_dtype or torch.float32, bias=bias is not None,
            input_transform=input_transform, act_quantizer=act_quantizer, backend=backend,
            device=weight.codes.device,
        )  # fmt: skip
        for name in ("codes", "scale", "minimum", "sub_scale", "sub_min"):
            value = getattr(weight, name)
            if value is not None:
                getattr(layer, name).copy_(value)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @property
    def quantized_weight(self) -> GGUFQuantized:
        return GGUFQuantized(
            self.type_name, self.codes, self.scale, self.minimum, self.sub_scale, self.sub_min
        )

    def format_spec(self) -> dict:
        return {"type_name": self.type_name}

    def weight_format(self) -> str:
        return f"gguf {self.type_name}"
