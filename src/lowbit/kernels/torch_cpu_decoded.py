"""The ``torch-cpu`` backend for SpQR and 2/4/16 mixed layers: the reference's weight, decoded
once.

Both formats keep groups of 16 input columns (SpQR's tiles with real-valued zeros, the mixed
format's 2-bit groups with second-order scales), which fit none of torch's packed CPU kernels
(its int4 kernel takes groups of 32 to 256 with one scale per group). So on the CPU the weight
is decoded once per layer into the input's dtype — exactly the reference backend's weight (one
rounding from fp32, columns in the original order, outliers included) — and kept beside the
packed buffers for a dense ``F.linear``. Outputs equal the reference backend's bit for bit;
the price is a dense copy in memory at run time (2 bytes per weight in bf16), the packed
buffers remain what a checkpoint stores. fp32 inputs are decoded per call instead (no fp32
copy is kept: it would be the float model's size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lowbit.kernels.dispatch import WeightBackend, register_backend

__all__ = ["TorchCPUDecodedBackend"]

_CACHED_DTYPES = (torch.bfloat16, torch.float16)


class TorchCPUDecodedBackend(WeightBackend):
    """Decode once into bf16/fp16, then BLAS; the reference's arithmetic, bit for bit."""

    name = "torch-cpu"
    #: the product is by the whole decoded weight (:func:`lowbit.nn.decoded_linear.decode_for_run`
    #: swaps such layers for that weight alone, releasing the packed buffers, for a run)
    decodes_whole_weight = True

    def unsupported(self, layer, x: Tensor) -> str | None:
        if x.device.type != "cpu":
            return f"it runs on the CPU only, and the input is on {x.device.type}"
        return None

    def matmul(self, layer, x: Tensor, prepared: dict, bias: Tensor | None) -> Tensor:
        if x.dtype not in _CACHED_DTYPES:
            return F.linear(x, layer.dequantize_weight(x.dtype), bias)
        key = f"weight:{x.dtype}"
        if key not in prepared:
            prepared[key] = layer.dequantize_weight(x.dtype)  # [N, K], original order
        return F.linear(x, prepared[key], bias)  # [M, N]


class _SpQR(TorchCPUDecodedBackend):
    format_kind = "spqr"


class _Mixed(TorchCPUDecodedBackend):
    format_kind = "mixed"


register_backend(_SpQR())
register_backend(_Mixed())
