"""Attention that feeds a quantized KV cache: keys cached before or after RoPE, optional online
Hadamard on queries and keys (QuaRot), installed per layer through the model adapter.

:func:`install_kv_quantization` swaps each decoder layer's attention module for a
:class:`KVQuantAttention` that owns the same projections under the same names (so layer names,
``linear_names()`` and weight recipes are unaffected) plus that layer's key and value
quantizers. Nothing is patched on a class: models in the same process are independent.

The forward pass, per layer:

1. q, k, v projections; per-head ``q_norm``/``k_norm`` where the family has them (Qwen3).
2. RoPE on q from the model's ``position_embeddings`` (in the permuted channel order of a
   K-sorted model, :func:`lowbit.transforms.permute.ksort_qk`, when the attention carries a
   ``lowbit_rope_order``). Keys: after RoPE (default) they are
   rotated now; with ``pre_rope=True`` they are cached unrotated and RoPE is applied to the whole
   dequantized key sequence at every step at each token's true position (the cache remembers
   ``position_ids`` per batch row, so left padding stays right).
3. ``rotate_qk="hadamard"``: q and k go through the orthonormal Hadamard transform over
   head_dim after RoPE. It cancels in q kᵀ, so the cache holds rotated keys (QuaRot's cache).
   Then the layer's query quantizer, if any (BFP16 queries of K-sort + BFP), sees the queries
   exactly as they enter q kᵀ.
4. With a cache, the new keys and values are stored (packed a page at a time) and attention
   reads the pages chunk by chunk (:func:`lowbit.kv.decode.chunked_attention`: per chunk
   dequantize, RoPE for pre-RoPE keys, scores, running max and sum), never the layer's whole
   float K/V. ``packed_attention = False`` on a module takes the reference path instead: the
   whole sequence dequantized by the cache update, then step 5. Without a cache
   (``use_cache=False``) a throw-away layer quantizes the same way and takes step 5, so a
   single pass and cached evaluation agree. A stock ``DynamicCache`` that is still empty (what
   ``generate()`` and ``forward`` create by default) is filled with this model's quantized layers.
5. Attention with transformers' own kernels (sdpa, or eager math), the mask transformers built
   (causal, padding, sliding window), GQA by head repetition as in the stock model.

With no quantizers this reproduces the stock model (tests: fp32 logits within 1e-4, prefill,
decode, left-padded batches, all four families).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from lowbit.errors import LowbitError
from lowbit.kv.cache import KVCacheLayout, QuantizedKVLayer
from lowbit.kv.decode import RopeTable, chunked_attention
from lowbit.kv.quantizer import KVQuantizer
from lowbit.models.compat import pop_attention_cache
from lowbit.transforms.hadamard import fast_hadamard_transform, has_hadamard
from lowbit.transforms.permute import RopeOrder, apply_ordered_rope

__all__ = ["KVQuantAttention", "install_kv_quantization", "ROTATIONS"]

ROTATIONS = ("none", "hadamard")


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE with rotate-half pairing. x: [B, H, S, D]; cos, sin: [B or 1, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, D]
    return x * cos + _rotate_half(x) * sin


def _eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q kᵀ * scaling + mask) v with KV heads repeated for GQA; as transformers' eager."""
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1)  # [B, H_q, T, D]
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H_q, S, T]
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)  # [B, H_q, S, D]
    return out.transpose(1, 2).contiguous(), weights


def _check_padding_rows(mask: Tensor | None) -> None:
    """Raise LowbitError if some batch row may attend to no token at all (all padding)."""
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        return
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    rows = allowed.flatten(1).any(dim=1)  # [B]
    if not bool(rows.all()):
        bad = torch.nonzero(~rows).flatten().tolist()
        raise LowbitError(f"batch rows {bad} are all padding; remove them before running the model")


class KVQuantAttention(nn.Module):
    """A decoder layer's attention with a quantized KV cache (see module docstring).

    Args:
        attn: the stock attention module (or a previous KVQuantAttention) to take over.
        layout: the model's cache layout (quantizers per layer, sinks, fp window).
        rope_cos_sin: ``positions [B, T] -> (cos, sin)`` of the model (from the adapter).
        pre_rope: cache keys before RoPE.
        rotate_qk: ``"none"`` or ``"hadamard"`` (online Hadamard on q and k after RoPE).
        query_quantizer: module applied to the queries ``[B, H_q, S, D]`` after RoPE (and the
            Hadamard), i.e. as they enter q kᵀ; None = float queries.
    """

    def __init__(
        self,
        attn: nn.Module,
        layout: KVCacheLayout,
        rope_cos_sin: Callable[[Tensor, torch.dtype], tuple[Tensor, Tensor]],
        *,
        pre_rope: bool = False,
        rotate_qk: str = "none",
        query_quantizer: nn.Module | None = None,
        rope_table: RopeTable | None = None,
    ) -> None:
        super().__init__()
        self.q_proj, self.k_proj = attn.q_proj, attn.k_proj
        self.v_proj, self.o_proj = attn.v_proj, attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.config = attn.config
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.num_key_value_groups = attn.num_key_value_groups
        self.attention_dropout = getattr(attn, "attention_dropout", 0.0)
        self.sliding_window = getattr(attn, "sliding_window", None)
        self.is_causal = True
        self.query_quantizer = query_quantizer
        self.key_quantizer = layout.key_quantizers[self.layer_idx]
        self.value_quantizer = layout.value_quantizers[self.layer_idx]
        self.layout = layout
        self.pre_rope = pre_rope
        self.rotate_qk = rotate_qk
        self._rope_cos_sin = rope_cos_sin
        self.lowbit_rope_order: RopeOrder | None = getattr(attn, "lowbit_rope_order", None)
        # a cache's tokens are read by chunked attention over the packed pages (False: the
        # whole cache dequantized, then transformers' attention; kept as the reference path)
        self.packed_attention = True
        self.rope_table = rope_table or RopeTable(
            rope_cos_sin, getattr(attn.config, "max_position_embeddings", 0) or 0
        )

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, pre_rope={self.pre_rope}, rotate_qk={self.rotate_qk}"

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE of queries or keys ``[B, H, S, D]`` in this layer's channel order."""
        order = self.lowbit_rope_order
        if order is None:
            return _rope(x, cos, sin)
        if x.shape[1] != order.source.shape[0]:  # query heads: the KV head's order per group
            order = order.repeat_heads(x.shape[1] // order.source.shape[0])
        return apply_ordered_rope(x, cos, sin, order)

    def _hadamard(self, x: Tensor) -> Tensor:
        return fast_hadamard_transform(x, normalize=True, compute_dtype=torch.float32)

    def _cache_layer(self, cache: Cache | None) -> QuantizedKVLayer | None:
        """This layer's slot in ``cache``; an empty stock cache is given quantized layers."""
        if cache is None:
            return None
        layers = cache.layers
        if self.layer_idx < len(layers) and isinstance(layers[self.layer_idx], QuantizedKVLayer):
            return layers[self.layer_idx]
        if any(layer.get_seq_length() for layer in layers):
            raise LowbitError(
                "this model's KV cache is quantized but the cache passed in already holds "
                "unquantized tokens; pass model.lowbit_make_cache() as the cache "
                "(cache= or past_key_values=)"
            )
        cache.layers = self.layout.make_layers()
        cache.layer_class_to_replicate = None
        return cache.layers[self.layer_idx]

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        **kwargs,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of ``hidden_states`` [B, S, hidden] -> ([B, S, hidden], weights or None).

        The decoder layer passes the KV cache as ``cache`` (transformers >= 5.24) or
        ``past_key_values`` (earlier): either is used (:func:`pop_attention_cache`).
        """
        cache = pop_attention_cache(kwargs)
        batch, steps, _ = hidden_states.shape
        shape = (batch, steps, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)  # [B, S, H_q, D]
        k = self.k_proj(hidden_states).view(shape)  # [B, S, H_kv, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, D]
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H_kv, S, D]
        if self.layer_idx == 0:
            _check_padding_rows(attention_mask)

        cos, sin = position_embeddings  # [B or 1, S, D]
        layer = self._cache_layer(cache)
        packed = layer is not None and self.packed_attention
        query_rope = None
        if packed and self.pre_rope and self.query_quantizer is None:

            def query_rope(x: Tensor) -> Tensor:  # left to the packed attention's decode step
                return self._rope(x, cos, sin)

        else:
            q = self._rope(q, cos, sin)
        positions = kwargs.get("position_ids")
        if positions is None:
            past = 0 if cache is None else cache.get_seq_length()
            positions = torch.arange(past, past + steps, device=q.device)[None]
        cache_kwargs = {"positions": positions}  # [B or 1, S]: pre-RoPE keys, pad-aware sinks
        if not self.pre_rope:
            k = self._rope(k, cos, sin)
            if self.rotate_qk == "hadamard":
                q, k = self._hadamard(q), self._hadamard(k)
        if self.query_quantizer is not None:
            q = self.query_quantizer(q)

        if packed:
            layer.store(k, v, cache_kwargs)
            key_rope = None
            if self.pre_rope:
                table = self.rope_table

                def key_rope(keys: Tensor, positions: Tensor) -> Tensor:
                    cos_k, sin_k = table(positions.long(), keys.dtype)  # [B, n, D]
                    return self._rope(keys, cos_k, sin_k)

            out = chunked_attention(
                q,
                layer,
                scaling=self.scaling,
                mask=attention_mask,
                key_rope=key_rope,
                rope_table=self.rope_table if self.lowbit_rope_order is None else None,
                query_rope=query_rope,
            )  # [B, S, H_q, D]
            return self.o_proj(out.reshape(batch, steps, -1)), None
        if layer is None:
            layer = self.layout.make_layer(self.layer_idx)
            keys, values = layer.update(k, v, cache_kwargs)  # [B, H_kv, T, D]
        else:
            keys, values = cache.update(k, v, self.layer_idx, cache_kwargs)
        if self.pre_rope:
            cos_all, sin_all = self._rope_cos_sin(layer.positions(), keys.dtype)  # [B, T, D]
            keys = self._rope(keys, cos_all, sin_all)

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, _eager_attention
        )
        out, weights = attention(
            self,
            q,
            keys,
            values,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        out = out.reshape(batch, steps, -1).contiguous()  # [B, S, H_q * D]
        return self.o_proj(out), weights


def _per_layer(name: str, quantizers, num_layers: int) -> list[KVQuantizer | None]:
    if quantizers is None:
        return [None] * num_layers
    if isinstance(quantizers, KVQuantizer):
        raise LowbitError(f"{name} must be one quantizer (or None) per layer, not a single one")
    quantizers = list(quantizers)
    if len(quantizers) != num_layers:
        raise LowbitError(
            f"{name} has {len(quantizers)} entries; the model has {num_layers} layers"
        )
    for q in quantizers:
        if q is not None and not isinstance(q, KVQuantizer):
            raise LowbitError(f"{name} entries must be KVQuantizer or None, not {type(q).__name__}")
    return quantizers


def _move_to_layer(attn: nn.Module, *quantizers: nn.Module | None) -> None:
    """Put a layer's quantizers (calibrated anywhere) on the device of its attention, in place.
    A model being rebuilt on the meta device keeps them where they are (their state is loaded
    or derived afterwards)."""
    device = attn.q_proj.weight.device
    if device.type == "meta":
        return
    for quantizer in quantizers:
        if quantizer is not None:
            quantizer.to(device)


def install_kv_quantization(
    model: nn.Module,
    adapter=None,
    *,
    key_quantizers: Sequence[KVQuantizer | None] | None = None,
    value_quantizers: Sequence[KVQuantizer | None] | None = None,
    query_quantizers: Sequence[nn.Module | None] | None = None,
    pre_rope: bool = False,
    rotate_qk: str = "none",
    sink_tokens: int = 0,
    fp_window: int = 0,
    residual_dtype: torch.dtype | None = None,
) -> KVCacheLayout:
    """Give ``model`` a quantized KV cache, in place.

    Args:
        model: a causal LM of a supported family.
        adapter: its adapter (``adapter_for(model)`` when None).
        key_quantizers, value_quantizers: one per decoder layer, None entries (or None) = fp.
            Each layer's quantizers (and query quantizer) are moved to that layer's device.
        query_quantizers: one module per decoder layer (or None) applied to the queries
            ``[B, H_q, S, D]`` as they enter q kᵀ, after RoPE and the Hadamard.
        pre_rope: cache keys before RoPE (RoPE is applied to the dequantized keys each step).
        rotate_qk: ``"hadamard"`` applies the online Hadamard to q and k after RoPE (QuaRot).
        sink_tokens: leading cache slots kept in floating point.
        fp_window: most recent tokens kept in floating point (KIVI's residual).
        residual_dtype: dtype of the fp parts (None: the model's; float16 for deployment sizes).

    Returns:
        The :class:`KVCacheLayout`; also set as ``model.lowbit_kv``, and
        ``model.lowbit_make_cache()`` builds an empty cache for ``generate()`` / evaluation.
    """
    from lowbit.models.adapter import adapter_for

    if getattr(model, "lowbit_kv", None) is not None:
        raise LowbitError(
            "this model already has a quantized KV cache; a recipe (or a composition of "
            "recipes) installs at most one"
        )
    adapter = adapter or adapter_for(model)
    n = adapter.num_layers
    keys = _per_layer("key_quantizers", key_quantizers, n)
    values = _per_layer("value_quantizers", value_quantizers, n)
    queries = [None] * n if query_quantizers is None else list(query_quantizers)
    if len(queries) != n or not all(q is None or isinstance(q, nn.Module) for q in queries):
        raise LowbitError(f"query_quantizers must be {n} modules or None, one per layer")
    if rotate_qk not in ROTATIONS:
        raise LowbitError(f"rotate_qk must be one of {ROTATIONS}, not {rotate_qk!r}")
    if rotate_qk == "hadamard":
        if pre_rope:
            raise LowbitError(
                "rotate_qk='hadamard' rotates keys after RoPE, so it cannot be used with pre_rope"
            )
        if not has_hadamard(adapter.head_dim):
            raise LowbitError(f"there is no Hadamard matrix of size head_dim={adapter.head_dim}")
    for q in keys + values:
        if q is not None:
            q.check(adapter.head_dim)
    if getattr(adapter, "rope_style", "rotate_half") != "rotate_half":
        raise LowbitError(f"KV quantization supports rotate-half RoPE, not {adapter.rope_style!r}")
    layout = KVCacheLayout(
        key_quantizers=keys,
        value_quantizers=values,
        sink_tokens=sink_tokens,
        fp_window=fp_window,
        residual_dtype=residual_dtype,
        track_positions=pre_rope,
    )
    layout.make_layer(0)  # validates sink_tokens / fp_window
    table = None
    for i in range(n):
        _move_to_layer(adapter.block(i).attn, keys[i], values[i], queries[i])
        attn = KVQuantAttention(
            adapter.block(i).attn,
            layout,
            adapter.rope_cos_sin,
            pre_rope=pre_rope,
            rotate_qk=rotate_qk,
            query_quantizer=queries[i],
            rope_table=table,
        )
        table = attn.rope_table  # one table of cos/sin by position, shared by the layers
        adapter.replace_attention(i, attn)
    model.lowbit_kv = layout
    model.lowbit_make_cache = layout.make_cache
    return layout
