"""lowbit's runtime modules as JSON specs, and back: what a checkpoint needs to rebuild a model.

A spec is a small JSON dict (``{"class": name, ...settings}``) from which an empty module of the
right structure is built: buffers and parameters of the right shape and dtype, filled later by
the checkpoint's tensors. Derived state (Hadamard factors, RoPE tables, token rotations) is
recomputed by the constructor, never stored. A quantized ``FakeQuantLinear`` is saved as the
packed module of its weight's format (``PackedLinear`` for integers; the canonical stored form);
an unquantized one (a float linear behind an online transform) keeps its float weight. Packed
formats bring their own spec (:class:`~lowbit.nn.packed_linear.PackedLinearBase`).

KV quantizers have their own ``to_dict`` / :func:`~lowbit.kv.quantizer.kv_quantizer_from_dict`
and are handled with the cache layout in :mod:`lowbit.io.checkpoint`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.kv.bfp_quant import BFPQueryQuantizer
from lowbit.nn.act_quant import ActivationQuantizer
from lowbit.nn.packed_linear import (
    NonNegative,
    PackedLinearBase,
    dtype_from_name,
    dtype_name,
    packed_format_for,
    packed_formats,
)
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.transforms.hadamard import OnlineHadamard
from lowbit.transforms.rotate import CrossHeadHadamard

__all__ = ["module_spec", "build_module", "dtype_name", "dtype_from_name", "SPEC_CLASSES"]


def _linear_spec(module: nn.Module) -> dict[str, Any]:
    if isinstance(module, PackedLinearBase):
        return {"class": type(module).__name__, **module.spec(), "backend": module.backend}
    weight = module.quantized_weight
    if weight is not None:  # stored as the packed module of the same weight
        packed = packed_format_for(weight).from_quantized(
            weight, module.bias, weight_dtype=module.weight.dtype
        )
        return {"class": type(packed).__name__, **packed.spec()}
    return {
        "class": "FloatLinear",
        "in_features": module.in_features,
        "out_features": module.out_features,
        "bias": module.bias is not None,
        "dtype": dtype_name(module.weight.dtype),
    }


def module_spec(module: nn.Module) -> dict[str, Any] | None:
    """The spec of a lowbit runtime module, or None for a module lowbit did not put there."""
    if isinstance(module, (PackedLinearBase, FakeQuantLinear)):
        return _linear_spec(module)
    if isinstance(module, OnlineHadamard):
        group = None if module.size == module.n else module.size
        return {
            "class": "OnlineHadamard",
            "n": module.n,
            "group_size": group,
            "compute_dtype": dtype_name(module.compute_dtype),
        }
    if isinstance(module, CrossHeadHadamard):
        return {
            "class": "CrossHeadHadamard",
            "num_heads": module.num_heads,
            "head_dim": module.head_dim,
            "compute_dtype": dtype_name(module.compute_dtype),
        }
    if isinstance(module, ActivationQuantizer):
        return {
            "class": "ActivationQuantizer",
            "bits": module.bits,
            "symmetric": module.symmetric,
            "clip_ratio": module.clip_ratio,
            "group_size": module.group_size,
        }
    if isinstance(module, BFPQueryQuantizer):
        order = module.order
        return {
            "class": "BFPQueryQuantizer",
            "mantissa_bits": module.mantissa_bits,
            "block": module.block,
            "head_dim": module.head_dim,
            "order_shape": None if order is None else list(order.shape),  # [H_kv, D]
        }
    return None


def _build_float(spec: dict[str, Any]) -> nn.Module:
    dtype = dtype_from_name(spec["dtype"])
    weight = torch.zeros(spec["out_features"], spec["in_features"], dtype=dtype)
    bias = torch.zeros(spec["out_features"], dtype=dtype) if spec["bias"] else None
    return FakeQuantLinear(weight, bias, weight_format="float")


def _build_query(spec: dict[str, Any]) -> nn.Module:
    shape = spec["order_shape"]
    if shape is not None and (
        len(shape) != 2 or not all(isinstance(n, int) and n > 0 for n in shape)
    ):
        raise LowbitError(f"the checkpoint's BFPQueryQuantizer has a bad order shape {shape!r}")
    order = None if shape is None else torch.zeros(shape, dtype=torch.long)
    return BFPQueryQuantizer(spec["mantissa_bits"], spec["block"], spec["head_dim"], order)


SPEC_CLASSES = {
    "FloatLinear": _build_float,
    "OnlineHadamard": lambda s: OnlineHadamard(
        s["n"], group_size=s["group_size"], compute_dtype=dtype_from_name(s["compute_dtype"])
    ),
    "CrossHeadHadamard": lambda s: CrossHeadHadamard(
        s["num_heads"], s["head_dim"], compute_dtype=dtype_from_name(s["compute_dtype"])
    ),
    "ActivationQuantizer": lambda s: ActivationQuantizer(
        s["bits"], symmetric=s["symmetric"], clip_ratio=s["clip_ratio"], group_size=s["group_size"]
    ),
    "BFPQueryQuantizer": _build_query,
}


_INT, _BOOL, _STR, _FLOAT, _LIST = (int,), (bool,), (str,), (int, float), (list,)
_NONE = (type(None),)

#: the JSON type of every field of each spec (what a checkpoint is checked against)
SPEC_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "FloatLinear": {"in_features": _INT, "out_features": _INT, "bias": _BOOL, "dtype": _STR},
    "OnlineHadamard": {"n": _INT, "group_size": _INT + _NONE, "compute_dtype": _STR + _NONE},
    "CrossHeadHadamard": {"num_heads": _INT, "head_dim": _INT, "compute_dtype": _STR + _NONE},
    "ActivationQuantizer": {
        "bits": _INT, "symmetric": _BOOL, "clip_ratio": _FLOAT, "group_size": _INT + _NONE,
    },
    "BFPQueryQuantizer": {
        "mantissa_bits": _INT, "block": _INT, "head_dim": _INT, "order_shape": _LIST + _NONE,
    },
}  # fmt: skip


def check_fields(values: dict[str, Any], fields: dict[str, tuple[type, ...]], what: str) -> None:
    """Raise LowbitError unless ``values`` has exactly ``fields`` (an optional ``backend``
    aside) with values of their JSON types (a bool is not an int; integers are positive, or
    non-negative where the field's types include :class:`NonNegative`)."""
    missing = sorted(set(fields) - set(values) - {"backend"})
    extra = sorted(set(values) - set(fields) - {"class"})
    if missing or extra:
        raise LowbitError(f"the checkpoint's {what} entry has fields {missing or extra} wrong")
    for key, value in values.items():
        if key == "class":
            continue
        allowed = fields[key]
        is_bool = isinstance(value, bool)
        ok = isinstance(value, allowed) and (not is_bool or bool in allowed)
        if ok and isinstance(value, int) and not is_bool:
            ok = value >= (0 if NonNegative in allowed else 1)
        if not ok:
            raise LowbitError(f"the checkpoint's {what} entry has an invalid {key}: {value!r}")


def check_linear_inputs(linear: nn.Module, name: str) -> None:
    """Raise LowbitError unless a rebuilt linear's input transform and activation quantizer
    fit its input width."""
    width = linear.in_features
    transform = getattr(linear, "input_transform", None)
    if transform is not None:
        n = getattr(transform, "n", None) or transform.num_heads * transform.head_dim
        if n != width:
            raise LowbitError(f"the checkpoint gives {name} an input transform of width {n}")
    act = getattr(linear, "act_quantizer", None)
    if act is not None and act.group_size and width % act.group_size:
        raise LowbitError(f"the checkpoint's activation group of {name} does not divide {width}")


def fields_from_signature(function) -> dict[str, tuple[type, ...]]:
    """JSON field types from a constructor's annotations (int, bool, float, str, optional)."""
    import inspect
    import types
    import typing

    hints = typing.get_type_hints(function)
    fields = {}
    for name in inspect.signature(function).parameters:
        if name == "self":
            continue
        hint = hints.get(name)
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed: tuple[type, ...] = ()
        for option in options:
            allowed += {int: _INT, bool: _BOOL, float: _FLOAT, str: _STR}.get(option, _NONE)
        fields[name] = allowed
    return fields


def build_module(spec: dict[str, Any]) -> nn.Module:
    """An empty module from :func:`module_spec`'s output (its tensors come from a checkpoint)."""
    name = spec.get("class") if isinstance(spec, dict) else spec
    packed = packed_formats().get(name)
    if packed is not None:
        check_fields(spec, {**packed.spec_fields, "backend": _STR}, name)
        return packed.from_spec(spec)
    if name not in SPEC_CLASSES:
        raise LowbitError(f"unknown lowbit module {name!r} in the checkpoint")
    check_fields(spec, SPEC_FIELDS[name], name)
    return SPEC_CLASSES[name](spec)
