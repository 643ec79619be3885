"""Block checkpoints of a calibration run, so that a killed run resumes where it stopped.

A resume directory holds::

    run.json                 {"format_version": 1, "fingerprint": {part: value}}: everything
                             the quantized weights depend on (below), written before any block
    block-0003.safetensors   the packed weight of each quantized linear of block 3: the buffers
                             of its packed module, keyed "{layer name}.{buffer}" (qdata, scale,
                             zero for integer weights)
    block-0003.json          the block's layer choices, each weight's packed-module spec (as a
                             checkpoint's), the layers kept in float, and the SHA-256 of the
                             safetensors file

Every file is written atomically (a temporary file in the same directory, fsync, rename), the
block's JSON after its tensors: a block is finished exactly when its JSON exists, so a SIGKILL
at any point leaves either a finished block or one that is done again. A directory whose
fingerprint differs from the current run's is refused with a sentence naming the difference,
never mixed into it. Nothing is pickled.

The fingerprint's parts: the recipe (its ``to_dict()`` and per-layer overrides, as the caller
passes them), the weight format of every selected layer, the algorithm's options, the model's
config, a SHA-256 of the float model's parameters and buffers as the weight algorithm first
sees them (after any rotation), a SHA-256 of the calibration token ids, the compute device type
and torch version (both change floating-point results), and this format's version.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.files import is_file, read_bytes

__all__ = ["RESUME_FORMAT_VERSION", "BlockCheckpoints", "run_fingerprint", "tensor_sha256"]

RESUME_FORMAT_VERSION = 2  # 2: any packed format, weights described by module specs
RUN_NAME = "run.json"
#: subdirectories where an earlier part of a composed recipe keeps a resume directory of its own
#: (``learn-rotate``'s training state), beside the weight algorithm's blocks
NESTED_DIRECTORIES = ("rotation",)

_DIGESTS = ("model_weights", "calibration")
_PART_NAMES = {
    "format_version": "the resume format version",
    "recipe": "the recipe",
    "layers": "the layers' weight formats",
    "options": "the weight algorithm's options",
    "model_config": "the model's config",
    "model_weights": "the model's float weights",
    "calibration": "the calibration tokens",
    "device": "the compute device type",
    "torch": "the torch version",
}


# -- fingerprint -----------------------------------------------------------------------------------
def tensor_sha256(tensors: list[tuple[str, Tensor]]) -> str:
    """SHA-256 over each tensor's name, dtype, shape and bytes, in the given order."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)};".encode())
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _jsonable(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples become lists, dtypes strings)."""
    return json.loads(json.dumps(value, default=str))


def run_fingerprint(
    model: nn.Module,
    calibration: Tensor,
    *,
    layers: dict[str, dict[str, Any] | None],
    options: dict[str, Any],
    recipe: dict[str, Any] | None,
    device: torch.device | str,
    weights_digest: str | None = None,
) -> dict[str, Any]:
    """What a run's quantized weights depend on (see the module docstring).

    Args:
        model: the model as the weight algorithm receives it (float block linears).
        calibration: [N, S] token ids.
        layers: ``{layer name: weight format settings, or None for a layer kept in float}``.
        options: the algorithm's settings (GPTQ options, guard, sequential, ...).
        recipe: the recipe's ``to_dict()`` and overrides, or None.
        device: the compute device.
        weights_digest: the float weights' digest when the model is not in memory (a streamed
            model: :meth:`lowbit.calibrate.capture.BlockHooks.weights_digest`); None hashes
            the model's parameters and buffers.
    """
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if config is not None else {}
    config_dict.pop("_name_or_path", None)  # where it was loaded from, not what it is
    if weights_digest is None:
        state = list(model.named_parameters()) + list(model.named_buffers())
        weights_digest = tensor_sha256(state)
    return _jsonable(
        {
            "format_version": RESUME_FORMAT_VERSION,
            "recipe": recipe,
            "layers": layers,
            "options": options,
            "model_config": config_dict,
            "model_weights": weights_digest,
            "calibration": tensor_sha256([("calibration", calibration)]),
            "device": torch.device(device).type,
            "torch": torch.__version__,
        }
    )


def _first_difference(saved: Any, current: Any, path: str = "") -> str:
    """Where two JSON values first differ, e.g. ``settings.w_bits: 4 there, 3 here``."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in list(saved) + [k for k in current if k not in saved]:
            if saved.get(key, ...) != current.get(key, ...):
                return _first_difference(saved.get(key), current.get(key), f"{path}{key}.")
    where = path.rstrip(".")
    return f"{where + ': ' if where else ''}{saved!r} there, {current!r} here"


# -- files -----------------------------------------------------------------------------------------
def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def _block_stem(index: int) -> str:
    return f"block-{index:04d}"


def _is_our_temp(name: str) -> bool:
    return name.endswith(".tmp") and (
        name.startswith((".block-", ".state-")) or name.startswith(f".{RUN_NAME}.")
    )


class BlockCheckpoints:
    """A resume directory: opened (or created) for one run's fingerprint.

    Args:
        directory: the resume directory (created if missing).
        fingerprint: :func:`run_fingerprint` of the current run.

    Raises :class:`LowbitError` when the directory belongs to another run or to something else.
    """

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any]):
        self.directory = Path(directory).expanduser()
        self.fingerprint = fingerprint
        try:
            self._open()
        except OSError as err:
            raise LowbitError(
                f"cannot use {self.directory} as a resume directory: {err.strerror or err}"
            ) from err

    def _open(self) -> None:
        if self.directory.exists() and not self.directory.is_dir():
            raise LowbitError(f"resume directory {self.directory} is a file, not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        for entry in self.directory.iterdir():
            if _is_our_temp(entry.name) and entry.is_file():
                entry.unlink()  # left by a run killed while writing
        run = self.directory / RUN_NAME
        if not run.exists():
            if any(e.name not in NESTED_DIRECTORIES for e in self.directory.iterdir()):
                raise LowbitError(
                    f"{self.directory} is not empty and has no {RUN_NAME}, so it is not a lowbit "
                    "resume directory; pass a new or empty --resume-dir"
                )
            _write_atomic(run, self._json({"fingerprint": self.fingerprint}))
            return
        saved = self._read_json(run).get("fingerprint")
        if saved != self.fingerprint:
            if not isinstance(saved, dict):
                saved = {}
            part = next(
                k for k in list(self.fingerprint) + list(saved)
                if saved.get(k, ...) != self.fingerprint.get(k, ...)
            )  # fmt: skip
            detail = ""
            if part not in _DIGESTS:  # a digest says nothing to a reader
                detail = _first_difference(saved.get(part), self.fingerprint.get(part))
            what = _PART_NAMES.get(part, part)
            raise LowbitError(
                f"resume directory {self.directory} was written by a different run: {what} "
                f"changed{f' ({detail})' if detail else ''}; delete it or pass another "
                "--resume-dir"
            )

    @staticmethod
    def _json(data: dict[str, Any]) -> bytes:
        return json.dumps({"format_version": RESUME_FORMAT_VERSION, **data}, indent=1).encode()

    def _read_json(self, path: Path) -> dict[str, Any]:
        try:
            data = json.loads(read_bytes(path).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise LowbitError(
                f"{path} in the resume directory is not valid JSON; delete the directory or "
                "pass another --resume-dir"
            ) from err
        if not isinstance(data, dict):
            raise LowbitError(f"{path} in the resume directory does not hold a JSON object")
        return data

    # -- blocks ------------------------------------------------------------------------------------
    def done(self, index: int) -> bool:
        """Whether block ``index`` is finished (its JSON exists)."""
        return (self.directory / f"{_block_stem(index)}.json").is_file()

    def save(self, index: int, layers: list[dict[str, Any]], quantized: dict[str, Any]) -> None:
        """Write block ``index``: its layer choices and the packed weight of each quantized one.

        Args:
            index: the block.
            layers: one JSON-able dict per selected linear of the block, with at least ``name``
                and ``algo`` ("float" for a layer left unquantized).
            quantized: ``{layer name: weight container}`` of the quantized layers (any format
                with a packed module, :func:`lowbit.nn.packed_linear.packed_format_for`).
        """
        from lowbit.nn.packed_linear import packed_format_for
        from lowbit.nn.spec import spec_name

        stem = _block_stem(index)
        tensors, formats = {}, {}
        for name, weight in quantized.items():
            packed = packed_format_for(weight).from_quantized(weight)
            for key, buffer in packed.named_buffers(recurse=False):
                tensors[f"{name}.{key}"] = buffer.cpu()
            formats[name] = {"class": spec_name(type(packed)), **packed.spec()}
        data = save_tensors(tensors)
        _write_atomic(self.directory / f"{stem}.safetensors", data)
        record = {
            "block": index,
            "layers": layers,
            "formats": formats,
            "float": [layer["name"] for layer in layers if layer["algo"] == "float"],
            "tensors_sha256": hashlib.sha256(data).hexdigest(),
        }
        _write_atomic(self.directory / f"{stem}.json", self._json(_jsonable(record)))

    def load(self, index: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Block ``index``'s layer choices and packed weights, as :meth:`save` got them.

        Containers are on the CPU. A damaged block is a :class:`LowbitError`.
        """
        stem = _block_stem(index)
        record = self._read_json(self.directory / f"{stem}.json")
        path = self.directory / f"{stem}.safetensors"
        damaged = (
            f"block {index} of resume directory {self.directory} is damaged ({{}}); delete "
            f"{stem}.json to quantize that block again"
        )
        if not is_file(path):
            raise LowbitError(damaged.format(f"{path.name} is missing"))
        data = read_bytes(path)
        if hashlib.sha256(data).hexdigest() != record.get("tensors_sha256"):
            raise LowbitError(damaged.format(f"{path.name} does not match its checksum"))
        try:
            tensors = load_tensors(data)
            layers, formats = record["layers"], record["formats"]
            if record["block"] != index or not all(
                isinstance(layer, dict) and {"name", "algo"} <= set(layer) for layer in layers
            ):
                raise ValueError(f"{stem}.json does not describe block {index}")
            quantized = {name: _container(name, fmt, tensors) for name, fmt in formats.items()}
        except KeyError as err:
            raise LowbitError(damaged.format(f"{err.args[0]} is missing")) from err
        except (SafetensorError, TypeError, ValueError) as err:
            raise LowbitError(damaged.format(str(err).split("\n")[0])) from err
        return layers, quantized

    # -- named states ------------------------------------------------------------------------------
    def save_state(self, name: str, tensors: dict[str, Tensor], record: dict[str, Any]) -> None:
        """Write the state ``name`` of an iterative run (a training step): its tensors to a file
        named by their checksum, then its JSON ``record`` naming that file, so a kill at any
        point leaves the previous state or this one whole; older tensor files are removed."""
        data = save_tensors({key: t.detach().cpu().contiguous() for key, t in tensors.items()})
        digest = hashlib.sha256(data).hexdigest()
        tensor_file = f"state-{name}-{digest[:16]}.safetensors"
        _write_atomic(self.directory / tensor_file, data)
        record = {**record, "tensors": tensor_file, "tensors_sha256": digest}
        _write_atomic(self.directory / f"state-{name}.json", self._json(_jsonable(record)))
        for old in self.directory.glob(f"state-{name}-*.safetensors"):
            if old.name != tensor_file:
                old.unlink()

    def load_state(self, name: str) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
        """The tensors and record :meth:`save_state` wrote last, or None if there is none."""
        path = self.directory / f"state-{name}.json"
        if not path.is_file():
            return None
        record = self._read_json(path)
        try:
            data = (self.directory / str(record.get("tensors"))).read_bytes()
        except OSError:
            data = b""
        if hashlib.sha256(data).hexdigest() != record.get("tensors_sha256"):
            raise LowbitError(
                f"state {name!r} of resume directory {self.directory} is damaged (its tensors "
                f"are missing or do not match {path.name}); delete {path.name} to start again"
            )
        return load_tensors(data), record


def _container(name: str, spec: dict[str, Any], tensors: dict[str, Tensor]) -> Any:
    """The weight container of one saved layer: its packed module rebuilt from ``spec`` and
    filled with its tensors, each checked against the module's buffers."""
    from lowbit.nn.spec import build_module

    packed = build_module(spec)  # a bad spec is a LowbitError, a ValueError
    for key, empty in list(packed.named_buffers(recurse=False)):
        tensor = tensors[f"{name}.{key}"]
        if tensor.shape != empty.shape or tensor.dtype != empty.dtype:
            raise ValueError(f"{name}.{key} is {tuple(tensor.shape)} {tensor.dtype}")
        setattr(packed, key, tensor)
    return packed.quantized_weight
