"""What the three Triton backends (integer, SpQR, 2/4/16) share: whether Triton is importable
and running in its interpreter, and which inputs their kernels take.

Triton is optional (``pip install 'lowbit[triton]'``): without it this module still imports and
the backends refuse every layer with a sentence instead of failing at import.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # the backends explain themselves in unsupported()
    triton = None

__all__ = ["interpreting", "input_refusal", "triton"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def input_refusal(x: Tensor, weight: Tensor) -> str | None:
    """Why a Triton kernel cannot multiply ``x`` by a weight stored in ``weight`` (a sentence
    completing "the triton backend cannot run this layer: ..."), or None when it can."""
    if triton is None:
        return "Triton is not installed (pip install 'lowbit[triton]')"
    if x.device.type != "cuda" and not interpreting():
        return (
            f"its kernels need a CUDA device (or TRITON_INTERPRET=1), and the input is "
            f"on {x.device.type}"
        )
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"its kernels take fp16 or bf16 inputs, not {x.dtype}"
    if weight.device != x.device:
        return f"the weight is on {weight.device} and the input on {x.device}"
    return None
