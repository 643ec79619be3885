"""K-sort: function-preserving channel permutations of keys/queries (and values) per head.

Algorithm 1 of Trukhanov & Soloveychik, 2024 ("Accurate Block Quantization in LLMs with
Outliers"): inside each key/value head, sort the rows of ``W_k`` by their norm (descending
here, so the large-magnitude channels share blocks), apply the same permutation ``π`` to the
rows of ``W_q`` for every query head of the group (scores ``q·k`` are unchanged by a common
permutation), and carry RoPE through ``π`` (step 5): the channel that lands at position ``j``
keeps its own frequency, partner and sine sign.

RoPE as transformers writes it (rotate-half) rotates channel ``i`` with ``p(i) = i ± d/2``:
``out[i] = x[i] cos θ_i + s_i x[p(i)] sin θ_i`` with ``s_i = -1`` in the first half and ``+1``
in the second, ``θ_i = θ_{i mod d/2}``. For ``x' = x[π]`` (channel ``j`` of ``x'`` is channel
``π[j]`` of ``x``) the rotated ``out[π]`` is::

    out'[j] = x'[j] cos θ_{π[j]} + s_{π[j]} x'[π⁻¹[p(π[j])]] sin θ_{π[j]}

i.e. per head a gathered cos/sin, a sign and a partner index (:class:`RopeOrder`). No single
permutation of the shared ``cos``/``sin`` tensors can do this for heads with different ``π``,
so a permuted model's attention applies RoPE with :func:`apply_ordered_rope`:
:func:`ksort_qk` installs a per-instance attention forward that does (for the stock
transformers attention), and lowbit's own attention reads the same ``lowbit_rope_order``.

The value permutation (the paper's §III, last paragraph) needs no RoPE care: ``W_v`` rows and
the matching ``o_proj`` input columns move together.

Qwen3's per-head ``q_norm``/``k_norm`` share one weight over heads; with per-head permutations
the weight becomes ``[heads, head_dim]`` (RMSNorm itself is permutation invariant and the
broadcast in its forward takes the 2-d weight). Qwen2's q/k/v biases are permuted with rows.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.compat import pop_attention_cache

__all__ = [
    "RopeOrder",
    "ksort_order",
    "apply_ordered_rope",
    "permute_qk_channels",
    "permute_v_channels",
    "ksort_qk",
    "ksort_v",
]


def ksort_order(weight: Tensor, num_heads: int, descending: bool = True) -> Tensor:
    """Per-head channel order of ``weight`` rows sorted by their L2 norm.

    Args:
        weight: ``[num_heads * head_dim, in]`` (``W_k`` or ``W_v``).
        num_heads: heads the rows are split into.
        descending: largest norm first.

    Returns:
        ``[num_heads, head_dim]`` long: row ``h`` lists the old channels in their new order.
    """
    rows = weight.shape[0]
    if rows % num_heads:
        raise LowbitError(f"{rows} rows do not split into {num_heads} heads")
    norms = weight.detach().float().norm(dim=1).view(num_heads, rows // num_heads)  # [H, D]
    return torch.sort(norms, dim=1, descending=descending, stable=True).indices


def _check_order(order: Tensor, heads: int, head_dim: int) -> None:
    if order.shape != (heads, head_dim):
        raise LowbitError(
            f"channel order must be [{heads}, {head_dim}] (heads x head_dim), "
            f"got {tuple(order.shape)}"
        )
    expected = torch.arange(head_dim, device=order.device).expand(heads, -1)
    if not torch.equal(order.sort(dim=1).values, expected):
        raise LowbitError("each row of a channel order must be a permutation of 0..head_dim-1")


@dataclass
class RopeOrder:
    """RoPE of channel-permuted heads (see module doc), all ``[heads, head_dim]``.

    Attributes:
        source: old channel at each new position (``π``): cos/sin are gathered with it.
        partner: new position of each channel's RoPE partner.
        sign: ``s_{π[j]}`` (-1 or +1), the sine sign of the rotate-half formula.
    """

    source: Tensor
    partner: Tensor
    sign: Tensor

    @classmethod
    def from_order(cls, order: Tensor) -> RopeOrder:
        heads, d = order.shape
        half = d // 2
        idx = torch.arange(d, device=order.device)
        old_partner = torch.where(idx < half, idx + half, idx - half)  # [D]
        inverse = torch.empty_like(order).scatter_(
            1, order, idx.expand(heads, -1).contiguous()
        )  # inverse[h, old] = new
        partner = inverse.gather(1, old_partner[order])  # [H, D]
        sign = torch.where(order < half, -1.0, 1.0)  # [H, D]
        return cls(source=order, partner=partner, sign=sign)

    def repeat_heads(self, group: int) -> RopeOrder:
        """The order for ``group`` consecutive query heads per key/value head."""
        return RopeOrder(
            *(t.repeat_interleave(group, dim=0) for t in (self.source, self.partner, self.sign))
        )


def apply_ordered_rope(x: Tensor, cos: Tensor, sin: Tensor, order: RopeOrder) -> Tensor:
    """RoPE of channel-permuted heads; equals ``rope(x[..., π⁻¹])[..., π]`` up to rounding.

    Args:
        x: ``[B, H, S, D]`` permuted queries or keys.
        cos, sin: ``[B, S, D]`` as the model's rotary embedding returns them.
        order: a :class:`RopeOrder` with ``H`` heads.
    """
    b, h, s, d = x.shape
    cos_h = cos[:, :, order.source].permute(0, 2, 1, 3)  # [B, H, S, D]
    sin_h = sin[:, :, order.source].permute(0, 2, 1, 3) * order.sign.to(sin.dtype)[:, None, :]
    partner = x.gather(-1, order.partner.view(1, h, 1, d).expand(b, h, s, d))  # [B, H, S, D]
    return x * cos_h.to(x.dtype) + partner * sin_h.to(x.dtype)


def _permute_rows(linear: nn.Linear, index: Tensor) -> None:
    linear.weight.data = linear.weight.data[index]
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[index]


def _flat_rows(order: Tensor) -> Tensor:
    """``[H, D]`` per-head order → ``[H * D]`` row index."""
    heads, d = order.shape
    return (order + d * torch.arange(heads, device=order.device)[:, None]).reshape(-1)


def _permute_head_norm(norm: nn.Module, order: Tensor) -> None:
    weight = norm.weight.data
    per_head = weight if weight.dim() == 2 else weight.expand(order.shape[0], -1)
    norm.weight = nn.Parameter(per_head.gather(1, order).contiguous(), requires_grad=False)


def permute_qk_channels(model: nn.Module, layer: int, order: Tensor) -> None:
    """Permute the query/key channels of one layer by a per-KV-head ``order`` in place.

    Moves ``W_k``/``W_q`` rows (and biases, and Qwen3 ``k_norm``/``q_norm`` weights) and
    records the RoPE order on the attention module as ``lowbit_rope_order`` (composed with any
    order already there). The model computes the same function only with an attention that
    applies :func:`apply_ordered_rope` (:func:`ksort_qk` installs one).

    Args:
        model: a supported causal LM.
        layer: block index.
        order: ``[num_kv_heads, head_dim]``, row ``g`` the new order of KV head ``g``'s
            channels (a permutation of ``0..head_dim-1``).
    """
    adapter = adapter_for(model)
    h_kv, d, group = adapter.num_kv_heads, adapter.head_dim, adapter.gqa_group
    if d % 2:
        raise LowbitError(f"head_dim {d} is odd; rotate-half RoPE needs an even head_dim")
    order = order.to(torch.long)
    _check_order(order, h_kv, d)
    view = adapter.block(layer)
    order = order.to(view.k_proj.weight.device)
    q_order = order.repeat_interleave(group, dim=0)  # [H_q, D]
    _permute_rows(view.k_proj, _flat_rows(order))
    _permute_rows(view.q_proj, _flat_rows(q_order))
    if view.k_norm is not None:
        _permute_head_norm(view.k_norm, order)
        _permute_head_norm(view.q_norm, q_order)
    previous = getattr(view.attn, "lowbit_rope_order", None)
    total = order if previous is None else previous.source.gather(1, order)
    view.attn.lowbit_rope_order = RopeOrder.from_order(total)


def permute_v_channels(model: nn.Module, layer: int, order: Tensor) -> None:
    """Permute the value channels of one layer per KV head, and the matching ``o_proj``
    input columns of every query head of the group, in place (function preserving)."""
    adapter = adapter_for(model)
    h_kv, d, group = adapter.num_kv_heads, adapter.head_dim, adapter.gqa_group
    order = order.to(torch.long)
    _check_order(order, h_kv, d)
    view = adapter.block(layer)
    order = order.to(view.v_proj.weight.device)
    _permute_rows(view.v_proj, _flat_rows(order))
    columns = _flat_rows(order.repeat_interleave(group, dim=0))  # [H_q * D]
    view.o_proj.weight.data = view.o_proj.weight.data[:, columns]


def _ordered_rope_attention_forward(
    self, hidden_states, position_embeddings, attention_mask=None, **kwargs
):
    """The transformers attention of the supported families with RoPE from
    ``self.lowbit_rope_order`` (bound per instance by :func:`ksort_qk`); the KV cache comes as
    ``cache`` or ``past_key_values`` (:func:`pop_attention_cache`)."""
    cache = pop_attention_cache(kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape)  # [B, S, H_q, D]
    key = self.k_proj(hidden_states).view(hidden_shape)  # [B, S, H_kv, D]
    if getattr(self, "q_norm", None) is not None:
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)  # [B, H, S, D]
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings  # [B, S, D]
    order = self.lowbit_rope_order
    query = apply_ordered_rope(query, cos, sin, order.repeat_heads(self.num_key_value_groups))
    key = apply_ordered_rope(key, cos, sin, order)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    from transformers.models.llama.modeling_llama import eager_attention_forward

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    extra = {}
    if hasattr(self, "sliding_window"):
        extra["sliding_window"] = self.sliding_window
    out, weights = attention(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def ksort_qk(model: nn.Module, descending: bool = True) -> list[Tensor]:
    """K-sort every layer: sort each KV head's key channels by ``W_k`` row norm.

    Permutes ``W_k``/``W_q`` (:func:`permute_qk_channels`) and binds an attention forward that
    applies the permuted RoPE to each attention instance (transformers' own is replaced on
    the instance only). The unquantized model computes the same logits as before.

    Returns:
        the per-layer orders, each ``[num_kv_heads, head_dim]``.
    """
    adapter = adapter_for(model)
    orders = []
    for view in adapter.blocks():
        order = ksort_order(view.k_proj.weight, adapter.num_kv_heads, descending)
        permute_qk_channels(model, view.index, order)
        view.attn.forward = types.MethodType(_ordered_rope_attention_forward, view.attn)
        orders.append(order)
    return orders


def ksort_v(model: nn.Module, descending: bool = True) -> list[Tensor]:
    """Sort each KV head's value channels by ``W_v`` row norm (``o_proj`` columns follow)."""
    adapter = adapter_for(model)
    orders = []
    for view in adapter.blocks():
        order = ksort_order(view.v_proj.weight, adapter.num_kv_heads, descending)
        permute_v_channels(model, view.index, order)
        orders.append(order)
    return orders
