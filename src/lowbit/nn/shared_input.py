"""Packed linears that read one input (q/k/v, gate/up), multiplied in one kernel call.

A decoder block calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` one after another on the same
tensor. At batch 1 each call is mostly fixed cost (Python dispatch, a kernel launch on a few
hundred rows), so the layers of a :class:`SharedInput` group are prepared as one stacked layout
(:meth:`~lowbit.kernels.dispatch.WeightBackend.prepare_group`): the first member called computes
every member's output in one call and keeps the others' until they are asked for. The model's
code is unchanged, the modules and their buffers stay (checkpoints, accounting); an input that
is not the one computed (another tensor, or the same one changed in place) is computed afresh,
so the outputs are always the members' own, bit for bit.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lowbit.kernels.dispatch import choose, packed_matmul

__all__ = ["SharedInput", "share_input"]


class SharedInput:
    """The packed linears of one input, computed together (see the module docstring)."""

    def __init__(self, layers: list):
        self.layers = layers
        self._prepared: dict[Any, dict[str, Any] | None] = {}
        self._forget()

    def _forget(self) -> None:
        self._input: Tensor | None = None  # held, so its id cannot be reused meanwhile
        self._version = -1
        self._outputs: list[Tensor] = []
        self._pending: set[int] = set()

    def __call__(self, layer, x: Tensor) -> Tensor:  # [..., K] -> [..., N_layer]
        index = next(i for i, member in enumerate(self.layers) if member is layer)
        if x is self._input and x._version == self._version and index in self._pending:
            output = self._outputs[index]
        else:
            outputs = self._compute(x)
            if outputs is None:  # not for this input: each layer on its own
                return packed_matmul(layer, x)
            self._input, self._version = x, x._version
            self._outputs, self._pending = outputs, set(range(len(self.layers)))
            output = outputs[index]
        self._pending.discard(index)
        if not self._pending:
            self._forget()
        return output

    def _compute(self, x: Tensor) -> list[Tensor] | None:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])  # [M, K]
        backends = {choose(layer, x2d) for layer in self.layers}
        if len(backends) != 1:
            return None
        backend = backends.pop()
        key = (backend.name, x2d.device, tuple(layer.storage_key() for layer in self.layers))
        if key not in self._prepared:
            self._prepared.clear()
            self._prepared[key] = backend.prepare_group(self.layers)
        prepared = self._prepared[key]
        outs = None if prepared is None else backend.matmul_group(self.layers, x2d, prepared)
        if outs is None:
            return None
        return [out.reshape(*lead, out.shape[-1]) for out in outs]  # [..., N_i] each

    def prepared_tensors(self) -> list[Tensor]:
        """The tensors of the stacked layouts (for memory accounting)."""
        return [
            t for p in self._prepared.values() if p for t in p.values() if isinstance(t, Tensor)
        ]


def share_input(layers: list) -> SharedInput | None:
    """Group ``layers`` (packed linears called on one input) if they can be: two or more, the
    same input width and device, no input transform or activation quantizer (each would change
    the input on its own). Returns the group, or None (nothing changed)."""
    if len(layers) < 2 or len({layer.in_features for layer in layers}) != 1:
        return None
    if any(
        layer.input_transform is not None or layer.act_quantizer is not None for layer in layers
    ):
        return None
    if len({b.device for layer in layers for b in layer.buffers()}) != 1:
        return None
    group = SharedInput(layers)
    for layer in layers:
        layer.shared_input = group
    return group
