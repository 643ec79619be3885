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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lowbit.atomic import atomic_directory, check_target
from lowbit.errors import LowbitError
from lowbit.io.format import (
    FORMAT_VERSION,
    QUANT_METHOD,
    check_format,
    config_checksum,
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
from lowbit.io.shards import DEFAULT_SHARD_BYTES, ShardWriter, parse_size
from lowbit.models.loader import quiet_transformers
from lowbit.nn.packed_linear import packed_format_for, unpack_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.nn.run_linear import check_not_run_form
from lowbit.version import __version__

__all__ = [
    "save",
    "check_save_target",
    "finish_checkpoint",
    "check_rebuilds",
    "load",
    "describe",
    "module_specs",
    "quantization_config",
    "checkpoint_tensors",
    "checkpoint_tensor_groups",
    "stored_form",
    "saved_config",
    "run_dtype",
]

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
    return quantization_config(
        recipe, module_specs(model), kv=kv_layout_spec(model), rope=rope_orders(model)
    )


def module_specs(module: nn.Module, prefix: str = "") -> dict[str, dict[str, Any]]:
    """``{fqn: spec}`` of the lowbit modules in ``module`` (names under ``prefix``, e.g.
    ``"model.layers.3"`` for a block)."""
    specs = {}
    for fqn, child in module.named_modules(prefix=prefix):
        spec = module_spec(child)
        if spec is not None:
            specs[fqn] = spec
    return specs


def quantization_config(
    recipe, modules: dict[str, dict[str, Any]], *, kv=None, rope=None
) -> dict[str, Any]:
    """lowbit's ``quantization_config`` from its parts (the checksums are added on writing)."""
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "lowbit_version": __version__,
        "recipe": recipe.to_dict(),
        "modules": modules,
        "kv": kv,
        "rope_orders": rope or {},
    }


def stored_form(tensor: Tensor, run: torch.dtype | None) -> Tensor:
    """A float parameter as a checkpoint stores it: in ``run``, the dtype the model runs in, when
    it is float32 and ``run`` holds every one of its values exactly (a bf16 source's embeddings,
    norms and head that no recipe changed), else as it is. The file then holds what the model
    runs and ``load(..., dtype=torch.float32)`` still gives the float32 numbers back."""
    if run is None or run == torch.float32 or tensor.dtype != torch.float32:
        return tensor
    narrowed = tensor.to(run)
    flat, flat_narrowed = tensor.reshape(-1), narrowed.reshape(-1)  # [n] views
    step = 1 << 22  # compared 4M values at a time: no whole float32 copy beside the tensor
    for lo in range(0, flat.numel(), step):
        if not torch.equal(flat_narrowed[lo : lo + step].float(), flat[lo : lo + step]):
            return tensor
    return narrowed


def checkpoint_tensor_groups(
    model: nn.Module, prefix: str = "", run: torch.dtype | None = None
) -> Iterator[dict[str, Tensor]]:
    """Every tensor to store, by state-dict key, a module's worth at a time: simulated quantized
    linears as their packed buffers, packed one at a time as their turn comes (the float weight is
    not stored), shared tensors (tied embeddings) once, float parameters in their
    :func:`stored_form` for ``run`` (None: as they are). Tensors may be on any device; the
    writer (:class:`lowbit.io.shards.ShardWriter`) stores them on CPU. ``prefix``: the name of
    ``model`` inside the whole model, for one block (``"model.layers.3"``)."""
    state = model.state_dict(prefix=f"{prefix}." if prefix else "")
    parameters = {key for key, _ in model.named_parameters(prefix=prefix, remove_duplicate=False)}
    simulated = {
        f"{fqn}.weight": module
        for fqn, module in model.named_modules(prefix=prefix)
        if isinstance(module, FakeQuantLinear) and module.quantized_weight is not None
    }
    seen: set[tuple[int, int]] = set()
    for key, tensor in state.items():
        module = simulated.get(key)
        if module is not None:
            packed = packed_format_for(module.quantized_weight).from_quantized(
                module.quantized_weight
            )
            fqn = key.removesuffix(".weight")
            yield {
                f"{fqn}.{name}": buffer.detach()
                for name, buffer in packed.named_buffers(recurse=False)
                if buffer is not None
            }
            continue
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if storage in seen and tensor.numel():
            continue  # a tied copy: transformers ties it again from the config on load
        seen.add(storage)
        yield {key: stored_form(tensor.detach(), run) if key in parameters else tensor.detach()}


def checkpoint_tensors(
    model: nn.Module, prefix: str = "", run: torch.dtype | None = None
) -> dict[str, Tensor]:
    """Every tensor to store, by state-dict key, on CPU (:func:`checkpoint_tensor_groups` in one
    dict)."""
    tensors: dict[str, Tensor] = {}
    for group in checkpoint_tensor_groups(model, prefix, run):
        tensors.update({key: t.to("cpu").contiguous() for key, t in group.items()})
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
    max_shard_size: int | str = DEFAULT_SHARD_BYTES,
    force: bool = False,
) -> Path:
    """Write ``model`` (quantized by lowbit, either face) as a checkpoint directory.

    Args:
        model: a model ``lowbit.quantize`` returned (or one loaded from a checkpoint).
        directory: where to write; must not exist or be empty.
        tokenizer: saved beside the model when given.
        dtype: the dtype the model runs in when loaded (:func:`run_dtype`; ``"auto"``: bf16
            for a float32 model). A float parameter is stored in it only where that loses
            nothing (:func:`stored_form`), so ``load(..., dtype=torch.float32)`` still gives the
            exact float32 model.
        max_shard_size: the most tensor bytes one weights file holds, as a number or a string
            such as ``"2GB"`` (:func:`lowbit.io.shards.parse_size`); a larger model is written
            as Hugging Face's shards and index. The default, 5 GB, is transformers' own.
        force: replace a regular file at ``directory`` (:func:`lowbit.atomic.check_target`).

    Returns:
        The directory's path.
    """
    target = Path(directory).expanduser()
    check_save_target(target, force=force)
    max_shard_bytes = parse_size(max_shard_size)
    dtype = run_dtype(model, dtype)
    qconfig = describe(model)
    expected = expected_tensors(skeleton(model.config, qconfig))
    with atomic_directory(target, verb="save to", force=force) as tmp:  # whole or not at all
        writer = ShardWriter(tmp, max_shard_bytes=max_shard_bytes)
        for tensors in checkpoint_tensor_groups(model, run=dtype):
            check_rebuilds(expected, tensors)  # a refusal here removes the temporary directory
            writer.add(tensors)
        finish_checkpoint(
            tmp,
            saved_config(model, dtype),
            qconfig,
            writer.close(),
            generation_config=getattr(model, "generation_config", None),
            tokenizer=tokenizer,
        )
    return target


def finish_checkpoint(
    directory: Path,
    config: dict[str, Any],
    qconfig: dict[str, Any],
    weight_checksums: dict[str, str],
    *,
    generation_config=None,
    tokenizer=None,
) -> None:
    """Write config.json (``config`` with ``quantization_config = qconfig`` and its checksums:
    every weights file's sha256 and the config's own), generation_config and tokenizer into
    ``directory`` (the atomic temporary directory).

    Args:
        directory: the directory the weights were written into (:class:`ShardWriter`).
        config: the model's config as a JSON dict (:func:`saved_config`).
        qconfig: lowbit's part (:func:`describe`), without checksums; not changed.
        weight_checksums: ``{file name: sha256}`` of the weights files
            (:meth:`ShardWriter.close`).
        generation_config: a transformers ``GenerationConfig``, saved when given.
        tokenizer: saved when given.
    """
    config = dict(config)
    config["quantization_config"] = qconfig = dict(qconfig)
    qconfig["checksums"] = {**weight_checksums, "config.json": config_checksum(config)}
    (Path(directory) / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n"
    )
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def check_rebuilds(
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]], tensors: dict[str, Tensor]
) -> None:
    """Before writing: the model rebuilt from the checkpoint's JSON (``expected``:
    :func:`lowbit.io.rebuild.expected_tensors` of its :func:`~lowbit.io.rebuild.skeleton`) must
    take ``tensors`` (a key or shape lowbit could not restore would otherwise load as garbage)."""
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
