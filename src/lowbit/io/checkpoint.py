"""lowbit checkpoints: save a quantized model as packed bits, load it back exactly.

The directory's layout and its checks are :mod:`lowbit.io.format`'s; how its JSON describes the
model's structure is :mod:`lowbit.io.rebuild`'s. Everything a recipe calibrated is in the
tensors or the JSON, so loading never recalibrates: the model is built empty from its config (on
the meta device), given lowbit's modules from the specs, its KV cache layout and K-sort RoPE
orders, and then filled. Loading goes through transformers (:mod:`lowbit.io.hf` registers the
``lowbit`` quantization method), so ``AutoModelForCausalLM.from_pretrained(dir)`` and
:func:`load` are the same path, and both verify the files first.

Writes are atomic (a temporary directory beside the target, renamed at the end); nothing is
pickled; ``format_version`` lets a newer lowbit read this format and an older one refuse it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lowbit.atomic import atomic_directory, check_target
from lowbit.errors import LowbitError
from lowbit.io.format import (
    FORMAT_VERSION,
    QUANT_METHOD,
    WEIGHTS_NAME,
    check_format,
    config_checksum,
    file_sha256,
    read_config,
    verify_checkpoint,
)
from lowbit.io.hf import register_with_transformers, verified
from lowbit.io.rebuild import (
    expected_tensors,
    kv_layout_spec,
    module_spec,
    rope_orders,
    skeleton,
)
from lowbit.models.loader import quiet_transformers
from lowbit.nn.packed_linear import packed_format_for, unpack_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.nn.run_linear import check_not_run_form
from lowbit.version import __version__

__all__ = ["save", "check_save_target", "load", "describe", "checkpoint_tensors", "run_dtype"]

#: the dtypes a saved model can be told to run in
RUN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def describe(model: nn.Module) -> dict[str, Any]:
    """lowbit's ``quantization_config`` for ``model`` (everything but the checksums)."""
    recipe = getattr(model, "lowbit_recipe", None)
    if recipe is None:
        raise LowbitError(
            "this model was not quantized by lowbit (lowbit.quantize); nothing to save"
        )
    check_not_run_form(model, "save")
    modules = {}
    for fqn, module in model.named_modules():
        spec = module_spec(module)
        if spec is not None:
            modules[fqn] = spec
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "lowbit_version": __version__,
        "recipe": recipe.to_dict(),
        "modules": modules,
        "kv": kv_layout_spec(model),
        "rope_orders": rope_orders(model),
    }


def checkpoint_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor to store, by state-dict key: simulated quantized linears as their packed
    buffers (the float weight is not stored), shared tensors (tied embeddings) once, on CPU."""
    state = model.state_dict()
    for fqn, module in model.named_modules():
        if isinstance(module, FakeQuantLinear) and module.quantized_weight is not None:
            del state[f"{fqn}.weight"]
            packed = packed_format_for(module.quantized_weight).from_quantized(
                module.quantized_weight
            )
            for name, buffer in packed.named_buffers(recurse=False):
                if buffer is not None:
                    state[f"{fqn}.{name}"] = buffer
    tensors: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, tensor in state.items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if storage in seen and tensor.numel():
            continue  # a tied copy: transformers ties it again from the config on load
        seen.add(storage)
        tensors[key] = tensor.detach().to("cpu").contiguous()
    return tensors


# -- saving ----------------------------------------------------------------------------------------
def check_save_target(target: Path, *, force: bool = False) -> None:
    """Refuse, with one sentence, a save target that is not a new or empty directory (or with
    ``force`` a regular file): see :func:`lowbit.atomic.check_target`."""
    check_target(target, "save to", force=force)


def run_dtype(model: nn.Module, dtype: torch.dtype | str = "auto") -> torch.dtype:
    """The dtype a saved model runs in when it loads (its config's ``dtype``).

    ``"auto"`` is bf16 for a float32 model: torch's packed CPU kernels (int4, int8) and lowbit's
    GPU kernels take bf16 or fp16 activations, and fp32 inputs take the exact path, several
    times slower (:mod:`lowbit.kernels.torch_cpu`). A bf16 or fp16 model keeps its dtype.
    """
    if dtype == "auto":
        return torch.bfloat16 if model.dtype == torch.float32 else model.dtype
    if dtype not in RUN_DTYPES:
        raise LowbitError(f"a saved model runs in bfloat16, float16 or float32, not {dtype}")
    return dtype


def saved_config(model: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """``model.config`` as a JSON dict as it will read back, with ``dtype`` as the dtype the
    model loads in (the stored tensors keep their own)."""
    config = json.loads(json.dumps(model.config.to_dict()))
    config["dtype"] = str(dtype).removeprefix("torch.")
    return config


def save(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    tokenizer=None,
    dtype: torch.dtype | str = "auto",
    force: bool = False,
) -> Path:
    """Write ``model`` (quantized by lowbit, either face) as a checkpoint directory.

    Args:
        model: a model ``lowbit.quantize`` returned (or one loaded from a checkpoint).
        directory: where to write; must not exist or be empty.
        tokenizer: saved beside the model when given.
        dtype: the dtype the model runs in when loaded (:func:`run_dtype`; ``"auto"``: bf16
            for a float32 model). The float tensors are stored as they are, so ``load(...,
            dtype=torch.float32)`` still gives the exact float32 model.
        force: replace a regular file at ``directory`` (:func:`lowbit.atomic.check_target`).

    Returns:
        The directory's path.
    """
    from safetensors.torch import save_file

    target = Path(directory).expanduser()
    check_save_target(target, force=force)
    dtype = run_dtype(model, dtype)
    qconfig = describe(model)
    tensors = checkpoint_tensors(model)
    _check_rebuilds(model.config, qconfig, tensors)
    with atomic_directory(target, verb="save to", force=force) as tmp:  # whole or not at all
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        config = saved_config(model, dtype)
        config["quantization_config"] = qconfig
        qconfig["checksums"] = {
            WEIGHTS_NAME: file_sha256(tmp / WEIGHTS_NAME),
            "config.json": config_checksum(config),
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return target


def _check_rebuilds(config, qconfig: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Before writing: the model rebuilt from ``qconfig`` must take exactly ``tensors`` (a key,
    shape or dtype lowbit could not restore would otherwise load as garbage)."""
    expected = expected_tensors(skeleton(config, qconfig))
    for key, tensor in tensors.items():
        if key not in expected:
            raise LowbitError(f"lowbit cannot rebuild the module holding {key!r}; not saved")
        if expected[key][0] != tuple(tensor.shape):
            raise LowbitError(
                f"{key!r} would be rebuilt with shape {expected[key][0]}, not "
                f"{tuple(tensor.shape)}; not saved"
            )


# -- loading ---------------------------------------------------------------------------------------
def load(
    directory: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    packed: bool = True,
    verify: bool = True,
) -> nn.Module:
    """Load a lowbit checkpoint: the quantized model, exactly as it was saved.

    Args:
        directory: a directory written by :func:`save` (``lowbit quantize --out``).
        device: where to put the model (None: CPU).
        dtype: the dtype the model runs in (its float parameters and activations; the packed
            buffers keep theirs). None: the one the checkpoint records (bf16 for a model
            quantized in float32, :func:`run_dtype`); ``torch.float32`` for the exact path.
        packed: keep weights packed (True) or expand them to the simulated face (False).
        verify: check the files (keys, shapes, dtypes, checksum) before loading.

    Returns:
        The model in eval mode, with ``lowbit_recipe`` (and ``lowbit_kv`` /
        ``lowbit_make_cache`` when it has a quantized KV cache).
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise LowbitError(f"{directory} is not a directory")
    if verify:
        verify_checkpoint(directory)
    else:
        check_format(read_config(directory).get("quantization_config"), str(directory))
    register_with_transformers()
    kwargs = {} if dtype is None else {"dtype": dtype}
    with quiet_transformers(), verified(directory):
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    if device is not None:
        model = model.to(device)
    if not packed:
        unpack_model(model)
    return model.eval()
