"""Read a float model directory's safetensors tensor by tensor, without loading the model.

A Hugging Face directory holds its weights in ``model.safetensors`` or in shards listed by
``model.safetensors.index.json`` (``{"weight_map": {key: shard file}}``). :class:`FloatWeights`
reads each file's header (shapes, dtypes, byte ranges) once; asking for a tensor then reads that
tensor's bytes alone, with one positioned read into fresh memory. (A memory map would do the
same work, but every page it touched would count in the process's resident memory until the map
is closed: 16 GB for an 8B model read once through.) The streamed quantizer
(:mod:`lowbit.io.stream`) reads a block's tensors when the block's turn comes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from torch import Tensor

from lowbit.atomic import os_error_reason
from lowbit.errors import LowbitError

__all__ = ["FloatWeights", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class FloatWeights:
    """The tensors of a float model directory, by state-dict key, read on demand.

    Args:
        directory: a directory with ``model.safetensors`` or ``model.safetensors.index.json``
            and the shards it names.

    A missing file, an index that is not ``{"weight_map": {...}}``, a shard whose header is not
    a safetensors header, or one shorter than its header says is a :class:`LowbitError`.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        files = self._files()
        # key -> (file name, absolute byte offset, byte count, shape, dtype)
        self._info: dict[str, tuple[str, int, int, tuple[int, ...], torch.dtype]] = {}
        self._names = sorted(set(files.values()))
        for name in self._names:
            for key, entry in _read_header(self.directory / name).items():
                self._info[key] = (name, *entry)
        missing = sorted(
            k for k, name in files.items() if k and self._info.get(k, ("",))[0] != name
        )
        if missing:
            raise LowbitError(
                f"{self.directory / INDEX_FILE} lists {missing[0]!r} in {files[missing[0]]}, "
                "which does not hold it"
            )

    def _files(self) -> dict[str, str]:
        """``{key: shard file name}`` for an index; ``{"": the one file}`` otherwise."""
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                data = json.loads(index.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                raise LowbitError(f"{index} is not a readable JSON index ({err})") from err
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v and "/" not in v for v in weight_map.values()
            ):
                raise LowbitError(f"{index} has no weight_map of tensor names to shard files")
            return dict(weight_map)
        if not (self.directory / SINGLE_FILE).is_file():
            raise LowbitError(
                f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}: no safetensors "
                "weights to stream"
            )
        return {"": SINGLE_FILE}

    # -- headers -----------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._info)

    def __contains__(self, key: str) -> bool:
        return key in self._info

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key)[3]

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key)[4]

    def numel(self, prefix: str = "") -> int:
        """Elements of the tensors whose key starts with ``prefix`` (all by default)."""
        total = 0
        for key, entry in self._info.items():
            if key.startswith(prefix):
                total += _count(entry[3])
        return total

    def files(self) -> list[Path]:
        """The weight files, in name order."""
        return [self.directory / name for name in self._names]

    def file_bytes(self) -> int:
        """Bytes of the weight files on disk."""
        return sum((self.directory / name).stat().st_size for name in self._names)

    def _entry(self, key: str):
        try:
            return self._info[key]
        except KeyError:
            raise LowbitError(f"the weights in {self.directory} have no tensor {key!r}") from None

    # -- data --------------------------------------------------------------------------------
    def get(
        self,
        key: str,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> Tensor:
        """Tensor ``key`` read from its file, in ``dtype`` (None: as stored) on ``device``."""
        name, offset, nbytes, shape, stored = self._entry(key)
        raw = torch.empty(nbytes, dtype=torch.uint8)  # [bytes]
        path = self.directory / name
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                view, done = memoryview(raw.numpy()), 0
                while done < nbytes:
                    got = f.readinto(view[done:])
                    if not got:
                        raise LowbitError(f"{path} ends inside tensor {key!r}: it is truncated")
                    done += got
        except OSError as err:
            raise LowbitError(f"cannot read {path}: {os_error_reason(err) or err}") from err
        tensor = raw.view(stored).reshape(shape)
        return tensor.to(device=device, dtype=dtype or stored)


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _read_header(path: Path) -> dict[str, tuple[int, int, tuple[int, ...], torch.dtype]]:
    """``{key: (absolute offset, bytes, shape, dtype)}`` from a safetensors file's header."""
    bad = f"{path} is not a safetensors file"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LowbitError(f"{bad}: it is shorter than a header")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise LowbitError(f"{bad}: its header length {length} does not fit the file")
            header = json.loads(f.read(length))
    except OSError as err:
        raise LowbitError(f"cannot read {path}: {os_error_reason(err) or err}") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LowbitError(f"{bad}: its header is not JSON") from err
    if not isinstance(header, dict):
        raise LowbitError(f"{bad}: its header is not a JSON object")
    start = 8 + length
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise LowbitError(f"{bad}: its entry for {key!r} is malformed") from None
        nbytes = _count(shape) * torch.empty(0, dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0 or start + end > size:
            raise LowbitError(f"{path}: tensor {key!r} does not fit the file (truncated?)")
        entries[key] = (start + begin, nbytes, shape, dtype)
    return entries
