"""What the three Triton backends (integer, SpQR, 2/4/16) share: whether Triton is importable
and running in its interpreter, which inputs their kernels take, how a launch configuration is
chosen on the GPU, and the interpreter's bf16 rounding.

Triton is optional (``pip install 'lowbit[triton]'``): without it this module still imports and
the backends refuse every layer with a sentence instead of failing at import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # the backends explain themselves in unsupported()
    triton = None

__all__ = ["fastest_config", "interpreting", "input_refusal", "round_bf16", "triton"]

Config = TypeVar("Config")


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


def fastest_config(launch: Callable[[Config], object], configs: Sequence[Config]) -> Config:
    """The configuration with the smallest ``triton.testing.do_bench`` time of ``launch(config)``
    (the whole call); one the compiler rejects (registers, shared memory) is skipped."""
    import triton.testing

    best, best_ms = configs[0], float("inf")
    for config in configs:
        try:
            ms = triton.testing.do_bench(lambda c=config: launch(c), warmup=5, rep=20)
        except Exception:  # noqa: BLE001 - any compile or launch failure rules the config out
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return best


if triton is not None:
    import triton.language as tl

    @triton.jit
    def round_bf16(v):
        """fp32 -> fp32 holding the nearest bf16, ties to even (the interpreter's casts to bf16
        truncate; on the GPU ``.to(tl.bfloat16)`` rounds correctly and this is not used)."""
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
