"""Evaluate a model under several recipes: what ``lowbit eval`` and ``lowbit demo`` print.

:func:`evaluate_recipes` loads the model once, evaluates each recipe on a copy of it (quantized,
calibrated where the method needs it) against the float model on the same windows, and
returns one row per recipe: perplexity, KL, top-1, bits per weight, bytes, times. The command
line only parses options and prints these rows; benchmarks call this function directly.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import LowbitError
from lowbit.recipes.base import Recipe

__all__ = ["evaluate_recipes", "check_backend", "use_backend"]


def check_backend(name: str) -> None:
    """Refuse, with one sentence, a backend name that no packed format knows."""
    from lowbit.kernels.dispatch import backend_names

    if name not in backend_names():
        raise LowbitError(f"unknown backend {name!r}; choose one of {', '.join(backend_names())}")


def use_backend(model: torch.nn.Module, name: str) -> int:
    """Put ``model``'s packed linears on backend ``name``; returns how many there are.

    ``auto`` leaves a simulated model (``FakeQuantLinear``, float weights: the fast path on CPU)
    as it is; any other name packs it first, so the named backend is what computes.
    """
    from lowbit.nn.packed_linear import pack_model, set_backend

    if name != "auto":
        pack_model(model)
    return set_backend(model, name)


def _labelled(recipes: Sequence[Recipe | str | tuple[str, Recipe]]) -> list[tuple[str, Recipe]]:
    """(label, recipe) pairs: a name is looked up (and is its own label), a recipe is labelled
    by its method."""
    from lowbit.recipes.registry import get_recipe

    pairs = []
    for item in recipes:
        if isinstance(item, tuple):
            pairs.append(item)
        elif isinstance(item, str):
            pairs.append((item, get_recipe(item)))
        else:
            pairs.append((item.method, item))
    return pairs


def _is_compressed_tensors(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded from a compressed-tensors directory."""
    quantization = getattr(model.config, "quantization_config", None)
    method = getattr(quantization, "quant_method", None)
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    return str(getattr(method, "value", method)) == "compressed-tensors"


def evaluate_recipes(
    model: str | os.PathLike | None,
    recipes: Sequence[Recipe | str | tuple[str, Recipe]],
    *,
    dataset: str = "pydoc",
    seqlen: int = 2048,
    windows: int | None = None,
    calib: str = "pydoc",
    calib_samples: int = 16,
    calib_seqlen: int | None = None,
    calib_skip: int = 0,
    seed: int = 0,
    chunk: int | None = None,
    kv_context: int = 2048,
    backend: str = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    resume_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    reference: str | os.PathLike | None = None,
    stream: bool | None = None,
) -> list[dict[str, Any]]:
    """Quantize the model with each recipe and evaluate it on the same windows.

    Cheap checks (recipes, backend, corpora) come before the model loads. A model saved by
    lowbit is evaluated as it is (one row, no float reference to compare with).

    Args:
        model: any spec :func:`lowbit.load_model` takes (None: the embedded model).
        recipes: names (methods, presets, compositions), Recipe objects, or (label, recipe)
            pairs; one row each, in order.
        dataset: evaluation corpus (``pydoc``, ``wikitext2`` or a text file).
        seqlen: tokens per window.
        windows: evaluate only the first N windows (None: all).
        calib: calibration corpus for the recipes that calibrate.
        calib_samples: calibration windows.
        calib_seqlen: tokens per calibration window (None: ``seqlen``).
        calib_skip: skip the first N windows of the calibration corpus.
        seed: seeds calibration sampling and torch's generator.
        chunk: feed each window in chunks of this many tokens through the KV cache (None: one
            pass per window).
        kv_context: context length at which KV-cache bytes per token are stated.
        backend: how packed linears multiply (``auto``, ``reference``, ``torch-cpu``, ...).
        device: where the model runs (None: the CPU, where it loads).
        dtype: the dtype the model runs in (None: float32 for a float model, the recorded one
            for a saved lowbit model: :func:`lowbit.load_model`); each row says which.
        resume_dir: block checkpoints of a GPTQ run (one GPTQ recipe at most).
        trust_remote_code: passed to transformers.
        progress: show progress bars.
        reference: the float model to compare ``model`` with, evaluated as it is (one row): a
            compressed-tensors export is the file that ships (lowbit's loader applies its
            transforms), so its row is of that file. An export is compared with the embedded
            model when no reference is given.
        stream: evaluate a lowbit checkpoint against a float reference directory layer-major,
            neither model whole in memory (:mod:`lowbit.eval.streamed`): True streams, False
            loads both, None streams when loading both would not fit this machine's available
            memory. Only a checkpoint with a safetensors reference directory streams.

    Returns:
        One dict per recipe: ``model``, ``recipe`` (its ``to_dict()``), ``label``, ``dataset``,
        ``seqlen``, ``windows``, ``tokens``, ``ppl``, ``kl``, ``top1``, ``bits_per_weight``,
        ``model_bytes``, ``kv_bytes_per_token``, ``kv_context``, ``calibration``, ``chunk``,
        ``backend``, ``dtype``, ``quantize_seconds`` (of which ``train_seconds`` trained a
        learned rotation), ``eval_seconds``, ``seconds``.
    """
    from lowbit.api import load_model, quantize
    from lowbit.data import calibration_samples, eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import FloatReference, evaluate
    from lowbit.eval.memory import memory_report
    from lowbit.models.adapter import adapter_for
    from lowbit.models.run import prepare_run

    labelled = _labelled(recipes)
    if not labelled:
        raise LowbitError("no recipe to evaluate")
    resumable = [r for _, r in labelled if getattr(r, "gptq_weights", False)]
    if resume_dir is not None and len(resumable) > 1:
        raise LowbitError(
            f"--resume-dir holds the blocks of one run, but {len(resumable)} recipes calibrate "
            "with GPTQ; give it with one of them"
        )
    if chunk is not None and chunk < 1:
        raise LowbitError(f"--chunk must be at least 1, not {chunk}")
    check_backend(backend)
    device = torch.device("cpu") if device is None else torch.device(device)
    torch.manual_seed(seed)
    corpus = load_corpus(dataset, part="eval")  # cheap checks before the model loads
    calib_corpus = None
    if any(r.needs_calibration for _, r in labelled):
        calib_corpus = load_corpus(calib, part="calibration")

    if stream is not False:
        rows = _evaluate_streamed_if_chosen(
            model, reference, labelled, stream, corpus=corpus, seqlen=seqlen, windows=windows,
            chunk=chunk, kv_context=kv_context, backend=backend, device=device, dtype=dtype,
            progress=progress,
        )  # fmt: skip
        if rows is not None:
            return rows
    loaded = load_model(model, dtype=dtype, trust_remote_code=trust_remote_code)
    base, tokenizer = loaded.model.to(device), loaded.tokenizer  # loaded on the CPU
    adapter = adapter_for(base)
    if adapter.max_context and seqlen > adapter.max_context:
        raise LowbitError(
            f"--seqlen {seqlen} is larger than the model's context ({adapter.max_context})"
        )
    ids = eval_windows(tokenize(tokenizer, corpus.text), seqlen, windows).to(device)  # [N, S]
    calibration = None
    if calib_corpus is not None:
        calibration = calibration_samples(  # [calib_samples, calib_seqlen]
            tokenize(tokenizer, calib_corpus.text),
            calib_samples,
            seqlen if calib_seqlen is None else calib_seqlen,
            seed=seed,
            skip_windows=calib_skip,
        )

    saved = getattr(base, "lowbit_recipe", None)  # a lowbit checkpoint: already quantized
    exported = _is_compressed_tensors(base)
    float_model = None
    if reference is not None or exported:
        what = "a compressed-tensors export" if exported else f"{loaded.name}"
        if any(recipe.method != "fp" for _, recipe in labelled):
            raise LowbitError(
                f"with a float reference, {what} is evaluated as it is; drop --recipe"
            )
        float_loaded = load_model(reference, trust_remote_code=trust_remote_code)
        float_model = float_loaded.model.to(device)
        if float_model.config.vocab_size != base.config.vocab_size:
            raise LowbitError(
                f"the reference {float_loaded.name} has a vocabulary of "
                f"{float_model.config.vocab_size} tokens and {loaded.name} one of "
                f"{base.config.vocab_size}: they are not the same model"
            )
        label = "compressed-tensors export" if exported else "as loaded"
        labelled = [(label, labelled[0][1])]
    if saved is not None:
        if any(recipe.method != "fp" for _, recipe in labelled):
            raise LowbitError(
                f"{loaded.name} is already quantized ({saved.method}); evaluate it without "
                "--recipe, or quantize the float model instead"
            )
        labelled = [(f"{saved.method} (saved)", saved)]
    if float_model is not None:
        float_reference = FloatReference(float_model)
    else:  # a lowbit checkpoint has no float model to compare with
        float_reference = None if saved is not None else FloatReference(base)
    rows = []
    for label, recipe in labelled:
        start = time.perf_counter()
        if recipe.method == "fp" or saved is not None:
            candidate = base
        else:
            candidate = copy.deepcopy(base)
            quantize(
                candidate, recipe, calibration=calibration, progress=progress,
                resume_dir=resume_dir,
            )  # fmt: skip
        quantize_seconds = time.perf_counter() - start
        training = getattr(candidate, "lowbit_rotation_training", None)  # learn-rotate's loop
        use_backend(candidate, backend)
        prepare_run(candidate)  # what generate runs: lowbit.models.run
        result = evaluate(
            candidate,
            ids,
            reference=float_reference,
            chunk=chunk,
            progress=progress,
            desc=label[:30],
        )
        candidate_adapter = adapter_for(candidate)
        memory = memory_report(candidate, candidate_adapter, kv_context=kv_context)
        used_calibration = None
        if calibration is not None and recipe.needs_calibration:
            used_calibration = {
                "corpus": calib,
                "samples": calibration.shape[0],
                "seqlen": calibration.shape[1],
                "skip_windows": calib_skip,
                "seed": seed,
            }
        rows.append(
            {
                "model": loaded.name,
                "recipe": recipe.to_dict(),
                "label": label,
                "dataset": corpus.name,
                "seqlen": seqlen,
                **_measured(result, memory, candidate, candidate_adapter),
                "calibration": used_calibration,
                "chunk": chunk,
                "backend": backend,
                "dtype": str(candidate.dtype).removeprefix("torch."),
                "quantize_seconds": quantize_seconds,
                "train_seconds": 0.0 if training is None else training.seconds,
                "eval_seconds": result.seconds,
                "seconds": quantize_seconds + result.seconds,
                "streamed": False,
            }
        )
        del candidate  # the quantized copy, before the next one is made
    return rows


def _streams(model: str | os.PathLike | None, reference: str | os.PathLike | None) -> bool:
    """Whether ``model`` is a lowbit checkpoint and ``reference`` a float directory of
    safetensors: the pair streamed evaluation takes."""
    from lowbit.files import is_dir
    from lowbit.io.format import is_lowbit_checkpoint
    from lowbit.models.float_weights import INDEX_FILE, SINGLE_FILE

    if model is None or reference is None:
        return False
    path, ref = Path(model).expanduser(), Path(reference).expanduser()
    return (
        is_dir(path)
        and is_lowbit_checkpoint(path)
        and is_dir(ref)
        and not is_lowbit_checkpoint(ref)
        and any((ref / name).is_file() for name in (SINGLE_FILE, INDEX_FILE))
    )


def _evaluate_streamed_if_chosen(
    model, reference, labelled, stream, *, corpus, seqlen, windows, chunk, kv_context, backend,
    device, dtype, progress,
) -> list[dict[str, Any]] | None:  # fmt: skip
    """The row of a streamed evaluation (:mod:`lowbit.eval.streamed`) when ``stream`` is True,
    or None and the estimate says both models fit in memory; None when the pair cannot stream
    and ``stream`` is None (the in-memory path then runs, or refuses)."""
    from transformers import AutoTokenizer

    from lowbit.data import eval_windows, tokenize
    from lowbit.eval.memory import memory_report
    from lowbit.eval.streamed import check_streamable, eval_memory_estimate, evaluate_streamed
    from lowbit.io.stream import available_memory
    from lowbit.models.adapter import adapter_for

    if not _streams(model, reference):
        if stream:
            raise LowbitError(
                "--stream evaluates a lowbit checkpoint (--model DIR) against its float model's "
                "directory of safetensors (--reference DIR)"
            )
        return None
    if any(recipe.method != "fp" for _, recipe in labelled):
        raise LowbitError(f"{model} is already quantized; evaluate it without --recipe")
    if stream:  # refusals of an explicit --stream; an automatic choice falls back instead
        check_streamable(model)
        if chunk is not None:
            raise LowbitError("--chunk feeds a KV cache; streamed evaluation runs whole windows")
        if torch.device(device).type != "cpu":
            raise LowbitError("streamed evaluation runs on the CPU; drop --device or --stream")
    elif chunk is not None or torch.device(device).type != "cpu":
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(Path(model).expanduser())
    except (OSError, ValueError) as err:
        raise LowbitError(f"{model} holds a lowbit model but no usable tokenizer ({err})") from err
    ids = eval_windows(tokenize(tokenizer, corpus.text), seqlen, windows)  # [N, S]
    estimate = eval_memory_estimate(reference, model, ids.shape[0], seqlen)
    available = available_memory()
    if stream is None:
        if estimate.in_memory <= available:
            return None
        try:
            check_streamable(model)
        except LowbitError:
            return None  # a quantized KV cache: in memory, or its own refusal there
    if estimate.streamed > available:
        raise LowbitError(
            f"evaluating this model streamed needs about {estimate.streamed / 1e9:.1f} GB of "
            f"memory and this machine has {available / 1e9:.1f} GB available"
        )
    result, candidate = evaluate_streamed(
        model, reference, ids, dtype=dtype, backend=backend, progress=progress
    )
    candidate_adapter = adapter_for(candidate)
    memory = memory_report(candidate, candidate_adapter, kv_context=kv_context)
    saved = candidate.lowbit_recipe
    return [
        {
            "model": str(model),
            "recipe": saved.to_dict(),
            "label": f"{saved.method} (saved, streamed)",
            "dataset": corpus.name,
            "seqlen": seqlen,
            **_measured(result, memory, candidate, candidate_adapter),
            "calibration": None,
            "chunk": None,
            "backend": backend,
            "dtype": str(candidate.dtype).removeprefix("torch."),
            "quantize_seconds": 0.0,
            "train_seconds": 0.0,
            "eval_seconds": result.seconds,
            "seconds": result.seconds,
            "streamed": True,
        }
    ]


def _measured(result, memory, candidate, adapter) -> dict:
    """A row's measured fields: the evaluation's numbers and the candidate's stored bytes."""
    from lowbit.eval.memory import KV_CONTEXTS, kv_bytes_per_token

    return {
        "windows": result.windows,
        "tokens": result.tokens,
        "ppl": result.ppl,
        "kl": result.kl,
        "top1": result.top1,
        "bits_per_weight": memory.bits_per_weight,
        "model_bytes": memory.model_bytes,
        "kv_bytes_per_token": memory.kv_bytes_per_token,
        "kv_context": memory.kv_context,
        "kv_bytes_by_context": {
            str(c): kv_bytes_per_token(candidate, adapter, c) for c in KV_CONTEXTS
        },
    }
