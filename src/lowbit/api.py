"""The entry points: ``lowbit.quantize(model, recipe, calibration=...)`` and
``lowbit.load_model(spec)`` (any model spec, saved lowbit checkpoints included).

It lives in ``lowbit.api``, not in a module named ``lowbit.quantize``: importing a submodule sets
the package attribute of the same name, which would replace the function ``lowbit.quantize`` by
the module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import LowbitError
from lowbit.files import is_dir
from lowbit.io.checkpoint import load
from lowbit.io.format import is_lowbit_checkpoint
from lowbit.models import loader
from lowbit.models.adapter import adapter_for
from lowbit.models.float_weights import INDEX_FILE
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
    group: Any = None,
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
    recipe, context = _prepare(
        model, recipe, calibration, filter_fn, overrides, progress, resume_dir, device,
        on_transformed, group,
    )  # fmt: skip
    with torch.no_grad():
        recipe.apply(model, context)
    if packed:
        from lowbit.nn.packed_linear import pack_model

        pack_model(model)
    model.lowbit_recipe = recipe
    return model


def _prepare(
    model,
    recipe,
    calibration,
    filter_fn,
    overrides,
    progress,
    resume_dir,
    device,
    on_transformed,
    group=None,
) -> tuple[Recipe, QuantizeContext]:
    """The checks every quantization makes before any work, and the recipe's context."""
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
    if group is not None:
        _check_distributes(recipe, calibration, resume_dir, group)
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
        group=group,
    )
    for pattern, values in context.overrides.items():
        recipe.for_layer(**values)  # reject unknown settings before any work is done
        if not any(_matches(name, pattern) for name in adapter.linear_names()):
            raise LowbitError(f"override pattern {pattern!r} matches no layer of this model")
    return recipe, context


def _check_distributes(recipe: Recipe, calibration, resume_dir, group=None) -> None:
    """Refuse, before any work, what several processes cannot calibrate together (the samples
    are counted once they are known, with the group)."""
    if not recipe.distributes:
        raise LowbitError(
            f"recipe {recipe.method!r} cannot share its calibration between processes (only "
            "gptq can); run it in one process"
        )
    if resume_dir is not None:
        raise LowbitError("a distributed run cannot resume from block checkpoints (--resume-dir)")
    if group is not None:
        group.check_samples(0 if calibration is None else calibration.shape[0])


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


@dataclass
class QuantizeResult:
    """What :func:`quantize_to_directory` did.

    Attributes:
        directory: the checkpoint written.
        recipe: the recipe applied.
        streamed: whether the model was quantized block by block (else whole, in memory).
        seconds: time from the first read to the directory renamed into place.
        dtype: the dtype the checkpoint runs in.
        model: the quantized model (in memory only; None when streamed).
        bits_per_weight: over the block linears (streamed only; in memory,
            :func:`lowbit.eval.memory.memory_report` of ``model`` says it).
        bytes_written: tensor bytes in the checkpoint (streamed only).
        stages: seconds per stage of a streamed run (:class:`lowbit.io.stream.StreamedModel`'s
            ``seconds``: load, forward, solve, pack, write).
        memory: the estimate the choice of path was made on (None for a model spec that is not
            a safetensors directory).
        written: whether this process wrote ``directory`` (False on the ranks other than 0 of a
            distributed run).
    """

    directory: Path
    recipe: Recipe
    streamed: bool
    seconds: float
    dtype: torch.dtype
    model: torch.nn.Module | None = None
    bits_per_weight: float | None = None
    bytes_written: int | None = None
    stages: dict[str, float] = field(default_factory=dict)
    memory: Any = None
    written: bool = True


def quantize_to_directory(
    spec: str | os.PathLike | None,
    recipe: Recipe | str,
    out: str | os.PathLike,
    *,
    calibration: torch.Tensor | Callable[[Any], torch.Tensor] | None = None,
    calibration_shape: tuple[int, int] = (0, 0),
    stream: bool | None = None,
    calib_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
    resume_dir: str | Path | None = None,
    max_shard_size: int | str | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    force: bool = False,
    distributed: bool = False,
) -> QuantizeResult:
    """Quantize the model ``spec`` names with ``recipe`` and write it to ``out`` (what ``lowbit
    quantize`` and the benchmarks run), whole in memory or streamed block by block.

    Args:
        spec: any model spec :func:`load_model` takes; a directory of safetensors can stream.
        recipe: a Recipe or a method/preset name.
        out: the checkpoint directory to write (new or empty).
        calibration: [n_samples, seqlen] token ids, or ``calibration(tokenizer)`` returning
            them (the model's tokenizer is loaded first).
        calibration_shape: ``(samples, seqlen)`` of the calibration, for the memory estimate
            made before anything is read.
        stream: True streams (:mod:`lowbit.io.stream`), False loads the whole model, None
            streams when the in-memory path would not fit this machine's available memory.
        calib_dtype: the dtype blocks are read and calibrated in (float32: the reference;
            bfloat16 halves the memory).
        dtype: the dtype the checkpoint runs in (:func:`lowbit.io.checkpoint.run_dtype`).
        device: calibration device (None: the CPU when streamed, else where the model is).
        overrides, filter_fn, progress: as :func:`quantize`.
        resume_dir: as :func:`quantize`; streamed, the fingerprint's weights digest is of the
            weight files, so a directory written in memory does not resume a streamed run.
        max_shard_size: the most bytes per weights file (None: 1 GB streamed, so the writer
            holds little; 5 GB in memory, transformers' default).
        trust_remote_code: passed to transformers.
        force: replace a regular file at ``out`` (:func:`lowbit.atomic.check_target`).
        distributed: this is one of the processes ``torchrun`` started (gloo on the CPU, NCCL
            when ``device`` is CUDA: each process takes ``cuda:LOCAL_RANK``); they share the
            calibration (:mod:`lowbit.calibrate.distributed`) and only rank 0 writes ``out``,
            equal bit for bit to what one process writes. Every rank returns the result. A
            process group this call starts is ended before it returns or raises; one the caller
            started is left running.

    A run that cannot fit (the in-memory path of a recipe that cannot stream, or the streamed
    path itself) is refused before any work, with the bytes needed and available.
    """
    from lowbit.atomic import atomic_directory, check_target
    from lowbit.io.checkpoint import (
        check_rebuilds,
        finish_checkpoint,
        quantization_config,
        run_dtype,
        save,
        saved_config,
    )
    from lowbit.io.rebuild import expected_tensors, skeleton
    from lowbit.io.shards import ShardWriter, parse_size
    from lowbit.io.stream import available_memory, memory_estimate, open_streamed, quantize_blocks

    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    target = Path(out).expanduser()
    group = None
    if distributed:
        from lowbit.calibrate.distributed import init_from_env

        _check_distributes(recipe, None, resume_dir)  # before joining the group
        device = _compute_device(device)
        group = init_from_env(device)
        if device is not None and device.type == "cuda":
            device = torch.device("cuda", group.local_rank)
    try:  # a process group joined here is left here, however the run ends
        main = group is None or group.is_main
        if main:
            check_target(target, "save to", force=force)  # before the long work
        path = None if spec is None else Path(spec).expanduser()
        streamable = (
            path is not None
            and path.is_dir()
            and not is_lowbit_checkpoint(path)
            and any((path / name).is_file() for name in ("model.safetensors", INDEX_FILE))
        )
        if stream and not streamable:
            raise LowbitError(
                "streamed quantization reads a directory of safetensors weights; "
                f"{'the embedded model' if spec is None else spec} is not one"
            )
        start = time.perf_counter()
        streamed = estimate = None
        if streamable:
            streamed = open_streamed(path, calib_dtype)  # headers only
            estimate = memory_estimate(
                streamed.weights, streamed.adapter, dtype=calib_dtype, tokens=calibration_shape,
                gptq=_solves_by_gptq(recipe),
            )  # fmt: skip
            available = available_memory()
            if stream is None:
                stream = estimate.in_memory > available
            _check_fits(recipe, estimate, available, stream)
        if not stream:
            loaded = load_model(spec, dtype=calib_dtype, trust_remote_code=trust_remote_code)
            if callable(calibration):
                calibration = calibration(loaded.tokenizer)
            model = quantize(
                loaded.model, recipe, calibration=calibration, filter_fn=filter_fn,
                overrides=overrides, progress=progress and main, packed=True, resume_dir=resume_dir,
                device=device, group=group,
            )  # fmt: skip
            dtype = run_dtype(model, dtype)
            if main:
                save(model, target, tokenizer=loaded.tokenizer, dtype=dtype,
                     max_shard_size=max_shard_size or "5GB", force=force)  # fmt: skip
            seconds = time.perf_counter() - start
            return QuantizeResult(
                target, recipe, False, seconds, dtype, model=model, memory=estimate, written=main
            )

        tokenizer = _tokenizer(path)
        if callable(calibration):
            if tokenizer is None:
                raise LowbitError(f"{path} has no tokenizer to tokenize the calibration text with")
            calibration = calibration(tokenizer)
        model = streamed.model
        recipe, context = _prepare(
            model, recipe, calibration, filter_fn, overrides, progress and main, resume_dir, device,
            None, group,
        )  # fmt: skip
        dtype = run_dtype(model, dtype)
        max_shard_bytes = parse_size(max_shard_size or "1GB")
        if not main:  # the other ranks calibrate with rank 0 and write nothing
            quantize_blocks(streamed, recipe, context, lambda tensors: None, dtype)
            return QuantizeResult(
                target, recipe, True, time.perf_counter() - start, dtype,
                stages=dict(streamed.seconds), memory=estimate, written=False,
            )  # fmt: skip
        with atomic_directory(target, verb="save to", force=force) as tmp:  # whole or not at all
            writer = ShardWriter(tmp, max_shard_bytes=max_shard_bytes, spill=True)
            quantize_blocks(streamed, recipe, context, writer.add, dtype)
            qconfig = quantization_config(recipe, streamed.specs)
            expected = expected_tensors(skeleton(model.config, qconfig))
            check_rebuilds(
                expected, {k: torch.empty(s, device="meta") for k, s in streamed.shapes.items()}
            )
            tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
            missing = sorted(set(expected) - set(streamed.shapes) - tied)
            if missing:
                raise LowbitError(f"the streamed model has no tensor {missing[0]!r}; not saved")
            checksums = writer.close()
            finish_checkpoint(
                tmp, saved_config(model, dtype), qconfig, checksums,
                generation_config=_generation_config(path, model), tokenizer=tokenizer,
            )  # fmt: skip
        return QuantizeResult(
            target, recipe, True, time.perf_counter() - start, dtype,
            bits_per_weight=streamed.weight_bits / max(streamed.weight_numel, 1),
            bytes_written=writer.total_bytes, stages=dict(streamed.seconds), memory=estimate,
        )  # fmt: skip
    finally:
        if group is not None:
            group.leave()


GB = 1e9


def _check_fits(recipe: Recipe, estimate, available: int, stream: bool) -> None:
    """Refuse, before any work, a run this machine's memory cannot hold."""
    if stream and not recipe.streams:
        raise LowbitError(
            f"recipe {recipe.method!r} cannot quantize block by block (it needs the whole "
            f"model at once); in memory it needs about {estimate.in_memory / GB:.1f} GB and "
            f"this machine has {available / GB:.1f} GB available"
        )
    needed = estimate.streamed if stream else estimate.in_memory
    if needed > available:
        how = "streamed block by block" if stream else "in memory"
        hint = "" if stream or not recipe.streams else "; stream it (--stream)"
        raise LowbitError(
            f"quantizing this model {how} needs about {needed / GB:.1f} GB of memory and this "
            f"machine has {available / GB:.1f} GB available{hint}"
        )


def _solves_by_gptq(recipe: Recipe) -> bool:
    parts = getattr(recipe, "parts", [recipe])
    return any(
        getattr(part, "gptq_weights", False) or getattr(part, "w_algo", None) == "gptq"
        for part in parts
    )


def _tokenizer(path: Path):
    """The directory's tokenizer, or None when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _generation_config(path: Path, model: torch.nn.Module):
    """The directory's generation config, else the one transformers makes from the config (as
    ``from_pretrained`` does)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return getattr(model, "generation_config", None)
