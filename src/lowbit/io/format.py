"""The lowbit checkpoint format: its names, and the checks of a directory before it loads.

A checkpoint is a Hugging Face–style directory::

    config.json          the model's config; ``quantization_config`` holds lowbit's part:
                         {"quant_method": "lowbit", "format_version": 1, "recipe": {...},
                          "modules": {fqn: spec}, "kv": {...} | null, "rope_orders": {...},
                          "checksums": {"model.safetensors": sha256, "config.json": sha256}}
    model.safetensors    every tensor: packed weights (qdata, scale, zero), float parameters,
                         calibrated KV state (codebooks, ranges, channel orders)
    tokenizer files, generation_config.json

:func:`verify_checkpoint` checks a directory before it loads: the checksums recorded
at save time, then every tensor the described model needs (key, shape, dtype), none extra, and
every float tensor finite. Every
path that loads lowbit weights goes through it (:func:`lowbit.io.checkpoint.load` and
transformers' ``from_pretrained``, :mod:`lowbit.io.hf`), so a damaged or edited checkpoint is
one sentence, never a silently different model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from lowbit.checksum import file_sha256
from lowbit.errors import LowbitError
from lowbit.files import is_file, read_bytes, read_text

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "WEIGHTS_NAME",
    "read_config",
    "config_checksum",
    "file_sha256",
    "check_format",
    "is_lowbit_checkpoint",
    "verify_checkpoint",
    "check_finite",
]

FORMAT_VERSION = 1
QUANT_METHOD = "lowbit"
WEIGHTS_NAME = "model.safetensors"


def config_checksum(config: dict[str, Any]) -> str:
    """SHA-256 of the config as canonical JSON, its own checksums left out."""
    config = dict(config)
    qconfig = dict(config.get("quantization_config") or {})
    qconfig.pop("checksums", None)
    config["quantization_config"] = qconfig
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not is_file(path):
        raise LowbitError(f"{directory} has no config.json: not a model directory")
    try:
        config = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise LowbitError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise LowbitError(f"{path} does not hold a JSON object")
    return config


def is_lowbit_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` has a config.json whose quantization method is lowbit's; a
    directory or config.json this user cannot read is a LowbitError naming it."""
    path = Path(directory) / "config.json"
    if not is_file(path):
        return False
    raw = read_bytes(path)  # unreadable: a sentence, not "not a lowbit checkpoint"
    try:
        qconfig = json.loads(raw.decode("utf-8")).get("quantization_config")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False
    return isinstance(qconfig, dict) and qconfig.get("quant_method") == QUANT_METHOD


def check_format(qconfig: Any, where: str) -> None:
    """Refuse a quantization_config this lowbit cannot read, with one sentence."""
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") != QUANT_METHOD:
        raise LowbitError(f"{where} is not a lowbit checkpoint")
    version = qconfig.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise LowbitError(f"{where} has no valid lowbit format_version")
    if version > FORMAT_VERSION:
        raise LowbitError(
            f"{where} was written by a newer lowbit (checkpoint format {version}); this lowbit "
            f"reads format {FORMAT_VERSION} and older: upgrade lowbit"
        )
    if version < 1:
        raise LowbitError(f"{where} has an unknown lowbit format_version {version}")
    for key, kind in (("recipe", dict), ("modules", dict), ("rope_orders", dict)):
        if not isinstance(qconfig.get(key), kind):
            raise LowbitError(f"{where}: quantization_config.{key} is missing or malformed")
    if qconfig.get("kv") is not None and not isinstance(qconfig["kv"], dict):
        raise LowbitError(f"{where}: quantization_config.kv is malformed")


def verify_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint directory without loading its tensors; returns its config dict.

    The config and the weights file must match the SHA-256 sums recorded at save time (so a
    damaged or edited checkpoint is refused rather than loaded as a silently different model),
    and every tensor the described model needs must be in the weights file with its shape and
    dtype, none extra.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    from lowbit.io.rebuild import expected_tensors, skeleton

    directory = Path(directory)
    raw = read_config(directory)
    where = str(directory / "config.json")
    qconfig = raw.get("quantization_config")
    check_format(qconfig, where)
    weights = directory / WEIGHTS_NAME
    if not is_file(weights):
        raise LowbitError(f"{directory} has no {WEIGHTS_NAME}: the checkpoint is incomplete")
    checksums = qconfig.get("checksums")
    if not isinstance(checksums, dict):
        raise LowbitError(f"{where} has no checksums: it was not written by lowbit.save")
    if checksums.get("config.json") != config_checksum(raw):
        raise LowbitError(f"{where} was changed after it was saved (its checksum differs)")
    if checksums.get(WEIGHTS_NAME) != file_sha256(weights):
        raise LowbitError(
            f"{weights} does not match the checksum recorded when it was saved: the file is "
            "damaged or was changed"
        )
    try:
        config = AutoConfig.from_pretrained(directory)
        expected = expected_tensors(skeleton(config, qconfig))
    except LowbitError:
        raise
    except Exception as err:  # a config transformers or lowbit cannot build a model from
        raise LowbitError(f"{where} does not describe a model lowbit can build ({err})") from err
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = {
                k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
            }
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise LowbitError(f"{weights} is not a readable safetensors file ({err})") from err
    tied = {k for k in expected if k not in stored and _is_tied(config, k)}
    for key, (shape, dtype) in expected.items():
        if key in tied:
            continue
        if key not in stored:
            raise LowbitError(f"{weights} has no tensor {key!r}")
        if stored[key][0] != shape:
            raise LowbitError(
                f"{weights}: tensor {key!r} has shape {list(stored[key][0])}, expected {list(shape)}"
            )
        kind = stored[key][1]
        if kind not in (_FLOAT_DTYPES if dtype.is_floating_point else {_INT_DTYPES.get(dtype)}):
            raise LowbitError(
                f"{weights}: tensor {key!r} has dtype {kind}, expected {str(dtype)[6:]}"
            )
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise LowbitError(f"{weights} has a tensor this model does not use: {extra[0]!r}")
    check_finite(weights, [k for k, (_, dtype) in stored.items() if dtype in _FLOAT_DTYPES])
    return raw


def check_finite(weights: Path, keys: list[str]) -> None:
    """Refuse a weights file whose float tensors (scales, zeros, codebooks, outliers, float
    weights) hold a NaN or an infinity: a model that would compute NaN logits without a word.
    Read one tensor at a time, after the checksum (a file edited with its checksums recomputed
    gets here)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        for key in keys:
            tensor = f.get_tensor(key)
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise LowbitError(
                    f"{weights}: tensor {key!r} holds {bad} value(s) that are not finite (NaN "
                    "or infinity); the model would compute NaN, so it is refused"
                )


_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_INT_DTYPES = {
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def _is_tied(config, key: str) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False)) and key == "lm_head.weight"
