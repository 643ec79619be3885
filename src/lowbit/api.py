"""The entry points: ``lowbit.quantize(model, recipe, calibration=...)`` and
``lowbit.load_model(spec)`` (any model spec, saved lowbit checkpoints included).

It lives in ``lowbit.api``, not in a module named ``lowbit.quantize``: importing a submodule sets
the package attribute of the same name, which would replace the function ``lowbit.quantize`` by
the module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import LowbitError
from lowbit.files import is_dir
from lowbit.io.checkpoint import load
from lowbit.io.format import is_lowbit_checkpoint
from lowbit.models import loader
from lowbit.models.adapter import adapter_for
from lowbit.recipes.base import QuantizeContext, Recipe
from lowbit.recipes.registry import get_recipe


def quantize(
    model: torch.nn.Module,
    recipe: Recipe | str,
    *,
    calibration: torch.Tensor | None = None,
    filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    progress: bool = True,
    packed: bool = False,
    resume_dir: str | Path | None = None,
    device: torch.device | str | None = None,
    on_transformed: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """Quantize ``model`` in place with ``recipe`` and return it.

    Args:
        model: a Hugging Face causal LM of a supported family.
        recipe: a Recipe, or a method/preset name (``"rtn"``, ``"w4a16-g64"``, ...).
        calibration: [n_samples, seqlen] token ids for methods that calibrate.
        filter_fn: ``filter_fn(module, fqn) -> bool``; block linears for which it is False are
            left in float. None quantizes every block linear the method targets.
        overrides: per-layer settings, ``{fnmatch pattern on the layer's name: {setting:
            value}}``, e.g. ``{"model.layers.0.*": {"w_bits": 8}}``.
        progress: show progress bars.
        packed: hold quantized weights as packed codes (:class:`~lowbit.nn.packed_linear.
            PackedLinear`, the memory a deployment uses) instead of dequantized floats (the
            simulated face, faster for accuracy studies on CPU). Outputs are the same bit for
            bit; :func:`lowbit.nn.packed_linear.pack_model` converts later.
        resume_dir: for methods whose weights are calibrated with GPTQ (``gptq``, ``quarot``
            with ``w_algo=gptq``): write each finished block there, and restore the blocks
            found there from an earlier, interrupted run of the same command (same model,
            recipe, overrides and calibration; else a LowbitError). The result is identical to
            an uninterrupted run. Other methods ignore it.
        device: compute device of calibration (GPTQ's layer-by-layer walk, KVQuant's Fisher
            pass): None = where the model's decoder blocks are. A model on the CPU calibrated
            with ``device="cuda"`` has one block and its captured activations on the GPU at a
            time and stays on the CPU. Calibration token ids may be on any device.
        on_transformed: called with ``model`` when a rotation (``rotate``, ``quarot``) has
            changed its bases and nothing is quantized yet: the float model in the quantized
            model's bases, for comparing the two layer by layer.

    The recipe is recorded on the model as ``model.lowbit_recipe``.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    recipe.validate()
    recipe.check_does_something()  # a recipe built in Python skips with_settings' check
    if getattr(model, "lowbit_recipe", None) is not None:
        raise LowbitError(
            f"this model is already quantized with {model.lowbit_recipe.method!r}; "
            "load a fresh copy to apply another recipe"
        )
    adapter = adapter_for(model)
    device = _compute_device(device)
    if recipe.needs_calibration and calibration is None:
        raise LowbitError(f"recipe {recipe.method!r} needs calibration data (calibration=...)")
    if calibration is not None and (calibration.ndim != 2 or calibration.dtype != torch.long):
        raise LowbitError("calibration must be a [n_samples, seqlen] tensor of token ids")
    if calibration is not None and calibration.numel():
        vocab = model.get_input_embeddings().num_embeddings
        low, high = int(calibration.min()), int(calibration.max())
        if low < 0 or high >= vocab:
            raise LowbitError(
                f"calibration holds the token id {low if low < 0 else high}, outside this "
                f"model's vocabulary (0 to {vocab - 1}); tokenize it with the model's tokenizer"
            )
    context = QuantizeContext(
        adapter=adapter,
        calibration=calibration,
        includes=filter_fn,
        overrides=overrides or {},
        progress=progress,
        resume_dir=resume_dir,
        device=device,
        on_transformed=on_transformed,
    )
    for pattern, values in context.overrides.items():
        recipe.for_layer(**values)  # reject unknown settings before any work is done
        if not any(_matches(name, pattern) for name in adapter.linear_names()):
            raise LowbitError(f"override pattern {pattern!r} matches no layer of this model")
    with torch.no_grad():
        recipe.apply(model, context)
    if packed:
        from lowbit.nn.packed_linear import pack_model

        pack_model(model)
    model.lowbit_recipe = recipe
    return model


def _compute_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a torch.device (None stays None); a name torch does not know, or CUDA where
    there is none, is a LowbitError."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise LowbitError(
            f"device {device!r} is not a torch device name (e.g. cpu, cuda:0)"
        ) from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LowbitError(f"device {str(device)!r} was asked for but this machine has no CUDA")
    return device


def _matches(name: str, pattern: str) -> bool:
    from fnmatch import fnmatchcase

    return fnmatchcase(name, pattern)


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    need_tokenizer: bool = True,
) -> loader.LoadedModel:
    """A model and its tokenizer from any spec :func:`lowbit.models.loader.load_model` takes,
    or from a directory saved by :func:`lowbit.save` (quantized, packed, verified; ``source``
    ``"lowbit"``). ``dtype``: the dtype the model runs in; None is float32 for a float model
    and, for a saved one, the dtype it records (:func:`lowbit.io.checkpoint.run_dtype`).
    ``need_tokenizer=False``: a saved model without a usable tokenizer loads with ``tokenizer``
    None (for what needs only the model, such as ``lowbit info``)."""
    path = None if spec is None else Path(spec).expanduser()
    if path is None or not (is_dir(path) and is_lowbit_checkpoint(path)):
        return loader.load_model(
            spec, dtype=dtype or torch.float32, trust_remote_code=trust_remote_code
        )
    from transformers import AutoTokenizer

    model = load(path, dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        if not need_tokenizer:
            return loader.LoadedModel(model, None, str(path), "lowbit")
        raise LowbitError(f"{path} holds a lowbit model but no usable tokenizer ({err})") from err
    return loader.LoadedModel(model, tokenizer, str(path), "lowbit")
