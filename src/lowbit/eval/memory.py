"""Memory accounting: bits per weight, model bytes, KV-cache bytes per token.

Every quantized module reports its exact storage through ``storage_bits()`` (weights with all
scales, zeros, codebooks and outlier indices counted). Everything else counts at its dtype.
Shared tensors (tied embeddings) count once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.models.adapter import DecoderAdapter


@dataclass
class MemoryReport:
    bits_per_weight: float  # over the decoder blocks' linear weights
    linear_weights: int  # number of weights in those linears
    model_bytes: int  # whole model: quantized storage + everything else at its dtype
    kv_bytes_per_token: float
    kv_context: int  # context length the KV figure is stated at


def _tensor_bits(t: torch.Tensor, float_dtype: torch.dtype | None = None) -> int:
    """Bits of ``t``; a float tensor at ``float_dtype``'s size when one is given (the dtype a
    saved model runs in, so ``quantize`` states what ``eval`` of the saved model states)."""
    size = t.element_size()
    if float_dtype is not None and t.is_floating_point():
        size = torch.tensor([], dtype=float_dtype).element_size()
    return t.numel() * size * 8


def _module_bits(module: torch.nn.Module, float_dtype: torch.dtype | None = None) -> int:
    """Storage of one block linear: its own accounting, or its float parameters."""
    if hasattr(module, "storage_bits"):
        return module.storage_bits()
    return sum(_tensor_bits(p, float_dtype) for p in module.parameters(recurse=False))


def linear_weight_bits(
    model: torch.nn.Module, adapter: DecoderAdapter, float_dtype: torch.dtype | None = None
) -> tuple[int, int]:
    """(bits stored, weights) over every block linear; biases excluded from both."""
    bits = weights = 0
    for name in adapter.linear_names():
        module = model.get_submodule(name)
        n = module.weight_numel if hasattr(module, "weight_numel") else module.weight.numel()
        weights += n
        bias = getattr(module, "bias", None)
        bias_bits = 0 if bias is None else _tensor_bits(bias, float_dtype)
        bits += _module_bits(module, float_dtype) - bias_bits
    return bits, weights


def _persistent_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers saved with the model (derived ones such as RoPE frequencies are not)."""
    return [
        buffer
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]


def model_storage_bytes(model: torch.nn.Module, float_dtype: torch.dtype | None = None) -> int:
    """Bytes to store the whole model: parameters and persistent buffers, each shared tensor
    once, quantized modules at their exact storage (float tensors at ``float_dtype`` if given)."""
    seen: set[int] = set()
    bits = 0
    accounted: set[int] = set()
    for module in model.modules():
        if hasattr(module, "storage_bits"):
            bits += module.storage_bits()
            accounted.update(id(t) for t in module.parameters())
            accounted.update(id(t) for t in module.buffers())
    for t in list(model.parameters()) + _persistent_buffers(model):
        if id(t) in accounted or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        bits += _tensor_bits(t, float_dtype)
    return bits // 8


def memory_in_use(model: torch.nn.Module) -> int:
    """Bytes the model holds in memory now: parameters, buffers (persistent or not) and the
    layouts backends prepared from packed weights (kernel copies, decoded weights), each
    storage once. What a run costs beside its activations and KV cache."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for prepared in module.__dict__.get("_prepared", {}).values():
            tensors += [t for t in prepared.values() if isinstance(t, torch.Tensor)]
        if hasattr(module, "run_tensors"):  # lowbit.nn.run_linear
            tensors += module.run_tensors()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the model as its float original has them, each shared tensor once.

    A packed linear (one with ``weight_numel``) counts the weights it represents, in x out,
    and its bias: its packed codes are not parameters, so counting ``parameters()`` would
    leave its weights out.
    """
    count = 0
    accounted: set[int] = set()
    for module in model.modules():
        if hasattr(module, "weight_numel"):
            count += module.weight_numel
            bias = getattr(module, "bias", None)
            count += 0 if bias is None else bias.numel()
            accounted.update(id(t) for t in module.parameters())
    return count + sum(p.numel() for p in model.parameters() if id(p) not in accounted)


# context lengths at which eval rows state the KV cache's bytes per token (lowbit report plots them)
KV_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def float_kv_bytes_per_token(adapter: DecoderAdapter, dtype: torch.dtype = torch.float16) -> int:
    """Bytes per token of an unquantized KV cache: K and V for every layer and KV head."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * adapter.num_layers * adapter.num_kv_heads * adapter.head_dim * element


def kv_bytes_per_token(
    model: torch.nn.Module,
    adapter: DecoderAdapter,
    context: int,
    kv_float_dtype: torch.dtype = torch.float16,
) -> float:
    """KV-cache bytes per token at ``context`` tokens: the recipe's when it quantizes the cache
    (a cache with a float window or per-sequence state costs more per token at short contexts),
    else an unquantized cache in ``kv_float_dtype`` (what serving engines keep)."""
    recipe = getattr(model, "lowbit_recipe", None)
    kv = None if recipe is None else recipe.kv_bytes_per_token(adapter, context)
    return float(float_kv_bytes_per_token(adapter, kv_float_dtype) if kv is None else kv)


def memory_report(
    model: torch.nn.Module,
    adapter: DecoderAdapter,
    *,
    kv_context: int = 2048,
    kv_float_dtype: torch.dtype = torch.float16,
    float_dtype: torch.dtype | None = None,
) -> MemoryReport:
    """Exact storage of ``model`` and its KV cache per token at ``kv_context``
    (:func:`kv_bytes_per_token`); float tensors at ``float_dtype`` when given (the dtype the
    model will run in), else at their own."""
    bits, weights = linear_weight_bits(model, adapter, float_dtype)
    return MemoryReport(
        bits_per_weight=bits / weights,
        linear_weights=weights,
        model_bytes=model_storage_bytes(model, float_dtype),
        kv_bytes_per_token=kv_bytes_per_token(model, adapter, kv_context, kv_float_dtype),
        kv_context=kv_context,
    )
