"""The ``rtn`` recipe: round-to-nearest integer weights and per-token integer activations.

Fake-quantized (simulated): weights hold their dequantized values; the storage they would take
packed is recorded exactly for the bits accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from lowbit.algorithms.rtn import IntWeightSpec, rtn_quantize
from lowbit.errors import LowbitError
from lowbit.nn.act_quant import ActivationQuantizer
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module
from lowbit.recipes.base import OFF_BITS, QuantizeContext, Recipe, check_bits, check_group
from lowbit.recipes.registry import register


@register
@dataclass
class RTNRecipe(Recipe):
    """Round-to-nearest weights (per output channel or per group) and per-token activations.

    Settings:
        w_bits: weight bits 2-8, 16 = weights not quantized.
        w_group: input channels per weight scale; none = one scale per output channel.
        w_symmetric: symmetric weights (no zero point).
        w_mse_clip: search the clip range per row/group that minimises the squared error.
        a_bits: activation bits 2-8 at the input of every block linear, 16 = off.
        a_symmetric: symmetric activations.
        a_clip_ratio: scale each token's range by this before rounding.
        a_group: features per activation scale; none = one scale per token.
    """

    method = "rtn"

    w_bits: int = 4
    w_group: int | None = None
    w_symmetric: bool = True
    w_mse_clip: bool = False
    a_bits: int = OFF_BITS
    a_symmetric: bool = True
    a_clip_ratio: float = 1.0
    a_group: int | None = None

    def validate(self) -> None:
        check_bits("w_bits", self.w_bits)
        check_bits("a_bits", self.a_bits)
        check_group("w_group", self.w_group)
        check_group("a_group", self.a_group)
        if not 0.0 < self.a_clip_ratio <= 1.0:
            raise LowbitError(f"a_clip_ratio must be in (0, 1], not {self.a_clip_ratio}")

    def weight_spec(self) -> IntWeightSpec | None:
        if self.w_bits == OFF_BITS:
            return None
        return IntWeightSpec(self.w_bits, self.w_group, self.w_symmetric, self.w_mse_clip)

    def act_quantizer(self) -> ActivationQuantizer | None:
        if self.a_bits == OFF_BITS:
            return None
        return ActivationQuantizer(
            self.a_bits,
            symmetric=self.a_symmetric,
            clip_ratio=self.a_clip_ratio,
            group_size=self.a_group,
        )

    def apply(self, model, context: QuantizeContext) -> None:
        names = [
            n for n in context.adapter.linear_names() if context.selected(n, model.get_submodule(n))
        ]
        for fqn in tqdm(names, desc="rtn", disable=not context.progress, leave=False):
            recipe = context.recipe_for(self, fqn)
            linear = model.get_submodule(fqn)
            replace_module(model, fqn, recipe.quantized_linear(linear, fqn))

    def quantized_linear(self, linear, fqn: str) -> FakeQuantLinear:
        """The fake-quantized replacement of one linear layer."""
        spec = self.weight_spec()
        if self.a_group is not None and linear.in_features % self.a_group:
            raise LowbitError(
                f"a_group {self.a_group} does not divide the input width {linear.in_features} of {fqn}"
            )
        if spec is None:
            weight, bits, fmt = linear.weight.detach(), None, "float"
        else:
            spec.check(linear.weight, fqn)
            packed = rtn_quantize(linear.weight, spec)
            weight = packed.dequantize().to(linear.weight.dtype)
            bits, fmt = packed.storage_bits(), spec.describe()
        return FakeQuantLinear(
            weight,
            linear.bias,
            weight_storage_bits=bits,
            act_quantizer=self.act_quantizer(),
            weight_format=fmt,
        )
