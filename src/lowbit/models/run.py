"""Get a quantized model ready to run on the CPU: what no checkpoint stores, done once.

* SpQR and 2/4/16 layers, which no packed CPU kernel multiplies, run from their weight decoded
  once in the run's dtype, which replaces their packed buffers
  (:func:`lowbit.nn.decoded_linear.decode_for_run`);
* the packed projections of one input (q/k/v, gate/up) are multiplied in one kernel call
  (:mod:`lowbit.nn.shared_input`).

Outputs are unchanged bit for bit; ``lowbit eval``, ``generate`` and ``info`` call
:func:`prepare_run`, so what ``eval`` measures is what ``generate`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lowbit.models.adapter import adapter_for
from lowbit.nn.decoded_linear import decode_for_run
from lowbit.nn.packed_linear import PackedLinearBase
from lowbit.nn.shared_input import share_input

__all__ = ["RunPreparation", "prepare_run", "share_projection_inputs"]


@dataclass(frozen=True)
class RunPreparation:
    decoded: int  # layers decoded for the run
    shared: int  # groups of projections multiplied in one call


def share_projection_inputs(model: nn.Module) -> int:
    """Group each block's q/k/v and gate/up projections where all are packed linears on the
    CPU that can share a call (:func:`~lowbit.nn.shared_input.share_input`). Returns the
    number of groups."""
    groups = 0
    for block in adapter_for(model).blocks():
        for layers in (
            [block.q_proj, block.k_proj, block.v_proj],
            [block.gate_proj, block.up_proj],
        ):
            packed = all(isinstance(layer, PackedLinearBase) for layer in layers)
            on_cpu = packed and all(b.is_cpu for layer in layers for b in layer.buffers())
            if on_cpu and not any("shared_input" in layer.__dict__ for layer in layers):
                groups += share_input(layers) is not None
    return groups


def prepare_run(model: nn.Module) -> RunPreparation:
    """:func:`decode_for_run`, then :func:`share_projection_inputs`; in place."""
    return RunPreparation(decode_for_run(model), share_projection_inputs(model))
