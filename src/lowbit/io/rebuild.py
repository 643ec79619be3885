"""A quantized model's structure as JSON, and back: what a checkpoint needs to rebuild a model.

Saving describes every lowbit module by its spec (:func:`module_spec`) and the KV cache by its
layout (:func:`kv_layout_spec`); loading builds the float model of the checkpoint's config on the
meta device and puts lowbit's modules where the specs say (:func:`restructure`), before the
tensors are loaded, then recomputes what is never stored (:func:`refresh_derived_buffers`).
Every name in the JSON (module classes, KV quantizer kinds, the recipe's methods) is found through
its registry, which imports the module that defines it: rebuilding never depends on what the
process happened to import before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.kv.attention import KVQuantAttention, install_kv_quantization
from lowbit.kv.quantizer import KVQuantizer, kv_quantizer_from_dict
from lowbit.models.adapter import adapter_for
from lowbit.nn.packed_linear import PackedLinearBase, packed_format_for
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module
from lowbit.nn.spec import Rebuildable, build_module, spec_name
from lowbit.recipes.registry import recipe_from_dict
from lowbit.settings import dtype_from_name, dtype_name
from lowbit.transforms.permute import RopeOrder

__all__ = [
    "module_spec",
    "kv_layout_spec",
    "rope_orders",
    "restructure",
    "refresh_derived_buffers",
    "skeleton",
    "expected_tensors",
]


# -- describing ------------------------------------------------------------------------------------
def module_spec(module: nn.Module) -> dict[str, Any] | None:
    """The checkpoint spec of a lowbit runtime module (``{"class": name, **settings}``), or None
    for a module lowbit did not put there. A simulated quantized linear is described as the
    packed module of its weight (what the checkpoint stores); a packed one keeps its backend."""
    if isinstance(module, FakeQuantLinear) and module.quantized_weight is not None:
        weight = module.quantized_weight
        packed = packed_format_for(weight).from_quantized(
            weight, module.bias, weight_dtype=module.weight.dtype
        )
        return {"class": spec_name(type(packed)), **packed.spec()}
    if not isinstance(module, Rebuildable):
        return None
    spec = {"class": spec_name(type(module)), **module.spec()}
    if isinstance(module, PackedLinearBase):
        spec["backend"] = module.backend
    return spec


def kv_layout_spec(model: nn.Module) -> dict[str, Any] | None:
    """The quantized KV cache's layout and each layer's quantizer settings (None: no cache)."""
    layout = getattr(model, "lowbit_kv", None)
    if layout is None:
        return None
    attns = [m for m in model.modules() if isinstance(m, KVQuantAttention)]
    if {(a.pre_rope, a.rotate_qk) for a in attns} != {(attns[0].pre_rope, attns[0].rotate_qk)}:
        raise LowbitError("the model's layers cache keys in different ways; it cannot be saved")

    def dicts(quantizers):
        return [None if q is None else q.to_dict() for q in quantizers]

    return {
        "pre_rope": attns[0].pre_rope,
        "rotate_qk": attns[0].rotate_qk,
        "sink_tokens": layout.sink_tokens,
        "fp_window": layout.fp_window,
        "residual_dtype": dtype_name(layout.residual_dtype),
        "key_quantizers": dicts(layout.key_quantizers),
        "value_quantizers": dicts(layout.value_quantizers),
    }


def rope_orders(model: nn.Module) -> dict[str, list]:
    """K-sort's RoPE channel order per block index, ``[H_kv, D]`` as nested lists."""
    orders = {}
    for view in adapter_for(model).blocks():
        order = getattr(view.attn, "lowbit_rope_order", None)
        if order is not None:
            orders[str(view.index)] = order.source.tolist()  # [H_kv, D]
    return orders


# -- rebuilding ------------------------------------------------------------------------------------
_KV_FIELDS = ("pre_rope", "rotate_qk", "sink_tokens", "fp_window", "residual_dtype")


def _install_kv(model: nn.Module, kv: dict[str, Any]) -> None:
    missing = [k for k in (*_KV_FIELDS, "key_quantizers", "value_quantizers") if k not in kv]
    if missing:
        raise LowbitError(f"the checkpoint's KV cache layout has no {missing[0]}")

    def quantizers(dicts):
        if not isinstance(dicts, list):
            raise LowbitError("the checkpoint's KV quantizers are malformed")
        return [None if d is None else kv_quantizer_from_dict(d) for d in dicts]

    with torch.device("cpu"):  # small, and the state they derive must be real numbers
        install_kv_quantization(
            model,
            adapter_for(model),
            key_quantizers=quantizers(kv["key_quantizers"]),
            value_quantizers=quantizers(kv["value_quantizers"]),
            pre_rope=kv["pre_rope"],
            rotate_qk=kv["rotate_qk"],
            sink_tokens=kv["sink_tokens"],
            fp_window=kv["fp_window"],
            residual_dtype=dtype_from_name(kv["residual_dtype"]),
        )


def _check_linear_inputs(linear: nn.Module, name: str) -> None:
    """Refuse a rebuilt linear whose input transform or activation group does not fit its width."""
    width = linear.in_features
    transform = getattr(linear, "input_transform", None)
    if transform is not None and transform.n != width:
        raise LowbitError(f"the checkpoint gives {name} an input transform of width {transform.n}")
    act = getattr(linear, "act_quantizer", None)
    if act is not None and act.group_size and width % act.group_size:
        raise LowbitError(f"the checkpoint's activation group of {name} does not divide {width}")


def restructure(model: nn.Module, qconfig: dict[str, Any]) -> None:
    """Give an empty model of the checkpoint's config lowbit's modules, in place (no tensors
    are filled: the checkpoint's are loaded afterwards)."""
    adapter = adapter_for(model)
    for index, order in qconfig.get("rope_orders", {}).items():
        source = torch.tensor(order, dtype=torch.long, device="cpu")  # [H_kv, D]
        adapter.block(int(index)).attn.lowbit_rope_order = RopeOrder.from_order(source)
    if qconfig.get("kv"):
        _install_kv(model, qconfig["kv"])
    modules = qconfig.get("modules", {})
    for fqn in sorted(modules, key=lambda name: name.count(".")):  # parents before children
        try:
            model.get_submodule(fqn.rpartition(".")[0])
        except AttributeError as err:
            raise LowbitError(
                f"the checkpoint names a module {fqn!r} this model does not have"
            ) from err
        module = build_module(modules[fqn])
        if hasattr(module, "weight_dtype"):  # dequantized weights come in the dtype it runs in
            module.weight_dtype = model.dtype
        replace_module(model, fqn, module)
    for fqn in modules:
        module = model.get_submodule(fqn)
        if hasattr(module, "in_features"):
            _check_linear_inputs(module, fqn)
    model.lowbit_recipe = recipe_from_dict(qconfig["recipe"])


def refresh_derived_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers of lowbit's modules (Hadamard factors, token
    rotations): they are never stored, and a model built on the meta device holds none."""
    for module in model.modules():
        derived = module._non_persistent_buffers_set
        if not derived:
            continue
        if isinstance(module, KVQuantizer):
            fresh = kv_quantizer_from_dict(module.to_dict())
        else:
            spec = module_spec(module)
            if spec is None:
                continue
            fresh = build_module(spec)
        for name in derived:
            old, new = module._buffers.get(name), fresh._buffers.get(name)
            device = old.device if old is not None and old.device.type != "meta" else "cpu"
            module._buffers[name] = None if new is None else new.to(device)


def skeleton(config, qconfig: dict[str, Any]) -> nn.Module:
    """The empty (meta-device) model a checkpoint describes, with lowbit's modules in place."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # lowbit's modules too: an 8B model's packed buffers are GBs
        model = AutoModelForCausalLM.from_config(config)
        restructure(model, qconfig)
    return model


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor ``model`` loads, by state-dict key."""
    return {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
