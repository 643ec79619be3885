"""Get a quantized model ready to run where it is: what no checkpoint stores, done once.

In a bf16 or fp16 run every packed layer that its backend computes from another form of its
weight is swapped for that form, which replaces its packed buffers
(:mod:`lowbit.nn.run_linear`):

* on the CPU, SpQR and 2/4/16 layers, which no packed CPU kernel multiplies, run from their
  weight decoded once in the run's dtype (:func:`~lowbit.nn.run_linear.decode_for_run`);
* the layers torch's int4/int8 CPU kernels run, and on a GPU the layers the triton backend's
  integer kernels run, keep only the kernel's layout, the projections of one input (each
  block's q/k/v and gate/up) one stacked layout multiplied in one call
  (:func:`~lowbit.nn.run_linear.kernel_form`).

Every packed layer left (SpQR and 2/4/16 on a GPU, whose kernels read the packed buffers
themselves, or any layer in an fp32 run) has its backend's layout prepared in advance
(:func:`~lowbit.kernels.dispatch.prepare_layer`), so that the first call of a compiled step,
CUDA graphs included, allocates nothing it keeps.

Outputs are unchanged bit for bit (on a GPU up to the order of the stacked kernels' fp32
sums); ``lowbit eval``, ``generate`` and ``info`` call
:func:`prepare_run`, so what ``eval`` measures is what ``generate`` runs. An fp32 run keeps the
packed layers (their exact path reads the codes).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lowbit.kernels.dispatch import prepare_layer
from lowbit.models.adapter import adapter_for
from lowbit.nn.packed_linear import PackedLinearBase
from lowbit.nn.run_linear import decode_for_run, kernel_form

__all__ = ["RunPreparation", "prepare_run", "prepare_layouts", "projection_groups"]


@dataclass(frozen=True)
class RunPreparation:
    decoded: int  # layers decoded for the run
    kernel: int  # layers that keep only a kernel's layout
    shared: int  # of those, groups of projections multiplied in one call


def projection_groups(model: nn.Module) -> list[list[PackedLinearBase]]:
    """Each block's q/k/v and gate/up projections where packed, then every other packed layer
    on its own."""
    groups = []
    for block in adapter_for(model).blocks():
        for layers in (
            [block.q_proj, block.k_proj, block.v_proj],
            [block.gate_proj, block.up_proj],
        ):
            groups.append([layer for layer in layers if isinstance(layer, PackedLinearBase)])
    grouped = {id(layer) for group in groups for layer in group}
    alone = [
        [m] for m in model.modules() if isinstance(m, PackedLinearBase) and id(m) not in grouped
    ]
    return [group for group in groups if group] + alone


def prepare_run(model: nn.Module) -> RunPreparation:
    """:func:`decode_for_run`, then :func:`kernel_form` over :func:`projection_groups`, then
    :func:`prepare_layouts`; in place."""
    decoded = decode_for_run(model)
    kernel, shared = kernel_form(model, projection_groups(model))
    prepare_layouts(model)
    return RunPreparation(decoded, kernel, shared)


def prepare_layouts(model: nn.Module) -> None:
    """:func:`~lowbit.kernels.dispatch.prepare_layer` for every packed layer, in the model's
    dtype."""
    for module in model.modules():
        if isinstance(module, PackedLinearBase):
            prepare_layer(module, model.dtype)
