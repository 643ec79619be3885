"""The ``gptq`` recipe: GPTQ integer weights (no rotation), optional per-token activations.

Weights are calibrated layer by layer (:func:`lowbit.algorithms.weights.quantize_linears`);
with ``guard`` each layer keeps whichever of GPTQ and RTN has the smaller output error on
held-out calibration samples. Fake-quantized like ``rtn``: weights hold their dequantized
values, their packed storage is recorded exactly. The per-layer choices are left on the model
as ``model.lowbit_weight_report`` (a :class:`~lowbit.algorithms.weights.WeightQuantReport`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.algorithms.rtn import IntWeightSpec
from lowbit.algorithms.weights import GPTQOptions, quantize_linears
from lowbit.errors import LowbitError
from lowbit.nn.act_quant import ActivationQuantizer
from lowbit.recipes.base import OFF_BITS, QuantizeContext, Recipe, check_bits, check_group
from lowbit.recipes.registry import register

# settings that apply to the whole calibration run and cannot differ per layer
_GLOBAL_SETTINGS = ("act_order", "block_size", "damp", "guard", "heldout_fraction", "sequential")


@register
@dataclass
class GPTQRecipe(Recipe):
    """GPTQ weights (per output channel or per group) and per-token activations.

    Settings:
        w_bits: weight bits 2-8, 16 = weights not quantized.
        w_group: input channels per weight scale; none = one scale per output channel.
        w_symmetric: symmetric weights (no zero point).
        w_mse_clip: search the clip range per row/group that minimises the squared error.
        act_order: quantize columns by decreasing input energy (groups stay static, so the
            format is a plain grouped one).
        block_size: columns per lazy GPTQ update.
        damp: dampening added to the Hessian's diagonal, relative to its mean (grown x10
            while the Cholesky factorisation fails).
        guard: per layer, keep RTN where it beats GPTQ on held-out calibration samples.
        heldout_fraction: share of the calibration samples the guard holds out.
        sequential: calibrate each block on the quantized previous blocks' outputs (two
            passes per block); false: on the float model's (one pass per block).
        a_bits: activation bits 2-8 at the input of every block linear, 16 = off.
        a_symmetric, a_clip_ratio, a_group: activation format, as in ``rtn``.
    """

    method = "gptq"
    needs_calibration = True

    w_bits: int = 4
    w_group: int | None = None
    w_symmetric: bool = True
    w_mse_clip: bool = False
    act_order: bool = True
    block_size: int = 128
    damp: float = 0.01
    guard: bool = True
    heldout_fraction: float = 0.125
    sequential: bool = True
    a_bits: int = OFF_BITS
    a_symmetric: bool = True
    a_clip_ratio: float = 1.0
    a_group: int | None = None

    def validate(self) -> None:
        check_bits("w_bits", self.w_bits)
        check_bits("a_bits", self.a_bits)
        check_group("w_group", self.w_group)
        check_group("a_group", self.a_group)
        if isinstance(self.block_size, bool) or self.block_size < 1:
            raise LowbitError(f"block_size must be a positive integer, not {self.block_size!r}")
        if not 0.0 < self.damp < 1.0:
            raise LowbitError(f"damp must be in (0, 1), not {self.damp}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise LowbitError(f"heldout_fraction must be in (0, 1), not {self.heldout_fraction}")
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
        for values in context.overrides.values():
            fixed = sorted(set(values) & set(_GLOBAL_SETTINGS))
            if fixed:
                raise LowbitError(
                    f"gptq settings {', '.join(fixed)} apply to the whole model and cannot be "
                    "overridden per layer"
                )

        for fqn in context.adapter.linear_names():  # fail before the long calibration
            recipe = context.recipe_for(self, fqn)
            width = model.get_submodule(fqn).in_features
            if recipe.a_bits != OFF_BITS and recipe.a_group and width % recipe.a_group:
                raise LowbitError(
                    f"a_group {recipe.a_group} does not divide the input width {width} of {fqn}"
                )

        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=lambda fqn: context.recipe_for(self, fqn).weight_spec(),
            algo="gptq",
            calibration=context.calibration,
            act_quantizer_for=lambda fqn: context.recipe_for(self, fqn).act_quantizer(),
            guard=self.guard,
            heldout_fraction=self.heldout_fraction,
            includes=context.selected,
            gptq=GPTQOptions(self.block_size, self.act_order, self.damp),
            sequential=self.sequential,
            progress=context.progress,
        )
