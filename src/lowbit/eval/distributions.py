"""Channel magnitudes before and after the transforms that exist to even them out.

* Activations: the largest ``|x|`` per channel at one block's q_proj input, in the float model
  and after QuaRot's rotation (``rotate``): a few outlier channels become a flat profile, which
  is why 4-bit activations work after rotation (QuaRot, Fig. 1).
* Keys: the largest ``|k|`` per channel of one block's keys before RoPE (k_proj's output), in
  the model's channel order and in K-sort's order (channels sorted per head by the norm of the
  ``W_k`` rows that make them): neighbouring channels then have similar magnitudes, so blocks of
  them share a floating-point exponent with little loss (Trukhanov & Soloveychik, Fig. 2).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.transforms.permute import ksort_order

__all__ = ["ChannelMagnitudes", "channel_magnitudes"]


@dataclass
class ChannelMagnitudes:
    """Largest magnitude per channel over the tokens of one run, for block ``layer``."""

    layer: int
    activations: Tensor  # [hidden] q_proj's input, float model
    activations_rotated: Tensor  # [hidden] q_proj's input after the rotation
    keys: Tensor  # [kv_heads * head_dim] k_proj's output (pre-RoPE keys), model order
    keys_sorted: Tensor  # [kv_heads * head_dim] the same, each head's channels in K-sort order
    head_dim: int


def _channel_max(model: nn.Module, ids: Tensor, layer: int, name: str, side: str) -> Tensor:
    """Max over tokens of ``|t|`` per last-dim channel, ``t`` the input or output of block
    ``layer``'s linear ``name``."""
    from lowbit.eval.evaluate import window_logits

    module = getattr(adapter_for(model).block(layer), name)
    found: list[Tensor] = []

    def hook(_module, inputs, output):
        t = inputs[0] if side == "input" else output
        found.append(t.detach().float().abs().flatten(0, -2).amax(0))  # [C]

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            for window in ids:  # [S]
                window_logits(model, window, None)
    finally:
        handle.remove()
    return torch.stack(found).amax(0)  # [C]


def channel_magnitudes(
    model: nn.Module, ids: Tensor, layer: int | None = None
) -> ChannelMagnitudes:
    """Channel magnitudes of block ``layer`` (None: the middle one) of the float ``model`` on
    ``ids`` ([N, S] token ids); ``model`` is left as it was."""
    from lowbit.api import quantize

    adapter = adapter_for(model)
    layer = adapter.num_layers // 2 if layer is None else layer
    if not 0 <= layer < adapter.num_layers:
        raise LowbitError(f"layer must be 0 to {adapter.num_layers - 1}, not {layer}")
    activations = _channel_max(model, ids, layer, "q_proj", "input")
    keys = _channel_max(model, ids, layer, "k_proj", "output")  # [H_kv * D]
    order = ksort_order(adapter.block(layer).k_proj.weight, adapter.num_kv_heads)  # [H_kv, D]
    keys_sorted = keys.view(order.shape).gather(1, order.to(keys.device)).flatten()
    rotated = quantize(copy.deepcopy(model), "rotate", progress=False)
    activations_rotated = _channel_max(rotated, ids, layer, "q_proj", "input")
    return ChannelMagnitudes(
        layer=layer,
        activations=activations,
        activations_rotated=activations_rotated,
        keys=keys,
        keys_sorted=keys_sorted,
        head_dim=adapter.head_dim,
    )
