"""The ``triton`` backend for mixed 2/4-bit weights (:class:`~lowbit.nn.mixed_linear.MixedLinear`).

``prepare`` hands the kernels the layer's stored tensors as they are (the aligned layout is the
kernels' layout) plus the column tables of :func:`~lowbit.kernels.mixed_layout.prepare_mixed`.
``matmul`` runs :func:`~lowbit.kernels.mixed_gemv.mixed_gemv` (asynchronous dequantization,
outliers fused) for up to 16 rows, the decode path. Longer inputs (prefill) decode the weight
once in fp32 from the same tensors and call ``F.linear``: a compute-bound product whose decode
is shared by every row.

Runs on CUDA tensors, or on any tensors under ``TRITON_INTERPRET=1``; fp16 and bf16 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lowbit.kernels.dispatch import WeightBackend, register_backend
from lowbit.kernels.mixed_layout import prepare_mixed

try:
    import triton
except ImportError:  # the backend explains itself in unsupported()
    triton = None

__all__ = ["TritonMixedBackend", "SMALL_M"]

#: largest M that takes the GEMV kernel
SMALL_M = 16


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


class TritonMixedBackend(WeightBackend):
    """The mixed GEMV kernel (M <= 16) and a decode-then-``F.linear`` prefill."""

    name = "triton"
    format_kind = "mixed"

    def unsupported(self, layer, x: Tensor) -> str | None:
        if triton is None:
            return "Triton is not installed (pip install 'lowbit[triton]')"
        if x.device.type != "cuda" and not _interpreting():
            return (
                f"its kernels need a CUDA device (or TRITON_INTERPRET=1), and the input is "
                f"on {x.device.type}"
            )
        if x.dtype not in (torch.float16, torch.bfloat16):
            return f"its kernels take fp16 or bf16 inputs, not {x.dtype}"
        if layer.primary.device != x.device:
            return f"the weight is on {layer.primary.device} and the input on {x.device}"
        return None

    def prepare(self, layer) -> dict:
        return prepare_mixed(layer.quantized_weight)

    def matmul(self, layer, x: Tensor, prepared: dict, bias: Tensor | None) -> Tensor:
        if x.shape[0] <= SMALL_M:
            from lowbit.kernels.mixed_gemv import mixed_gemv

            return mixed_gemv(x, prepared, bias)  # [M, N]
        return F.linear(x, layer.dequantize_weight(x.dtype), bias)


register_backend(TritonMixedBackend())
