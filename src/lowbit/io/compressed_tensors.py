"""Export a lowbit-quantized model as a compressed-tensors directory (what vLLM and transformers load).

compressed-tensors (PyPI ``compressed-tensors``) stores a quantized linear beside the model's
float tensors, under the linear's name. What this module writes, from lowbit's own codes (never
re-quantized):

* weight-only int 2/4/8 bits (``format: pack-quantized``): ``weight_packed`` int32
  ``[out, ceil(in * bits / 32)]``, each row a little-endian bit stream of the unsigned codes
  (``q + 2**(bits-1)`` of the signed code: element ``i`` at bits ``[i*b, (i+1)*b)``, so for 4 bits
  element ``i`` is nibble ``i % 8`` of word ``i // 8``, low nibble first); ``weight_scale``
  ``[out, groups]`` (one column per channel); ``weight_shape`` int64 ``[2]``; asymmetric:
  ``weight_zero_point`` int32 ``[ceil(out * bits / 32), groups]``, the unsigned zero points packed
  the same way down the output axis. compressed-tensors reads the signed code
  ``u - 2**(bits-1)`` and the signed zero ``z - 2**(bits-1)``, so ``(q - zp) * scale`` is lowbit's
  ``(u - z) * scale``.
* int8 per-token dynamic activations (``format: int-quantized``): ``weight`` int8 ``[out, in]``
  (signed codes), ``weight_scale`` ``[out, groups]``, asymmetric: ``weight_zero_point`` int8
  ``[out, groups]``, and ``input_activations: {num_bits: 8, strategy: token, dynamic: true,
  symmetric: true}`` in the scheme.
* every other tensor (embeddings, norms, biases, lm_head; lm_head apart when the embeddings are
  untied) as it is, and ``config.json`` with ``quantization_config``: ``quant_method:
  compressed-tensors``, ``format``, ``quantization_status: compressed``, one ``config_groups``
  entry per distinct scheme, ``ignore`` (linears left in float), ``kv_cache_scheme: null``.

* online transforms (QuaRot's Hadamards before down_proj and o_proj, after ``rotate``, ``quarot``
  or ``learn-rotate``; every offline rotation, R1/R2 and learned scale is already fused into the
  weights) as ``transform_config`` entries at the linear's ``input``: one scheme per distinct
  matrix, its matrix ``W`` stored under ``{linear}.{scheme}_input.weight`` ([b, b], b = the
  width, or the block size of a block-diagonal transform, written as the scheme's ``head_dim``).
  compressed-tensors and vLLM compute ``x @ W / sqrt(b)``, so ``W = sqrt(b) * M`` for lowbit's
  ``transform(x) = x @ M``: ±1 for a Hadamard. Type ``hadamard`` when W is Sylvester's matrix
  (vLLM's fast Hadamard kernel computes exactly that), else ``random-hadamard``: both engines
  multiply by the stored W (compressed-tensors' factory draws its own matrix, which the loader
  replaces with the stored one: :func:`lowbit.models.loader.apply_exported_transforms`; vLLM
  loads it). transformers 5.24 ignores ``transform_config`` on load, so a plain
  ``from_pretrained`` of such a directory computes a different function; lowbit's loader applies
  it with compressed-tensors' own ``apply_transform_config``.

Weight scales are written in the model's float dtype: exact for fp32 and fp16 models (lowbit's
scales are fp16 values); a bf16 model's scales are rounded to bf16.

Refused, with one sentence naming the layer and the part, before anything is written: online
transforms other than lowbit's Hadamards, activation quantizers other than int8 per-token symmetric
without clipping, double-quantized scales, weight-only widths other than 2, 4 and 8 bits (the
format's int32 layout for 3, 5, 6 and 7 bits changed between compressed-tensors versions: 0.12
packs ``32 // bits`` codes per word, 0.20 packs densely across words), and every quantized KV
cache: the format's ``kv_cache_scheme`` holds static per-tensor (or per-head) fp8/int8 scales,
while lowbit's KV quantizers (integer per token or channel, KIVI, KVQuant's codebooks with sparse
outliers, BFP) compute their statistics at run time; K-sort RoPE permutations too.

The package itself is not needed to export (only to load): tensors are written with safetensors.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lowbit.atomic import atomic_directory, check_target
from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized

__all__ = [
    "check_recipe",
    "check_saved_recipe",
    "export_compressed_tensors",
    "plan_export",
    "compressed_tensors_config",
    "export_tensors",
]

QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"
WEIGHTS_NAME = "model.safetensors"
#: where lowbit's online transforms sit: at a linear's input, applied at run time
TRANSFORM_LOCATION = "input"
#: weight-only widths whose int32 layout every compressed-tensors version reads the same way
PORTABLE_PACK_BITS = (2, 4, 8)

_KV_PARTS = {
    "int-token": "integer quantization with scales per token computed at run time",
    "int-channel": "integer quantization with per-channel scales over token groups computed at run time",
    "kivi-key": "KIVI's per-channel integer keys with run-time scales",
    "kivi-value": "KIVI's per-token integer values with run-time scales",
    "kvquant": "KVQuant's non-uniform (nuq) codebooks with sparse fp16 outliers",
    "bfp": "block floating point (BFP) with K-sort channel orders",
}


# What each method makes that the format cannot hold: refused from the recipe alone, before a
# model loads or calibrates. Methods not named here (rtn, gptq, fp, ...) are checked by their
# settings, and every model is still checked layer by layer (plan_export) before it is written.
_METHODS_NOT_HELD = {
    "spqr": "SpQR's small groups with quantized statistics and sparse fp16 outliers",
    "mixed": "2/4/16-bit mixed precision with sparse outliers",
    "kv-int": "a KV cache quantized with scales computed at run time",
    "kivi": "KIVI's KV cache with run-time scales",
    "kvquant": "KVQuant's KV cache (non-uniform codebooks with sparse fp16 outliers)",
    "ksort-bfp": "a block floating point KV cache with K-sort channel orders",
}


def check_recipe(recipe: dict[str, Any]) -> None:
    """Refuse, with one sentence, a recipe whose every result the format cannot hold.

    A cheap check of ``recipe.to_dict()`` (or the ``recipe`` a lowbit checkpoint's config
    records) that the CLI makes before loading or calibrating anything; passing it does not
    promise that a model exports (per-layer overrides, say, are checked by :func:`plan_export`).
    """
    parts = recipe.get("parts") if recipe.get("method") == "compose" else [recipe]
    for part in parts or []:
        method = part.get("method")
        settings = part.get("settings") or {}
        reason = _METHODS_NOT_HELD.get(method)
        if reason is None and method in ("rtn", "gptq", "quarot"):
            reason = _settings_not_held(settings)
        if reason is None and method == "quarot":
            reason = _quarot_cache_not_held(settings)
        if reason is not None:
            raise LowbitError(
                f"compressed-tensors cannot hold the recipe {method!r}: {reason}; it holds "
                "integer weights of 2, 4 or 8 bits (rtn, gptq, quarot), with or without int8 "
                "per-token activations, on a model rotated or not"
            )


def check_saved_recipe(directory: Path) -> None:
    """:func:`check_recipe` for a model lowbit saved, from its config.json alone (no tensor is
    read); a directory that is not a lowbit checkpoint passes (its load says what it is)."""
    from lowbit.io.format import is_lowbit_checkpoint, read_config

    if directory.is_dir() and is_lowbit_checkpoint(directory):
        recipe = read_config(directory)["quantization_config"].get("recipe")
        if isinstance(recipe, dict):
            check_recipe(recipe)


def _quarot_cache_not_held(settings: dict[str, Any]) -> str | None:
    """Why quarot's KV cache settings make a cache the format cannot hold, or None."""
    kv = settings.get("kv_bits")
    bits = (kv, kv) if kv is not None else (settings.get("k_bits", 4), settings.get("v_bits", 4))
    if bits != (16, 16):
        return (
            "a KV cache quantized with scales computed at run time (set kv_bits=16: the "
            "format's kv_cache_scheme holds static scales only)"
        )
    return None


def _settings_not_held(settings: dict[str, Any]) -> str | None:
    """Why rtn/gptq ``settings`` give linears the format cannot hold, or None."""
    a_bits, w_bits = settings.get("a_bits", 16), settings.get("w_bits")  # quarot: a_bits given
    if w_bits == 16:
        return "weights left in float (w_bits=16), so no linear holds integers"
    if a_bits == 16:
        if w_bits is not None and w_bits not in PORTABLE_PACK_BITS:
            return f"{w_bits}-bit weights without activation quantization (w_bits={w_bits})"
        return None
    if a_bits != 8:
        return f"{a_bits}-bit activations (a_bits={a_bits})"
    if not settings.get("a_symmetric", True) or settings.get("a_group") is not None:
        return "int8 activations that are asymmetric or grouped"
    if settings.get("a_clip_ratio") not in (None, 1.0):
        return f"int8 activations clipped at a_clip_ratio={settings['a_clip_ratio']}"
    return None


@dataclass(frozen=True)
class LayerScheme:
    """How one quantized linear is stored (one ``config_groups`` entry per distinct scheme)."""

    bits: int
    group_size: int | None
    symmetric: bool
    int8_tokens: bool  # int8 per-token dynamic activations at the input

    @property
    def format(self) -> str:
        return INT_FORMAT if self.int8_tokens else PACK_FORMAT

    def to_dict(self, targets: list[str]) -> dict[str, Any]:
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": "channel" if self.group_size is None else "group",
            "dynamic": False,
        }
        activations = None
        if self.int8_tokens:
            activations = {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "group_size": None,
                "strategy": "token",
                "dynamic": True,
            }
        return {
            "targets": targets,
            "weights": weights,
            "input_activations": activations,
            "output_activations": None,
            "format": self.format,
        }


@dataclass
class OnlineTransform:
    """One linear's online input transform as a compressed-tensors ``input`` transform.

    compressed-tensors (its own ``HadamardTransform``, and vLLM's) computes
    ``y = x @ (W / sqrt(b))`` on every block of ``b`` input channels (the scheme's ``head_dim``
    when ``b`` is less than the width), with ``W`` read from the checkpoint. ``W`` here is
    ``sqrt(b)`` times the matrix lowbit's transform applies (``transform(x) = x @ M``), so the
    product is lowbit's: ±1 entries for a Hadamard (exact in every float dtype).
    """

    width: int  # the linear's input width
    block: int  # b: size of each diagonal block (== width: one full transform)
    weight: Tensor  # [b, b] float64: sqrt(b) * M
    precision: torch.dtype  # dtype of the online product (QuaRot: float32)

    @property
    def type(self) -> str:
        """``hadamard`` when W is Sylvester's matrix (vLLM runs it by its Hadamard kernel,
        ignoring W); else ``random-hadamard``, which both engines apply as the dense W they read
        from the checkpoint (its factory's own random matrix is replaced by the stored one)."""
        return "hadamard" if _is_sylvester(self.weight) else "random-hadamard"

    def key(self) -> tuple:
        """Equal for transforms one scheme can hold (same matrix, blocks and precision)."""
        head_dim = None if self.block == self.width else self.block
        return (head_dim, self.block, self.precision, self.weight.numpy().tobytes())


def _is_sylvester(weight: Tensor) -> bool:
    n = weight.shape[0]
    if n & (n - 1):
        return False
    sylvester = torch.ones(1, 1, dtype=torch.float64)
    while sylvester.shape[0] < n:
        sylvester = torch.cat(
            (torch.cat((sylvester, sylvester), 1), torch.cat((sylvester, -sylvester), 1)), 0
        )
    return torch.equal(weight, sylvester)


def _online_transform(fqn: str, transform: nn.Module, width: int, dtype) -> OnlineTransform:
    """The compressed-tensors form of lowbit's online ``transform`` on ``fqn``'s input; a
    LowbitError for a transform it cannot express."""
    from lowbit.transforms.hadamard import OnlineHadamard
    from lowbit.transforms.rotate import CrossHeadHadamard

    if type(transform) is OnlineHadamard:
        block = transform.size  # the whole width, or one Hadamard per group of channels
        exact = OnlineHadamard(block)  # float64 arithmetic on a float64 input
    elif type(transform) is CrossHeadHadamard:
        block = transform.n  # A ⊗ I mixes heads: only a dense width x width matrix holds it
        exact = CrossHeadHadamard(transform.num_heads, transform.head_dim)
    else:
        raise LowbitError(
            f"cannot export {fqn} to compressed-tensors: its input goes through lowbit's "
            f"{type(transform).__name__}, which the format's transforms cannot express"
        )
    if width % block:
        raise LowbitError(f"cannot export {fqn}: its online transform does not fit its input")
    matrix = exact(torch.eye(block, dtype=torch.float64))  # [b, b]: row i = transform(e_i)
    weight = matrix * math.sqrt(block)  # [b, b]
    rounded = weight.round()
    if torch.allclose(weight, rounded, rtol=0, atol=1e-9):
        weight = rounded  # a Hadamard matrix: exactly ±1
    precision = transform.compute_dtype or dtype
    return OnlineTransform(width, block, weight, precision)


@dataclass
class ExportPlan:
    """What will be written: the scheme of every quantized linear, the float linears, the
    online transforms."""

    schemes: dict[str, LayerScheme]  # fqn -> scheme, in module order
    float_linears: list[str]  # linears kept in float (lm_head, unselected block linears)
    float_dtype: torch.dtype  # the model's float dtype; weight scales are written in it
    transforms: dict[str, OnlineTransform] = field(default_factory=dict)  # fqn -> its input's

    def transform_groups(self) -> dict[str, tuple[OnlineTransform, list[str]]]:
        """One compressed-tensors transform scheme per distinct transform: name -> (transform,
        the linears it is applied to). Names follow the linears' own name (``online_down_proj``)
        where they share one, else the transform (``online_hadamard_64``), so a checkpoint key
        reads ``model.layers.0.mlp.down_proj.online_down_proj_input.weight``."""
        by_key: dict[tuple, tuple[OnlineTransform, list[str]]] = {}
        for fqn, transform in self.transforms.items():
            by_key.setdefault(transform.key(), (transform, []))[1].append(fqn)
        groups: dict[str, tuple[OnlineTransform, list[str]]] = {}
        for transform, fqns in by_key.values():
            leaves = {fqn.rpartition(".")[2] for fqn in fqns}
            leaf = leaves.pop() if len(leaves) == 1 else f"{transform.type}_{transform.block}"
            name = base = f"online_{leaf}".replace("-", "_")
            suffix = 1
            while name in groups:
                suffix += 1
                name = f"{base}_{suffix}"
            groups[name] = (transform, fqns)
        return groups

    def transform_keys(self) -> dict[str, tuple[str, OnlineTransform]]:
        """Checkpoint key of every stored transform matrix -> (its scheme name, transform)."""
        keys = {}
        for name, (transform, fqns) in self.transform_groups().items():
            for fqn in fqns:
                keys[f"{fqn}.{name}_{TRANSFORM_LOCATION}.weight"] = (name, transform)
        return keys


def _is_int8_token_quantizer(quantizer: nn.Module) -> bool:
    from lowbit.nn.act_quant import ActivationQuantizer

    return (
        type(quantizer) is ActivationQuantizer
        and quantizer.bits == 8
        and quantizer.symmetric
        and quantizer.clip_ratio == 1.0
        and quantizer.group_size is None
    )


_CLIP_HINT = (
    " (a clip ratio of dynamic activations cannot be fused into weights: quantize with "
    "a_clip_ratio=1, and learn-rotate with learn_clip=false)"
)


def _layer_scheme(fqn: str, module: nn.Module) -> LayerScheme | None:
    """The scheme of a lowbit linear, None for a float one; a LowbitError for what the format
    cannot hold."""
    where = f"cannot export {fqn} to compressed-tensors"
    act = module.act_quantizer
    if act is not None and not _is_int8_token_quantizer(act):
        raise LowbitError(
            f"{where}: its activation quantizer ({act.extra_repr()}) is not int8 per-token "
            "symmetric without clipping, the only integer activation scheme the format holds"
            + ("" if getattr(act, "clip_ratio", 1.0) == 1.0 else _CLIP_HINT)
        )
    weight = module.quantized_weight
    if weight is None:
        if act is not None:
            raise LowbitError(f"{where}: it quantizes activations but keeps a float weight")
        return None
    if not isinstance(weight, IntQuantized):
        raise LowbitError(
            f"{where}: its weight is in lowbit's {type(weight).__name__} format, which "
            "compressed-tensors cannot express (it holds plain integer weights)"
        )
    if weight.scale_q is not None or weight.zero_dtype is not None:
        raise LowbitError(
            f"{where}: its weight has double-quantized scales or real-valued zero points"
        )
    if len(weight.shape) != 2 or weight.axis not in (-1, 1):
        raise LowbitError(f"{where}: its weight is not [out, in] with scales per output row")
    if act is None and weight.bits not in PORTABLE_PACK_BITS:
        raise LowbitError(
            f"{where}: its weight has {weight.bits}-bit codes; pack-quantized stores 2, 4 or 8 "
            "bits the same way in every compressed-tensors version (its int32 layout for other "
            "widths changed between versions)"
        )
    return LayerScheme(weight.bits, weight.group_size, weight.symmetric, act is not None)


def _check_kv(model: nn.Module) -> None:
    from lowbit.kv.attention import KVQuantAttention

    for fqn, module in model.named_modules():
        if not isinstance(module, KVQuantAttention):
            continue
        for stream in ("key", "value"):
            quantizer = getattr(module, f"{stream}_quantizer")
            if quantizer is not None:
                part = _KV_PARTS.get(quantizer.kind, f"lowbit's {quantizer.kind!r} quantizer")
                raise LowbitError(
                    f"cannot export the KV cache of {fqn} to compressed-tensors: its {stream} "
                    f"quantizer is {part}, and the format's kv_cache_scheme holds only static "
                    "per-tensor fp8/int8 scales; export the model quantized without a KV recipe"
                )
        raise LowbitError(
            f"cannot export {fqn} to compressed-tensors: it is lowbit's quantized-KV attention "
            "(rotated or quantized queries and keys), which the format cannot express"
        )


def plan_export(model: nn.Module) -> ExportPlan:
    """Check that compressed-tensors can hold ``model`` and say how; LowbitError if not."""
    from lowbit.models.adapter import adapter_for
    from lowbit.nn.act_quant import ActivationQuantizer
    from lowbit.nn.packed_linear import PackedLinearBase
    from lowbit.nn.quant_linear import FakeQuantLinear
    from lowbit.nn.run_linear import check_not_run_form

    check_not_run_form(model, "export")
    adapter = adapter_for(model)
    dtype = adapter.embed_tokens.weight.dtype
    transforms: dict[str, OnlineTransform] = {}
    schemes: dict[str, LayerScheme] = {}
    float_linears: list[str] = []
    inside: list[str] = []  # lowbit linears: their children are checked with them
    for fqn, module in model.named_modules():
        if any(fqn.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, (FakeQuantLinear, PackedLinearBase)):
            inside.append(fqn)
            if module.input_transform is not None:
                width = module.in_features
                transforms[fqn] = _online_transform(fqn, module.input_transform, width, dtype)
            scheme = _layer_scheme(fqn, module)
            if scheme is None:
                float_linears.append(fqn)
            else:
                schemes[fqn] = scheme
        elif isinstance(module, nn.Linear):
            float_linears.append(fqn)
    _check_kv(model)
    for fqn, module in model.named_modules():
        if getattr(module, "lowbit_rope_order", None) is not None:
            raise LowbitError(
                f"cannot export {fqn} to compressed-tensors: its RoPE channels are permuted "
                "(K-sort), which the format cannot express"
            )
        if any(fqn == p or fqn.startswith(p + ".") for p in inside):
            continue
        if type(module).__module__.startswith("lowbit.") and not isinstance(
            module, ActivationQuantizer
        ):
            raise LowbitError(
                f"cannot export {fqn} to compressed-tensors: it is lowbit's "
                f"{type(module).__name__}, which the format cannot express"
            )
    if not schemes:
        raise LowbitError("the model has no quantized linear: there is nothing to export")
    return ExportPlan(schemes, float_linears, dtype, transforms)


def compressed_tensors_config(plan: ExportPlan) -> dict[str, Any]:
    """The ``quantization_config`` of config.json for ``plan``."""
    distinct = list(dict.fromkeys(plan.schemes.values()))
    groups = {}
    for i, scheme in enumerate(distinct):
        if len(distinct) == 1:
            targets = ["Linear"]  # every linear not ignored
        else:
            targets = [fqn for fqn, s in plan.schemes.items() if s == scheme]
        groups[f"group_{i}"] = scheme.to_dict(targets)
    formats = {scheme.format for scheme in distinct}
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(plan.float_linears),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": transform_config(plan),
    }


def transform_config(plan: ExportPlan) -> dict[str, Any]:
    """compressed-tensors' ``transform_config`` of ``plan``: one scheme per distinct online
    transform, applied at the ``input`` of its linears (``{}`` when there is none)."""
    groups = {}
    for name, (transform, fqns) in plan.transform_groups().items():
        groups[name] = {
            "type": transform.type,
            "apply": [
                {"targets": fqns, "location": TRANSFORM_LOCATION, "inverse": False, "ignore": []}
            ],
            "randomize": False,
            "requires_grad": False,
            "head_dim": None if transform.block == transform.width else transform.block,
            "precision": str(transform.precision).removeprefix("torch."),
        }
    return {"config_groups": groups} if groups else {}


def _pack_rows(unsigned: Tensor, bits: int) -> Tensor:
    """[rows, n] unsigned codes -> [rows, ceil(n * bits / 32)] int32 (little-endian stream)."""
    from lowbit.formats.packing import pack_bits

    return pack_bits(unsigned, bits, word="int32", check_range=False)


def _linear_tensors(module: nn.Module, scheme: LayerScheme, scale_dtype) -> dict[str, Tensor]:
    """compressed-tensors' tensors of one quantized linear (local names), from lowbit's codes."""
    weight = module.quantized_weight
    bits, offset = weight.bits, 2 ** (weight.bits - 1)
    codes = weight.codes().to(torch.int16)  # [out, in]: signed (sym) or unsigned (asym)
    unsigned = codes + offset if weight.symmetric else codes  # [out, in] in [0, 2**bits)
    out = {"weight_scale": weight.scale.to(scale_dtype).contiguous()}  # [out, G], exact cast
    if scheme.format == INT_FORMAT:
        out["weight"] = (unsigned - offset).to(torch.int8)  # [out, in] signed codes
        if not weight.symmetric:
            out["weight_zero_point"] = (weight.zero.to(torch.int16) - offset).to(torch.int8)
    else:
        out["weight_packed"] = _pack_rows(unsigned, bits)  # [out, ceil(in * b / 32)]
        out["weight_shape"] = torch.tensor(tuple(weight.shape), dtype=torch.int64)  # [2]
        if not weight.symmetric:
            zero = weight.zero.to(torch.int16)  # [out, G] in [0, 2**bits)
            packed_zero = _pack_rows(zero.T, bits)  # [G, ceil(out * b / 32)]
            out["weight_zero_point"] = packed_zero.T.contiguous()  # [ceil(out * b / 32), G]
    return out


def _stored_matrix(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """A transform matrix in the model's float dtype (what vLLM loads it into) when that holds
    it exactly (±1 always), else in float32."""
    cast = weight.to(dtype)
    return cast if torch.equal(cast.to(torch.float64), weight) else weight.to(torch.float32)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(fqn for fqn, m in model.named_modules() if m is module)


def export_tensors(model: nn.Module, plan: ExportPlan) -> dict[str, Tensor]:
    """Every tensor of the exported checkpoint by key, on CPU; tied embeddings once."""
    state = model.state_dict()
    tensors: dict[str, Tensor] = {}
    quantized = {fqn: model.get_submodule(fqn) for fqn in plan.schemes}
    for key, tensor in state.items():
        owner, _, name = key.rpartition(".")
        if owner in quantized:
            if name == "bias":
                tensors[key] = tensor
            continue  # weight / packed buffers: written below
        tensors[key] = tensor
    for fqn, module in quantized.items():
        for name, tensor in _linear_tensors(module, plan.schemes[fqn], plan.float_dtype).items():
            tensors[f"{fqn}.{name}"] = tensor
    for key, (_, transform) in plan.transform_keys().items():
        tensors[key] = _stored_matrix(transform.weight, plan.float_dtype)  # [b, b]
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    from lowbit.models.adapter import adapter_for

    adapter = adapter_for(model)
    head_key = _module_name(model, adapter.lm_head) + ".weight"
    if tied:
        if not torch.equal(adapter.lm_head.weight, adapter.embed_tokens.weight):
            raise LowbitError(
                "the config ties the embeddings to lm_head, but their weights differ; "
                "set config.tie_word_embeddings = False"
            )
        del tensors[head_key]
    seen: set[tuple[int, int]] = set()
    result = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        # untied embeddings that still share memory (or other shared tensors) get their own copy
        result[key] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    return result


def _check_keys(model: nn.Module, plan: ExportPlan, tensors: dict[str, Tensor]) -> None:
    """Every float tensor the model's architecture expects is there with its shape, and nothing
    the architecture would not know (a tensor transformers or vLLM would drop or reject)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(t.shape) for k, t in skeleton.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop(_module_name(skeleton, skeleton.get_output_embeddings()) + ".weight", None)
    for fqn in plan.schemes:
        expected.pop(f"{fqn}.weight", None)
    transform_keys = plan.transform_keys()
    produced = {
        k: tuple(t.shape)
        for k, t in tensors.items()
        if (k.rpartition(".")[0] not in plan.schemes or k.endswith(".bias"))
        and k not in transform_keys
    }
    for key, shape in produced.items():
        if key not in expected:
            raise LowbitError(
                f"cannot export {key} to compressed-tensors: the model's architecture has no "
                "such tensor"
            )
        if expected[key] != shape:
            raise LowbitError(
                f"cannot export {key} to compressed-tensors: its shape {shape} is not the "
                f"architecture's {expected[key]}"
            )
    missing = sorted(set(expected) - set(produced))
    if missing:
        raise LowbitError(
            f"cannot export to compressed-tensors: the tensor {missing[0]} is missing"
        )


def export_compressed_tensors(
    model: nn.Module, out_dir: str | os.PathLike, *, tokenizer=None, force: bool = False
) -> Path:
    """Write ``model`` (quantized by lowbit, either face) as a compressed-tensors directory.

    Everything is checked before anything is written; the directory appears whole or not at all
    (written beside it under a temporary name, then renamed).

    Args:
        model: a model ``lowbit.quantize`` returned, or one loaded from a lowbit checkpoint.
        out_dir: where to write; must not exist or be empty.
        tokenizer: saved beside the model when given.
        force: replace a regular file at ``out_dir`` (:func:`lowbit.atomic.check_target`).

    Returns:
        The directory's path.

    Raises:
        LowbitError: a part of the model the format cannot express (named, with its layer), or
            a target that is not a new or empty directory.
    """
    from safetensors.torch import save_file

    from lowbit.io.checkpoint import saved_config

    check_target(out_dir, "export to", force=force)
    plan = plan_export(model)
    tensors = export_tensors(model, plan)
    _check_keys(model, plan, tensors)
    config = saved_config(model, model.dtype)
    config.pop("quantization_config", None)
    config["quantization_config"] = compressed_tensors_config(plan)
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    with atomic_directory(out_dir, verb="export to", force=force) as tmp:  # whole or not at all
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out_dir).expanduser()
