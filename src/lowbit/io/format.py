"""The lowbit checkpoint format: its names, and the checks of a directory before it loads.

A checkpoint is a Hugging Face–style directory::

    config.json          the model's config; ``quantization_config`` holds lowbit's part:
                         {"quant_method": "lowbit", "format_version": 1, "recipe": {...},
                          "modules": {fqn: spec}, "kv": {...} | null, "rope_orders": {...},
                          "checksums": {"model.safetensors": sha256, "config.json": sha256}}
    model.safetensors    every tensor: packed weights (qdata, scale, zero), float parameters,
                         calibrated KV state (codebooks, ranges, channel orders)
    tokenizer files, generation_config.json

or, for a model larger than one shard (``lowbit.save(..., max_shard_size=...)``, 5 GB by
default), Hugging Face's shards and index in place of ``model.safetensors``
(:mod:`lowbit.io.shards`), each of them in the checksums::

    model-00001-of-00002.safetensors, model-00002-of-00002.safetensors
    model.safetensors.index.json      {"metadata": {"total_size": bytes},
                                       "weight_map": {tensor key: shard file name}}

A single-file checkpoint is the same bytes as before shards existed (format_version 1 covers
both: a lowbit that predates shards refuses a sharded checkpoint with "has no
model.safetensors", never loads it wrongly).

:func:`verify_checkpoint` checks a directory without loading its tensors: the checksums recorded
at save time (each shard's and the index's, for a sharded one), the index's weight_map against
the shards' own tables, then every tensor the described model needs (key, shape, dtype), none extra, and
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
from lowbit.io.shards import INDEX_NAME, WEIGHTS_NAME, read_weight_map

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "WEIGHTS_NAME",
    "INDEX_NAME",
    "read_config",
    "config_checksum",
    "file_sha256",
    "check_format",
    "is_lowbit_checkpoint",
    "verify_checkpoint",
    "weight_files",
    "stored_tensors",
    "check_finite",
]

FORMAT_VERSION = 1
QUANT_METHOD = "lowbit"


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


def weight_files(directory: Path, checksums: dict[str, Any]) -> tuple[list[Path], dict | None]:
    """The weights files of a checkpoint whose config records ``checksums``, each checked against
    its sum, and the index's weight_map (None for a single ``model.safetensors``).

    A checkpoint is sharded when its checksums name the index (``model.safetensors.index.json``,
    :mod:`lowbit.io.shards`): then the index and every shard it names must match their sums, no
    file it does not name may be recorded, and no ``model.safetensors`` may lie beside them
    (transformers would load that file alone).
    """
    if INDEX_NAME not in checksums:  # one file (every checkpoint before shards)
        weights = directory / WEIGHTS_NAME
        if not is_file(weights):
            raise LowbitError(f"{directory} has no {WEIGHTS_NAME}: the checkpoint is incomplete")
        _check_sum(weights, checksums.get(WEIGHTS_NAME))
        return [weights], None
    index = directory / INDEX_NAME
    if not is_file(index):
        raise LowbitError(f"{directory} has no {INDEX_NAME}: the checkpoint is incomplete")
    _check_sum(index, checksums[INDEX_NAME])
    weight_map = read_weight_map(directory)
    names = sorted(set(weight_map.values()))
    recorded = sorted(set(checksums) - {INDEX_NAME, "config.json"})
    if names != recorded:
        extra = sorted(set(names) ^ set(recorded))[0]
        raise LowbitError(
            f"{index} and the checksums in config.json do not list the same shards (the first "
            f"that differs: {extra}): the checkpoint was changed"
        )
    if (directory / WEIGHTS_NAME).exists():
        raise LowbitError(
            f"{directory} holds both shards and a {WEIGHTS_NAME} that is not part of the "
            "checkpoint (transformers would load that file alone): remove it"
        )
    files = []
    for name in names:
        path = directory / name
        if not is_file(path):
            raise LowbitError(f"{directory} has no {name}: the checkpoint is incomplete")
        _check_sum(path, checksums[name])
        files.append(path)
    return files, weight_map


def _check_sum(path: Path, recorded: Any) -> None:
    if recorded != file_sha256(path):
        raise LowbitError(
            f"{path} does not match the checksum recorded when it was saved: the file is "
            "damaged or was changed"
        )


def stored_tensors(
    files: list[Path], weight_map: dict[str, str] | None
) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """``{key: (shape, safetensors dtype, file)}`` of every tensor in ``files``, read from their
    headers; a key in two files, or (sharded) one the index places elsewhere or one the index
    names that no file holds, is refused with one sentence."""
    from safetensors import safe_open

    stored: dict[str, tuple[tuple[int, ...], str, Path]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                table = {k: f.get_slice(k) for k in f.keys()}
                table = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in table.items()}
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise LowbitError(f"{path} is not a readable safetensors file ({err})") from err
        for key, (shape, dtype) in table.items():
            if key in stored:
                raise LowbitError(f"{path} and {stored[key][2]} both hold the tensor {key!r}")
            if weight_map is not None and weight_map.get(key) != path.name:
                raise LowbitError(
                    f"{path} holds the tensor {key!r}, which {INDEX_NAME} places "
                    f"{'nowhere' if key not in weight_map else 'in ' + weight_map[key]}"
                )
            stored[key] = (shape, dtype, path)
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in stored:
                raise LowbitError(
                    f"{INDEX_NAME} places the tensor {key!r} in {name}, which lacks it"
                )
    return stored


def verify_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint directory without loading its tensors; returns its config dict.

    The config and the weights files (one ``model.safetensors``, or the shards and their index)
    must match the SHA-256 sums recorded at save time (so a damaged or edited checkpoint is
    refused rather than loaded as a silently different model), the index must place every
    tensor in the shard that holds it, and every tensor the described model needs must be in
    the weights with its shape and dtype, none extra.
    """
    from transformers import AutoConfig

    from lowbit.io.rebuild import expected_tensors, skeleton

    directory = Path(directory)
    raw = read_config(directory)
    where = str(directory / "config.json")
    qconfig = raw.get("quantization_config")
    check_format(qconfig, where)
    checksums = qconfig.get("checksums")
    if INDEX_NAME not in (checksums if isinstance(checksums, dict) else {}):
        if not is_file(directory / WEIGHTS_NAME):
            raise LowbitError(f"{directory} has no {WEIGHTS_NAME}: the checkpoint is incomplete")
    if not isinstance(checksums, dict):
        raise LowbitError(f"{where} has no checksums: it was not written by lowbit.save")
    if checksums.get("config.json") != config_checksum(raw):
        raise LowbitError(f"{where} was changed after it was saved (its checksum differs)")
    files, weight_map = weight_files(directory, checksums)
    try:
        config = AutoConfig.from_pretrained(directory)
        expected = expected_tensors(skeleton(config, qconfig))
    except LowbitError:
        raise
    except Exception as err:  # a config transformers or lowbit cannot build a model from
        raise LowbitError(f"{where} does not describe a model lowbit can build ({err})") from err
    stored = stored_tensors(files, weight_map)
    weights = files[0] if weight_map is None else directory
    tied = {k for k in expected if k not in stored and _is_tied(config, k)}
    for key, (shape, dtype) in expected.items():
        if key in tied:
            continue
        if key not in stored:
            raise LowbitError(f"{weights} has no tensor {key!r}")
        holder = stored[key][2]
        if stored[key][0] != shape:
            raise LowbitError(
                f"{holder}: tensor {key!r} has shape {list(stored[key][0])}, expected {list(shape)}"
            )
        kind = stored[key][1]
        if kind not in (_FLOAT_DTYPES if dtype.is_floating_point else {_INT_DTYPES.get(dtype)}):
            raise LowbitError(
                f"{holder}: tensor {key!r} has dtype {kind}, expected {str(dtype)[6:]}"
            )
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise LowbitError(
            f"{stored[extra[0]][2]} has a tensor this model does not use: {extra[0]!r}"
        )
    check_finite({k: holder for k, (_, dtype, holder) in stored.items() if dtype in _FLOAT_DTYPES})
    return raw


def check_finite(holders: dict[str, Path]) -> None:
    """Refuse weights whose float tensors (scales, zeros, codebooks, outliers, float weights)
    hold a NaN or an infinity: a model that would compute NaN logits without a word.
    ``holders`` maps each tensor key to the weights file holding it. Read one tensor at a time,
    after the checksum (a file edited with its checksums recomputed gets here)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key, path in holders.items():
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                tensor = f.get_tensor(key)
                if not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise LowbitError(
                        f"{path}: tensor {key!r} holds {bad} value(s) that are not finite (NaN "
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
