"""Settings shared by the recipes that quantize block linears: integer weights and
activations (:class:`LinearQuantSettings`), and GPTQ's (:class:`GPTQRecipeSettings`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lowbit.algorithms.gptq import GPTQSettings
from lowbit.algorithms.int_spec import IntWeightSpec
from lowbit.errors import LowbitError
from lowbit.nn.act_quant import ActivationQuantizer
from lowbit.recipes.base import (
    OFF_BITS,
    QuantizeContext,
    check_bits,
    check_clip,
    check_group,
    resolve_clip,
)


@dataclass
class LinearQuantSettings:
    """Integer weights per output channel or group, per-token integer activations.

    Settings:
        w_bits: weight bits 2-8, 16 = weights not quantized.
        w_group: input channels per weight scale; none = one scale per output channel.
        w_symmetric: symmetric weights (no zero point).
        w_mse_clip: search the clip range per row/group that minimises the squared error.
        w_scale_rule: symmetric weight scale: ``absmax`` (``max|w| / (2**(b-1) - 1)``, QuaRot's
            code) or ``absmax_half`` (``max|w| / (2**(b-1) - 1/2)``, a finer step whose ends
            clamp half a step, as GPTQ's and llm-compressor's code do; see
            ``lowbit.formats.intq``); none = ``absmax_half`` for GPTQ weights, ``absmax`` for
            RTN. GPTQ's error feedback absorbs the clamped ends, so the finer step helps it;
            under RTN nothing absorbs them and the finer step loses (docs/results/gptq.md).
        a_bits: activation bits 2-8 at the input of every block linear, 16 = off.
        a_symmetric: symmetric activations.
        a_clip_ratio: scale each token's range by this before rounding; none = the recipe's
            ``paper_a_clip`` up to 4 bits, no clip above (see ``resolve_clip``).
        a_group: features per activation scale; none = one scale per token.
    """

    w_bits: int = 4
    w_group: int | None = None
    w_symmetric: bool = True
    w_mse_clip: bool = False
    w_scale_rule: str | None = None
    a_bits: int = OFF_BITS
    a_symmetric: bool = True
    a_clip_ratio: float | None = 1.0
    a_group: int | None = None

    #: the clip an unset ``a_clip_ratio`` takes at 4 bits or fewer (not a setting)
    paper_a_clip = 1.0

    @property
    def gptq_weights(self) -> bool:
        """Whether the weights are quantized by GPTQ (sets the unset ``w_scale_rule``)."""
        return False

    def validate_linear_settings(self) -> None:
        check_bits("w_bits", self.w_bits)
        check_bits("a_bits", self.a_bits)
        check_group("w_group", self.w_group)
        check_group("a_group", self.a_group)
        check_clip("a_clip_ratio", self.a_clip_ratio)
        if self.w_scale_rule not in (None, "absmax", "absmax_half"):
            raise LowbitError(
                f"w_scale_rule must be 'absmax' or 'absmax_half', not {self.w_scale_rule!r}"
            )
        if self.w_scale_rule == "absmax_half" and not self.w_symmetric:
            raise LowbitError("w_scale_rule=absmax_half needs symmetric weights")

    def weight_spec(self) -> IntWeightSpec | None:
        if self.w_bits == OFF_BITS:
            return None
        rule = self.w_scale_rule
        if rule is None:
            rule = "absmax_half" if self.gptq_weights and self.w_symmetric else "absmax"
        return IntWeightSpec(self.w_bits, self.w_group, self.w_symmetric, self.w_mse_clip, rule)

    def act_quantizer(self) -> ActivationQuantizer | None:
        if self.a_bits == OFF_BITS:
            return None
        return ActivationQuantizer(
            self.a_bits,
            symmetric=self.a_symmetric,
            clip_ratio=resolve_clip(self.a_clip_ratio, self.a_bits, self.paper_a_clip),
            group_size=self.a_group,
        )


@dataclass
class GPTQRecipeSettings:
    """GPTQ's settings, for a recipe whose weights are calibrated with GPTQ; :meth:`gptq_settings`
    hands them to :func:`~lowbit.algorithms.weights.quantize_linears`.

    The settings (act_order, block_size, damp, guard, heldout_fraction, sequential) are
    described in :mod:`lowbit.recipes.settings_help`. A recipe that does not offer one of them fixes it as a class constant instead, e.g.
    ``block_size: ClassVar[int] = 128``: it is then not a setting (not in ``to_dict()``, no
    ``--set``), and :meth:`gptq_settings` reads the constant. A recipe changes a default by
    declaring the field again (``guard: bool = False``).
    """

    act_order: bool = True
    block_size: int = 128
    damp: float = 0.01
    guard: bool = True
    heldout_fraction: float = 0.125
    sequential: bool = True

    def gptq_settings(self) -> GPTQSettings:
        """These settings as the weight driver takes them (one LowbitError sentence when one
        is out of range)."""
        return GPTQSettings(
            act_order=self.act_order,
            block_size=self.block_size,
            damp=self.damp,
            guard=self.guard,
            heldout_fraction=self.heldout_fraction,
            sequential=self.sequential,
        )

    @classmethod
    def gptq_setting_names(cls) -> tuple[str, ...]:
        """The GPTQ settings this recipe offers; they apply to the whole calibration run, so
        per-layer overrides may not set them."""
        offered = {f.name for f in dataclasses.fields(cls)}
        return tuple(f.name for f in dataclasses.fields(GPTQRecipeSettings) if f.name in offered)


def check_activation_groups(model, context: QuantizeContext, recipe) -> None:
    """Fail before any work when an activation group does not divide a layer's input width."""
    for fqn in context.adapter.linear_names():
        layer_recipe = context.recipe_for(recipe, fqn)
        width = model.get_submodule(fqn).in_features
        if (
            layer_recipe.a_bits != OFF_BITS
            and layer_recipe.a_group
            and width % layer_recipe.a_group
        ):
            raise LowbitError(
                f"a_group {layer_recipe.a_group} does not divide the input width {width} of {fqn}"
            )
