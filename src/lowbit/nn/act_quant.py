"""Activation quantizers: fake-quantize a linear layer's input per token at run time."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.formats.intq import fake_quant_int
from lowbit.nn.spec import Rebuildable, register_module


@register_module
class ActivationQuantizer(Rebuildable, nn.Module):
    """Per-token (or per-group along the feature axis) integer fake-quantization of inputs.

    Args:
        bits: 2-8.
        symmetric: symmetric codes around 0 (QuaRot) or asymmetric with a zero point.
        clip_ratio: scale the per-token range by this factor before rounding (QuaRot: 0.9).
        group_size: quantize groups of this many features per token; None = the whole row.
    """

    spec_fields = {"bits": int, "symmetric": bool, "clip_ratio": float, "group_size": int | None}

    def __init__(
        self,
        bits: int,
        *,
        symmetric: bool = True,
        clip_ratio: float = 1.0,
        group_size: int | None = None,
    ):
        super().__init__()
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
            raise LowbitError(f"activation bits must be an integer in 2..8, not {bits!r}")
        if (
            isinstance(clip_ratio, bool)
            or not isinstance(clip_ratio, (int, float))
            or not (0.0 < clip_ratio <= 1.0)
        ):
            raise LowbitError(f"activation clip_ratio must be in (0, 1], not {clip_ratio!r}")
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise LowbitError(
                f"activation group_size must be a positive integer, not {group_size!r}"
            )
        self.bits = bits
        self.symmetric = symmetric
        self.clip_ratio = clip_ratio
        self.group_size = group_size

    def spec(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.spec_fields}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ActivationQuantizer:
        return cls(spec["bits"], **{k: spec[k] for k in ("symmetric", "clip_ratio", "group_size")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., features]
        out = fake_quant_int(
            x.float(),
            self.bits,
            symmetric=self.symmetric,
            axis=-1,
            group_size=self.group_size,
            clip_ratio=self.clip_ratio,
        )
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        group = f", group={self.group_size}" if self.group_size else ""
        return f"bits={self.bits}, {kind}, clip={self.clip_ratio}{group}"
