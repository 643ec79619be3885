"""KIVI-style KV quantization (Liu et al., 2024), as lowbit quantizers.

Keys are quantized per channel over groups of ``group`` consecutive tokens (after RoPE), values
per token in groups of ``group`` channels; both asymmetric min-max with fp16 scale and minimum
(``x ~ q * scale + min``). The most recent ``residual`` tokens stay in floating point: that is
the cache's ``fp_window`` (the ``kivi`` recipe sets it), so keys leave the fp window in whole
groups of ``group`` tokens, values token by token once ``residual`` newer ones exist. The value
group must divide head_dim.
"""

from __future__ import annotations

from typing import Any

from lowbit.kv.int_quant import IntChannelQuantizer, IntTokenQuantizer
from lowbit.kv.quantizer import register_kv_quantizer

__all__ = ["KIVIKeyQuantizer", "KIVIValueQuantizer", "KIVI_RESIDUAL"]

KIVI_RESIDUAL = 128  # the paper's full-precision window (tokens)


@register_kv_quantizer
class KIVIKeyQuantizer(IntChannelQuantizer):
    """Per-channel keys over ``group`` tokens, min-max with fp16 scale and minimum."""

    kind = "kivi-key"

    def __init__(self, bits: int = 2, group: int = 32) -> None:
        super().__init__(bits, token_group=group, symmetric=False, clip_ratio=1.0, zero="fp16")

    def settings(self) -> dict[str, Any]:
        return dict(bits=self.bits, group=self.token_group)


@register_kv_quantizer
class KIVIValueQuantizer(IntTokenQuantizer):
    """Per-token values in groups of ``group`` channels, min-max with fp16 scale and minimum."""

    kind = "kivi-value"

    def __init__(self, bits: int = 2, group: int = 32) -> None:
        super().__init__(bits, group_size=group, symmetric=False, clip_ratio=1.0, zero="fp16")

    def settings(self) -> dict[str, Any]:
        return dict(bits=self.bits, group=self.group_size)
