"""The ``quarot`` recipe (QuaRot, Ashkboos et al., 2024): rotate, then quantize weights,
activations and KV cache.

Steps, each done by the module that owns it:
1. :func:`lowbit.transforms.rotate.rotate_model` fuses the RMSNorm scales, unties the
   embeddings, rotates the residual stream by a seeded randomized Hadamard (or random
   orthogonal) matrix and adds the online Hadamards before down_proj and o_proj. With
   ``rotation=none`` nothing is rotated: the same quantizers on the plain model.
2. :func:`lowbit.algorithms.weights.quantize_linears` quantizes every block linear's weight
   (symmetric, per output channel or group, MSE clip search; GPTQ layer by layer with the
   RTN guard, or RTN) and attaches per-token symmetric activation quantizers (clip 0.9 at 4
   bits or fewer) at the input of every block linear (lm_head stays in float). GPTQ calibrates with float
   activations, as QuaRot does.
3. The ``kv-int`` recipe installs QuaRot's cache: asymmetric integers, one group per head,
   clip 0.95 at 4 bits or fewer, K and V bits apart, on keys rotated by an online Hadamard after RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from lowbit.algorithms.weights import quantize_linears
from lowbit.errors import LowbitError
from lowbit.recipes.base import (
    OFF_BITS,
    QuantizeContext,
    Recipe,
    check_bits,
    check_gptq_settings,
    check_seed,
    refuse_global_overrides,
)
from lowbit.recipes.kv_int import KVIntRecipe
from lowbit.recipes.linear_settings import (
    GPTQRecipeSettings,
    LinearQuantSettings,
    check_activation_groups,
)
from lowbit.recipes.registry import register
from lowbit.settings import Count
from lowbit.transforms.rotate import rotate_model


@register
@dataclass
class QuaRotRecipe(GPTQRecipeSettings, LinearQuantSettings, Recipe):
    """QuaRot: Hadamard-rotated model with integer weights, activations and KV cache.

    Settings (besides the weight/activation ones of ``rtn``, with QuaRot's defaults):
        w_algo: gptq (layer by layer, with the RTN guard) or rtn.
        kv_bits: sets k_bits and v_bits when given.
        k_bits, v_bits: KV-cache bits 2-8, 16 = off.
        kv_clip_ratio: fraction of each head's range the KV quantizer keeps.
        a_clip_ratio, kv_clip_ratio unset: the paper's 0.9 / 0.95 where a stream has 4 bits or
            fewer and no clip above, where the clip costs accuracy
            (``lowbit.recipes.base.CLIP_MAX_BITS``).
        rotation: hadamard (randomized), random (random orthogonal, paper Table 8), none.
        seed: seed of the rotation's random signs or matrix.
        online_fp16: compute the online Hadamards in fp16 instead of fp32 (paper Table 10).
        hadamard_block: block-diagonal online Hadamards of this order (tensor parallelism).
        guard, act_order, damp: GPTQ settings (see ``gptq``).
    """

    method = "quarot"
    roles = frozenset({"rotation", "weights", "activations", "kv"})
    paper = "QuaRot (Ashkboos et al., 2024)"

    # The paper's MSE-optimal clip per weight row, on by default here and off in rtn/gptq: norm
    # fusion widens each row's range, and the clip search recovers that range after rotation
    # (docs/results/quarot.md, the fusion table).
    w_mse_clip: bool = True
    a_bits: int = 4
    a_clip_ratio: float | None = None  # 0.9 (the paper's) at 4 bits or fewer, none above
    paper_a_clip = 0.9
    w_algo: Literal["gptq", "rtn"] = "gptq"
    kv_bits: int | None = None
    k_bits: int = 4
    v_bits: int = 4
    kv_clip_ratio: float | None = None  # 0.95 (the paper's) at 4 bits or fewer, none above
    rotation: Literal["hadamard", "random", "none"] = "hadamard"
    seed: Count = 0
    online_fp16: bool = False
    hadamard_block: int | None = None
    # GPTQ settings quarot does not offer (not in its saved JSON): fixed at GPTQ's defaults
    block_size: ClassVar[int] = 128
    heldout_fraction: ClassVar[float] = 0.125
    sequential: ClassVar[bool] = True

    @property
    def gptq_weights(self) -> bool:
        return self.w_algo == "gptq"

    @property
    def needs_calibration(self) -> bool:
        return self.w_algo == "gptq" and self.w_bits != OFF_BITS

    def validate(self) -> None:
        self.validate_linear_settings()
        if self.kv_bits is not None:
            check_bits("kv_bits", self.kv_bits)
        if self.w_algo not in ("gptq", "rtn"):
            raise LowbitError(f"w_algo must be gptq or rtn, not {self.w_algo!r}")
        if self.rotation not in ("hadamard", "random", "none"):
            raise LowbitError(f"rotation must be hadamard, random or none, not {self.rotation!r}")
        check_gptq_settings(self)
        check_seed("seed", self.seed)
        self.kv_recipe().validate()

    def played_roles(self) -> frozenset[str]:
        """Without its rotation or its cache (``rotation=none``, k and v at 16 bits) quarot
        leaves that role to another part: ``quarot-w4a16+kivi``."""
        roles = set(self.roles)
        if self.rotation == "none":
            roles.discard("rotation")
        if not self._installs_kv():
            roles.discard("kv")
        return frozenset(roles)

    def nothing_to_do(self) -> str | None:
        quantizes = self.w_bits != OFF_BITS or self.a_bits != OFF_BITS or self._installs_kv()
        if self.rotation == "none" and not quantizes:
            return "rotation=none with weights, activations and KV cache at 16 bits"
        return None

    def _installs_kv(self) -> bool:
        kv = self.kv_recipe()
        return kv.key_bits() != OFF_BITS or kv.value_bits() != OFF_BITS

    def kv_recipe(self) -> KVIntRecipe:
        """QuaRot's cache as a ``kv-int`` recipe."""
        return KVIntRecipe(
            bits=self.kv_bits,
            k_bits=self.k_bits,
            v_bits=self.v_bits,
            clip_ratio=self.kv_clip_ratio,
            symmetric=False,
            rotate_qk="none" if self.rotation == "none" else "hadamard",
        )

    def apply(self, model, context: QuantizeContext) -> None:
        refuse_global_overrides(self.method, context.overrides, self.gptq_setting_names())
        check_activation_groups(model, context, self)
        if self.rotation != "none":
            rotate_model(
                model,
                rotation=self.rotation,
                seed=self.seed,
                online_dtype=torch.float16 if self.online_fp16 else torch.float32,
                hadamard_block=self.hadamard_block,
            )
            context.transformed(model)
        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=lambda fqn: context.recipe_for(self, fqn).weight_spec(),
            algo=self.w_algo if self.w_bits != OFF_BITS else "rtn",
            calibration=context.calibration,
            act_quantizer_for=lambda fqn: context.recipe_for(self, fqn).act_quantizer(),
            filter_fn=context.selected,
            gptq=self.gptq_settings(),
            progress=context.progress,
            resume_dir=context.resume_dir,
            recipe=context.resume_fingerprint(self),
            device=context.device,
        )
        if self._installs_kv():
            self.kv_recipe().apply(model, context)

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        if not self._installs_kv():
            return None
        return self.kv_recipe().kv_bytes_per_token(adapter, context_length)
