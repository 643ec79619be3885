"""The integer weight format as :func:`~lowbit.algorithms.weights.quantize_linears` drives it.

:class:`IntWeightSpec` says how a weight matrix is quantized to integers (bits, groups along
the input dimension, symmetric or not, clip search, scale rule) and implements the driver's
:class:`~lowbit.algorithms.weights.WeightSpec` contract by calling RTN
(:mod:`lowbit.algorithms.rtn`) and GPTQ (:mod:`lowbit.algorithms.gptq`). It sits above both:
they take it as an argument and import neither it nor each other. The stored container is
:class:`~lowbit.formats.intq.IntQuantized`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lowbit.algorithms.gptq import GPTQSettings, gptq_quantize
from lowbit.algorithms.rtn import rtn_quantize
from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized

__all__ = ["IntWeightSpec"]


@dataclass(frozen=True)
class IntWeightSpec:
    """How a weight matrix is quantized to integers.

    Groups run along the input dimension (each output row is split into groups of
    ``group_size`` input channels); ``group_size=None`` means one scale per output channel.
    """

    bits: int
    group_size: int | None = None
    symmetric: bool = True
    mse_clip: bool = False
    scale_rule: str = "absmax"  # or "absmax_half" (symmetric only; lowbit.formats.intq)

    def check(self, weight: torch.Tensor, name: str = "weight") -> None:
        in_features = weight.shape[-1]
        if self.group_size is not None and in_features % self.group_size:
            raise LowbitError(
                f"group size {self.group_size} does not divide the input width {in_features} "
                f"of {name}"
            )

    def describe(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        kind = "sym" if self.symmetric else "asym"
        clip = ", mse-clip" if self.mse_clip else ""
        rule = "" if self.scale_rule == "absmax" else f", {self.scale_rule}"
        return f"int{self.bits} {group} {kind}{clip}{rule}"

    # -- the WeightSpec contract (lowbit.algorithms.weights) -----------------------------------
    def rtn(self, weight: torch.Tensor) -> IntQuantized:
        """Round to nearest."""
        return rtn_quantize(weight, self)

    def gptq(
        self, weight: torch.Tensor, hessian: torch.Tensor, settings: GPTQSettings
    ) -> tuple[IntQuantized, torch.Tensor, float]:
        """GPTQ with ``settings``: ``(container, dequantized weight, damp)``."""
        result = gptq_quantize(
            weight,
            hessian,
            self,
            block_size=settings.block_size,
            act_order=settings.act_order,
            damp=settings.damp,
            static_groups=settings.static_groups,
        )
        return result.quantized, result.weight, result.damp

    def guard_candidate(self, weight: torch.Tensor) -> IntQuantized:
        """RTN in the same stored format with the ``absmax`` scale rule, RTN's better one
        (see ``lowbit.recipes.linear_settings``)."""
        return rtn_quantize(weight, dataclasses.replace(self, scale_rule="absmax"))

    def matches(self, weight: IntQuantized) -> bool:
        """Whether a stored container is in this format (resumed blocks are checked)."""
        return isinstance(weight, IntQuantized) and (
            weight.bits,
            weight.group_size,
            weight.symmetric,
        ) == (self.bits, self.group_size, self.symmetric)
