"""Where a quantized model's error comes from: every block's and every linear's output against
the float model's, on the same tokens.

The reference is the float model *in the quantized model's bases*: a rotation (``rotate``,
``quarot``) changes what the residual stream and some linears hold without changing the
function, so comparing a rotated quantized model with the unrotated float model would measure
the rotation, not the quantization. :func:`layer_error` quantizes a copy of the float model
and takes the copy's state at the moment its rotation is done
(:attr:`lowbit.recipes.base.QuantizeContext.on_transformed`) as the reference; a recipe without
a rotation is compared with the float model itself.

The error of an output ``y`` against its reference ``r`` is ``‖y − r‖² / ‖r‖²`` over every
token: what each block or linear receives includes the error of everything before it, so the
curves show how the error grows through the network and which linears add to it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lowbit.models.adapter import BlockView, adapter_for

__all__ = ["LayerError", "layer_error"]


@dataclass
class LayerError:
    """Relative squared output errors of one recipe, per layer."""

    label: str
    blocks: list[float]  # [L] the residual stream after block l
    linears: dict[str, list[float]]  # linear name ("q_proj", ...) -> [L] its output


@contextmanager
def _capture(model: nn.Module, names: list[str]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the outputs of the named submodules (a block's first output when it returns a
    tuple) while the context is open: name -> one tensor per forward call."""
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    def hook_for(name: str):
        def hook(_module, _inputs, output):
            first = output[0] if isinstance(output, tuple) else output
            outputs[name].append(first.detach().float())

        return hook

    handles = [model.get_submodule(n).register_forward_hook(hook_for(n)) for n in names]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _output_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """Block names and linear names (in the adapter's order) whose outputs are compared."""
    adapter = adapter_for(model)
    blocks = [adapter.block_prefix(i) for i in range(adapter.num_layers)]
    return blocks, adapter.linear_names()


def _run(model: nn.Module, ids: torch.Tensor, names: list[str]) -> dict[str, list[torch.Tensor]]:
    from lowbit.eval.evaluate import window_logits

    with torch.no_grad(), _capture(model, names) as outputs:
        for window in ids:  # [S]
            window_logits(model, window, None)
    return outputs


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want, strict=True))
    den = sum(float(w.pow(2).sum()) for w in want)
    return num / den if den > 0 else float("nan")


def layer_error(
    model: nn.Module,
    recipe,
    ids: torch.Tensor,
    *,
    calibration: torch.Tensor | None = None,
    label: str | None = None,
    progress: bool = False,
) -> LayerError:
    """Quantize a copy of the float ``model`` with ``recipe`` and compare every block's and
    every linear's output with the float reference on ``ids`` ([N, S] token ids).

    ``model`` is left as it was. ``calibration`` ([n, s] token ids) is for recipes that
    calibrate.
    """
    from lowbit.api import quantize
    from lowbit.recipes.registry import get_recipe

    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    transformed: list[nn.Module] = []
    candidate = quantize(
        copy.deepcopy(model),
        recipe,
        calibration=calibration,
        progress=progress,
        on_transformed=lambda m: transformed.append(copy.deepcopy(m)),
    )
    reference = transformed[-1] if transformed else model
    blocks, linears = _output_names(reference)
    want = _run(reference, ids, blocks + linears)
    del reference
    transformed.clear()  # the float copy is freed before the quantized model runs
    got = _run(candidate, ids, blocks + linears)
    per_linear: dict[str, list[float]] = {name: [] for name in BlockView.LINEAR_NAMES}
    for name in linears:
        per_linear[name.rsplit(".", 1)[1]].append(_relative_error(got[name], want[name]))
    return LayerError(
        label=label or recipe.method,
        blocks=[_relative_error(got[name], want[name]) for name in blocks],
        linears=per_linear,
    )
