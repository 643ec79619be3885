"""What every recipe setting means, in one place, and the text ``lowbit recipes`` prints.

A setting's name means the same in every recipe that has it (``w_bits`` is the weight width in
``rtn``, ``gptq`` and ``quarot``), so :data:`SETTINGS` describes each name once;
:data:`RECIPE_SETTINGS` holds the few descriptions of a name that one recipe reads differently
(``outlier_fraction`` is a share of weights in ``spqr``, of cached elements in ``kvquant``). A
test checks that every field of every registered recipe is described and that nothing here
describes a setting no recipe has.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from lowbit.recipes.base import ROLES, Recipe
from lowbit.recipes.registry import PRESETS, list_recipes
from lowbit.settings import Count

#: setting name -> one line on what it does (ranges as validate() enforces them)
SETTINGS: dict[str, str] = {
    # integer weights and activations of block linears (rtn, gptq, quarot)
    "w_bits": "weight bits, 2-8; 16 leaves them in float (with a_bits set, or in a per-layer "
    "override)",
    "w_group": "input channels per weight scale; none = one scale per output channel",
    "w_symmetric": "symmetric weights (no zero point)",
    "w_mse_clip": "search, per row or group, the clip range with the least squared error",
    "w_scale_rule": "symmetric weight scale: absmax = max|w| / (2^(b-1) - 1), absmax_half = "
    "max|w| / (2^(b-1) - 1/2); none = absmax_half under GPTQ, absmax under RTN",
    "a_bits": "activation bits at the input of every block linear, 2-8; 16 = not quantized",
    "a_symmetric": "symmetric activations (no zero point)",
    "a_clip_ratio": "share of each token's range kept before rounding, in (0, 1]; none = the "
    "method's clip at 4 bits or fewer, no clip above",
    "a_group": "features per activation scale; none = one scale per token",
    "w_algo": "how the weights are quantized: gptq (layer by layer on Hessians) or rtn "
    "(round to nearest)",
    # GPTQ (gptq, quarot, spqr, mixed)
    "act_order": "quantize columns by decreasing input energy (groups stay static)",
    "block_size": "columns per lazy GPTQ update",
    "damp": "dampening added to the Hessian's diagonal, relative to its mean (grown x10 while "
    "the Cholesky factorisation fails)",
    "guard": "per layer, keep RTN where it beats GPTQ on held-out calibration samples",
    "heldout_fraction": "share of the calibration samples the guard holds out",
    "sequential": "calibrate each block on the quantized previous blocks' outputs (false: on "
    "the float model's)",
    # rotation (rotate, quarot)
    "rotation": "how the residual stream is rotated: hadamard = randomized Hadamard, random = "
    "random orthogonal",
    "seed": "seed of the rotation's random signs or matrix",
    "online_fp16": "compute the online Hadamards in fp16 instead of fp32",
    "online": "add the online Hadamards before down_proj and o_proj (false: the residual "
    "rotation alone, a standard graph that GGUF files can hold)",
    "hadamard_block": "make the online Hadamards block-diagonal with blocks of this order (must "
    "divide the attention width and the intermediate size): each tensor-parallel shard applies "
    "its own; unset: full width",
    # learned rotation (learn-rotate)
    "learn_heads": "learn R2, one head_dim rotation per layer on values and the o_proj input, "
    "besides R1 on the residual stream",
    "steps": "training steps, one calibration piece of seqlen tokens each",
    "seqlen": "tokens per training piece, cut from the calibration samples",
    "lr": "Adam's learning rate on the rotations' Cayley parameters (Adam moves every entry "
    "about this much a step, and R1 has hidden² of them: keep it small)",
    "train_w_bits": "learn-rotate: weights in the training loop, per channel (4 for RTN "
    "weights after; 16: float, as for GPTQ)",
    "train_loss": "learn-rotate: what the loop minimises: kl, the KL divergence from the float "
    "model's next-token distribution, or ce, next-token cross-entropy (SpinQuant's)",
    "learn_clip": "learn-rotate: learn one activation clip ratio per layer and kind of point "
    "(q/k/v, gate/up, o_proj and down_proj inputs) beside the rotations, starting at "
    "a_clip_ratio, and hand them to the weight part that follows",
    "learn_scale": "learn-rotate: learn a positive scale per channel of each down_proj input "
    "beside the rotations (FlatQuant's and OSTQuant's smoothing; fused into up_proj's rows and "
    "down_proj's weight, free at inference)",
    "learn_weights": "learn-rotate: fine-tune the block linears' weights in the training loop "
    "(a correction per weight, distilled from the float model with the quantizers in the loop; "
    "fused before the rotations, free at inference; for compositions that quantize "
    "activations: with train_w_bits below 16 it measured worse)",
    "weight_lr": "learn-rotate: Adam's learning rate on the weight corrections (learn_weights)",
    "lr_schedule": "learn-rotate: constant learning rates, or cosine: each decayed to zero over "
    "the steps",
    "save_every": "steps between resume states (with a resume directory)",
    "bf16": "train with the model's matrix products in bfloat16 (CPU autocast)",
    "gguf_type": "llama.cpp file type: Q8_0, Q5_0, Q4_0, Q5_1, Q4_1, IQ4_NL, Q6_K, Q5_K_M, "
    "Q5_K_S, Q4_K_M, Q4_K_S, Q3_K_L, Q3_K_M, Q3_K_S or Q2_K; each linear gets the type "
    "llama.cpp's quantizer gives it in such a file (its mix and its fallbacks)",
    "pure": "every linear on the file type's default type (llama-quantize --pure), fallbacks "
    "for rows a 256-weight block does not divide still applied",
    # KV caches (kv-int, kivi, kvquant, quarot)
    "bits": "key and value bits, 2-8",
    "k_bits": "key bits, 2-8; 16 = keys in float",
    "v_bits": "value bits, 2-8; 16 = values in float",
    "kv_bits": "sets k_bits and v_bits when given",
    "k_group": "channels per key scale (per-token keys); none = head_dim",
    "v_group": "channels per value scale; none = head_dim",
    "clip_ratio": "share of each group's range kept, in (0, 1]; none = QuaRot's 0.95 at 4 bits "
    "or fewer, no clip above",
    "kv_clip_ratio": "share of each head's range the KV cache keeps, in (0, 1]; none = QuaRot's "
    "0.95 at 4 bits or fewer, no clip above",
    "symmetric": "symmetric KV codes (no zero point)",
    "pre_rope": "cache keys before RoPE (RoPE is applied to the dequantized keys at each step)",
    "per_channel_keys": "keys per channel over runs of key_token_group tokens (an unfinished run "
    "stays in float16)",
    "key_token_group": "tokens per per-channel key scale",
    "rotate_qk": "none, or hadamard: an online Hadamard on q and k after RoPE (QuaRot)",
    "sink_tokens": "leading tokens kept in float16 (the attention sink)",
    "group": "tokens per key scale and channels per value scale",
    "residual": "most recent tokens kept in float16",
    # kvquant
    "outlier_allocation": "how a layer's key channels share its outliers: least-error (where "
    "they cut the most Fisher-weighted error) or even (KVQuant's fixed per-channel quantiles)",
    "channel_codebooks": "a key codebook per channel instead of per layer (needs "
    "per_channel_keys; values keep one per layer)",
    "rotate_values": "code each value token in a randomized-Hadamard basis over head_dim (not "
    "in KVQuant)",
    "share_outliers": "a layer's keys and values share one outlier budget, split where the "
    "Fisher-weighted error is least (not in KVQuant)",
    "nuq": "fitted non-uniform codebooks (nuqX); false = uniform integer levels",
    "fisher": "weight the codebook fit by Fisher information; false = plain k-means",
    "calib_tokens": "calibration tokens kept per layer from the Fisher pass",
    # ksort-bfp
    "k_mantissa_bits": "key mantissa bits with sign, 2-8 (4 = BFP12); 16 = keys in float16",
    "q_mantissa_bits": "query mantissa bits, 2-8 (8 = BFP16); 16 = queries not quantized",
    "v_mantissa_bits": "value mantissa bits, 2-8; 16 = values in float16",
    "block": "channels per shared exponent along head_dim (must divide it)",
    "sort": "K-sort each head's key and query channels by the norms of W_k's rows",
    "permute_v": "sort each head's value channels by the norms of W_v's rows (needs sort and "
    "quantized values)",
    # spqr
    "beta1": "columns per first-order group (16 for the packed layout)",
    "beta2": "rows per second-order group (16 for the packed layout)",
    "stat_bits": "bits of the quantized first-order scales and zeros, 2-8 (3 for the packed "
    "layout)",
    "tau": "relative outlier threshold; none = found per layer to fill the outlier budget",
    "simplified": "find likely outliers by saliency instead of SpQR's leave-one-out test",
    "sparse_format": "stored outlier layout: csr or ptcsr",
    # mixed
    "frac_4bit": "share of each matrix's 16-channel column groups in 4 bits (the most "
    "sensitive ones), 0-1",
    "g2": "rows per second-order scale group",
    "mse_clip": "search a shrunk range per row group before the second order",
    "qat_steps": "fine-tuning steps with the format fake-quantized, before GPTQ; 0 = no QAT",
    "qat_lr": "Adam learning rate of the fine-tuning (about how far a weight moves per step)",
    "qat_seqlen": "tokens per fine-tuning sample, cut from the calibration samples",
}

#: (method, setting name) -> its description where that recipe reads the name differently
RECIPE_SETTINGS: dict[tuple[str, str], str] = {
    ("spqr", "w_bits"): "code width, 2-8 (3 for the packed layout)",
    ("spqr", "outlier_fraction"): "share of each layer's weights kept as fp16 outliers, 0-0.1",
    ("mixed", "outlier_fraction"): "share of each matrix's weights kept in fp16 (all in 2-bit "
    "groups), 0-0.05",
    ("kvquant", "outlier_fraction"): "share of the cached elements kept in fp16 "
    "(dense-and-sparse), in [0, 0.5)",
    ("kv-int", "bits"): "sets k_bits and v_bits when given",
    ("quarot", "rotation"): "how the residual stream is rotated: hadamard = randomized "
    "Hadamard, random = random orthogonal, none = not rotated (the same quantizers, unrotated)",
    ("kvquant", "bits"): "key and value bits, 2-8 (k_bits and v_bits override it per stream)",
    ("kvquant", "k_bits"): "key bits, 2-8 or 16 for float; none = bits",
    ("kvquant", "v_bits"): "value bits, 2-8 or 16 for float; none = bits",
    ("kvquant", "per_channel_keys"): "keys per channel with calibrated ranges; false = per token",
    ("kvquant", "pre_rope"): "quantize keys before RoPE (false: after, with ranges calibrated "
    "at positions drawn over the model's context)",
}


def describe_setting(method: str, name: str) -> str | None:
    """What the setting ``name`` of the recipe ``method`` does, or None when undescribed."""
    return RECIPE_SETTINGS.get((method, name), SETTINGS.get(name))


def type_name(annotation: Any) -> str:
    """A field's type as ``--set`` reads it: ``int | none``, ``csr | ptcsr``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(str(option) for option in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(option) for option in typing.get_args(annotation))
    if annotation is Count:
        return "int >= 0"
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation))


def _value(value: Any) -> str:
    """A default as ``--set`` would take it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def describe_recipe(cls: type[Recipe]) -> list[str]:
    """``lowbit recipes``' lines for one method: what it does, its paper, its roles in a
    composition, and each setting with its type, default and description."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    lines = [f"{cls.method}: {' '.join(doc.split())}"]
    if cls.paper:
        lines.append(f"    from: {cls.paper}")
    if cls.roles:
        lines.append(f"    plays: {', '.join(role for role in ROLES if role in cls.roles)}")
    types_by_name, defaults = cls.field_types(), cls()
    for field in dataclasses.fields(cls):
        default = _value(getattr(defaults, field.name))
        text = describe_setting(cls.method, field.name)
        lines.append(
            f"    {field.name} ({type_name(types_by_name[field.name])}, default {default}): {text}"
        )
    return lines


def recipes_help() -> str:
    """The text of ``lowbit recipes``: every method, then the presets, then how to compose."""
    lines = []
    for cls in list_recipes().values():
        lines += describe_recipe(cls)
    lines.append("presets:")
    for name, (method, settings) in PRESETS.items():
        lines.append(f"    {name}: {method} " + " ".join(f"{k}={v}" for k, v in settings.items()))
    lines.append(
        "compose with +, applied left to right, at most one part per role in the order "
        "rotation, weights, activations, kv: e.g. rotate+gptq+kvquant"
    )
    return "\n".join(lines)
