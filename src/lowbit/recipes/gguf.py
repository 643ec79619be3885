"""The ``gguf`` recipe: weights on llama.cpp's block grids, by GPTQ or RTN.

``gguf_type`` is a llama.cpp file type (``Q4_0``, ``Q4_K_M``, ...): every block linear is
quantized onto the type llama.cpp's own quantizer gives its tensor in such a file
(:mod:`lowbit.formats.gguf_mix`: the mix's rules and the fallbacks for rows a super-block does
not divide; ``pure`` for the default type everywhere), on the grids of
:mod:`lowbit.formats.gguf_blocks`, so ``lowbit export --format gguf`` writes exactly the weights
lowbit evaluated. ``rotate+gguf`` (with the rotation's ``online=false``) puts QuaRot's residual
rotation in front of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.algorithms.gguf_spec import GGUFWeightSpec
from lowbit.algorithms.weights import quantize_linears
from lowbit.errors import LowbitError
from lowbit.formats.gguf_mix import file_type, tensor_type
from lowbit.recipes.base import (
    QuantizeContext,
    Recipe,
    check_gptq_settings,
    refuse_global_overrides,
)
from lowbit.recipes.linear_settings import GPTQRecipeSettings
from lowbit.recipes.registry import register


@register
@dataclass
class GGUFRecipe(GPTQRecipeSettings, Recipe):
    """Weights on the types of a llama.cpp file type (``gguf_type``) by ``w_algo`` (gptq or
    rtn).

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them). Act-order fixes every block's grid in advance; without it GPTQ fits each block's
    grid when it reaches the block.
    """

    method = "gguf"
    roles = frozenset({"weights"})
    streams = True
    paper = "llama.cpp's block formats, calibrated by GPTQ (Frantar et al., 2023)"

    gguf_type: str = "Q4_0"
    pure: bool = False
    w_algo: str = "gptq"
    act_order: bool = True

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.w_algo == "gptq"

    def validate(self) -> None:
        if self.w_algo not in ("gptq", "rtn"):
            raise LowbitError(f"w_algo must be gptq or rtn, not {self.w_algo!r}")
        if file_type(self.gguf_type) == "F32":  # an unknown type is one sentence
            raise LowbitError("gguf_type F32 quantizes nothing; name a quantized file type")
        check_gptq_settings(self)

    def weight_spec(self, type_name: str) -> GGUFWeightSpec | None:
        """The spec of a linear llama.cpp types ``type_name`` (None: kept in float, F16)."""
        return None if type_name == "F16" else GGUFWeightSpec(type_name)

    def apply(self, model, context: QuantizeContext) -> None:
        refuse_global_overrides(self.method, context.overrides, self.gptq_setting_names())
        types = linear_types(context.adapter, self.gguf_type, self.pure)

        def spec_for(fqn: str) -> GGUFWeightSpec | None:
            recipe = context.recipe_for(self, fqn)
            if (recipe.gguf_type, recipe.pure) != (self.gguf_type, self.pure):
                types.update(linear_types(context.adapter, recipe.gguf_type, recipe.pure, fqn))
            return recipe.weight_spec(types[fqn])

        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=spec_for,
            algo=self.w_algo,
            calibration=context.calibration,
            filter_fn=context.selected,
            gptq=self.gptq_settings(),
            progress=context.progress,
            hooks=context.blocks,
            resume_dir=context.resume_dir if self.w_algo == "gptq" else None,
            recipe=context.resume_fingerprint(self),
            device=context.device,
        )


#: transformers' block linears by llama.cpp's tensor names
GGUF_LINEAR_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def linear_types(adapter, gguf_type: str, pure: bool, only: str | None = None) -> dict[str, str]:
    """``{fqn: llama.cpp type}`` of every block linear (or just ``only``) in a ``gguf_type``
    file, by llama.cpp's rules (:func:`lowbit.formats.gguf_mix.tensor_type`)."""
    n_gqa = adapter.num_heads // adapter.num_kv_heads
    layers = [(b.index, short, linear) for b in adapter.blocks() for short, linear in b.linears().items()]  # fmt: skip
    types = {}
    for fqn, (index, short, linear) in zip(adapter.linear_names(), layers, strict=True):
        if only is None or fqn == only:
            types[fqn] = tensor_type(
                gguf_type, GGUF_LINEAR_NAMES[short], layer=index, n_layers=adapter.num_layers,
                n_gqa=n_gqa, width=linear.in_features, pure=pure,
            )  # fmt: skip
    return types
