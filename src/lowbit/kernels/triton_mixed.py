"""The ``triton`` backend for mixed 2/4-bit weights (:class:`~lowbit.nn.mixed_linear.MixedLinear`).

``prepare`` hands the kernels the layer's stored tensors as they are (the aligned layout is the
kernels' layout) plus the column tables of :func:`~lowbit.kernels.mixed_layout.prepare_mixed`.
``matmul`` runs :func:`~lowbit.kernels.mixed_gemv.mixed_gemv` (asynchronous dequantization,
outliers fused) for up to 16 rows, the decode path. Longer inputs (prefill) decode the weight
once from the same tensors (:func:`~lowbit.kernels.mixed_dequant.mixed_dequant`, the
reference's weight bit for bit) and call ``F.linear``: a compute-bound product whose decode is
shared by every row; so does a layer whose GEMV kernel the device refuses (warned once).

Runs on CUDA tensors, or on any tensors under ``TRITON_INTERPRET=1``; fp16 and bf16 inputs.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lowbit.kernels.dispatch import WeightBackend, register_backend
from lowbit.kernels.mixed_layout import prepare_mixed
from lowbit.kernels.triton_support import gemv_unless_refused, input_refusal

try:  # without Triton the backend stays registered and says why it cannot run (unsupported)
    from lowbit.kernels.mixed_dequant import mixed_dequant
    from lowbit.kernels.mixed_gemv import mixed_gemv
except ImportError:
    mixed_dequant = mixed_gemv = None

__all__ = ["TritonMixedBackend", "SMALL_M"]

#: largest M that takes the GEMV kernel
SMALL_M = 16


class TritonMixedBackend(WeightBackend):
    """The mixed GEMV kernel (M <= 16) and a decode-then-``F.linear`` prefill (both Triton)."""

    name = "triton"
    format_kind = "mixed"

    def unsupported(self, layer, x: Tensor) -> str | None:
        return input_refusal(x, layer.primary)

    def prepare(self, layer) -> dict:
        return prepare_mixed(layer.quantized_weight)

    def matmul(self, layer, x: Tensor, prepared: dict, bias: Tensor | None) -> Tensor:
        if x.shape[0] <= SMALL_M:  # operands built by prepare: no checks per call
            out = gemv_unless_refused(
                prepared, x, lambda: mixed_gemv(x, prepared, bias, check=False)
            )
            if out is not None:
                return out  # [M, N]
        return F.linear(x, mixed_dequant(prepared, x.dtype), bias)  # [M, N]


register_backend(TritonMixedBackend())
