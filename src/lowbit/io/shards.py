"""Weights written as they come, into size-bounded safetensors shards, named as Hugging Face names
them.

A checkpoint larger than one shard (``max_shard_bytes``, 5 GB by default, as transformers'
``save_pretrained``) is several files with an index beside them::

    model-00001-of-00003.safetensors   ...
    model.safetensors.index.json       {"metadata": {"total_size": bytes},
                                        "weight_map": {tensor key: shard file name}}

and a smaller one is a single ``model.safetensors``, byte for byte what
``safetensors.torch.save_file`` writes for the same tensors (with ``{"format": "pt"}``
metadata). :class:`ShardWriter` takes tensors in any number of calls and writes a shard as soon
as it is full, so a model quantized block by block never holds more than about one shard of
output (none with ``spill=True``, which queues the tensors in a scratch file); it writes into a
directory that is normally the temporary one of :func:`lowbit.atomic.atomic_directory`, so a
failed or interrupted save leaves nothing.

:func:`read_weight_map` reads such a directory back (which file holds which tensor), and
:func:`parse_size` reads sizes as the command line gives them (``500MB``, ``2GB``, ``1.5GiB``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lowbit.checksum import file_sha256
from lowbit.errors import LowbitError

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "ShardWriter",
    "parse_size",
    "read_weight_map",
    "shard_name",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: transformers' own default shard size for ``save_pretrained`` ("5GB", decimal)
DEFAULT_SHARD_BYTES = 5 * 10**9
#: metadata stored in every shard's header, as transformers writes it
SHARD_METADATA = {"format": "pt"}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """A size in bytes from an int or a string such as ``"500MB"``, ``"2GB"``, ``"1.5GiB"`` or
    ``"4096"`` (KB, MB, GB, TB are powers of 1000, as Hugging Face reads them; KiB, MiB, GiB, TiB
    powers of 1024). Refuses, with one sentence, anything else and sizes below one byte."""
    if isinstance(size, bool):
        raise LowbitError(f"a size is a number of bytes or a string such as '2GB', not {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str) and (match := _SIZE.match(size)) is not None:
        unit = match[2].lower()
        if unit not in _UNITS:
            raise LowbitError(
                f"unknown unit {match[2]!r} in the size {size!r}: use B, KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB"
            )
        value = int(float(match[1]) * _UNITS[unit])
    else:
        raise LowbitError(f"a size is a number of bytes or a string such as '2GB', not {size!r}")
    if value < 1:
        raise LowbitError(f"a size must be at least one byte, not {size!r}")
    return value


def shard_name(index: int, count: int) -> str:
    """Hugging Face's name of shard ``index`` (from 1) of ``count``; ``model.safetensors`` for
    the only one."""
    return WEIGHTS_NAME if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


#: the scratch file of a spilling :class:`ShardWriter`
SPILL_NAME = ".queued-tensors.spill"
_SPILL_ALIGN = 64


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class _Spilled:
    """Where a queued tensor's bytes lie in the spill file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


class ShardWriter:
    """Writes tensors into size-bounded safetensors shards in ``directory`` (normally the
    temporary directory of :func:`lowbit.atomic.atomic_directory`), as they come.

    A shard holds tensors until the next one would take it past ``max_shard_bytes``; a tensor
    larger than that on its own gets a shard to itself (as in transformers). Shards are written
    under provisional names and renamed by :meth:`close`, once their number is known.

    Args:
        directory: an existing directory to write into.
        max_shard_bytes: the most bytes of tensor data one shard holds (:func:`parse_size`
            reads ``"2GB"`` and the like).
        spill: keep the queued tensors' bytes in a scratch file in ``directory``
            (``SPILL_NAME``, removed by :meth:`close`) instead of in memory, and write each shard
            from that file mapped: a model quantized block by block then holds no shard of
            output beside the block it works on (a 1 GB shard is eight of Llama-3-8B's W4
            blocks). The files are the same bytes either way.
    """

    def __init__(
        self, directory: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, spill: bool = False
    ) -> None:
        self.directory = Path(directory)
        self.max_shard_bytes = parse_size(max_shard_bytes)
        self._spill = open(self.directory / SPILL_NAME, "w+b") if spill else None  # noqa: SIM115
        self._queued: dict[str, Tensor | _Spilled] = {}
        self._queued_bytes = 0
        self._written: list[tuple[str, list[str]]] = []  # provisional file name, its keys
        self._keys: set[str] = set()
        self._total_bytes = 0
        self._closed = False

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data taken so far (queued or written)."""
        return self._total_bytes

    def add(self, tensors: dict[str, Tensor]) -> None:
        """Queue tensors (CPU or not; stored contiguous on CPU); a shard is written as soon as the
        queued bytes reach ``max_shard_bytes``, so memory held is bounded by about one shard. A
        key given twice is a LowbitError."""
        if self._closed:
            raise LowbitError("this ShardWriter is closed; it takes no more tensors")
        for key, tensor in tensors.items():
            if not isinstance(key, str) or not key:
                raise LowbitError(f"a tensor's key must be a non-empty string, not {key!r}")
            if key in self._keys:
                raise LowbitError(f"the tensor {key!r} was given twice; a checkpoint holds it once")
            if not isinstance(tensor, Tensor):
                raise LowbitError(f"{key!r} is a {type(tensor).__name__}, not a tensor")
            tensor = tensor.detach().to("cpu").contiguous()
            size = _nbytes(tensor)
            if self._queued and self._queued_bytes + size > self.max_shard_bytes:
                self._flush()
            self._keys.add(key)
            if self._spill is not None and size:  # an empty tensor has no bytes to keep
                tensor = self._spilled(tensor)
            self._queued[key] = tensor
            self._queued_bytes += size
            self._total_bytes += size
            if self._queued_bytes >= self.max_shard_bytes:
                self._flush()

    def _spilled(self, tensor: Tensor) -> _Spilled:
        """``tensor``'s bytes appended to the spill file (at a 64-byte boundary, so that any
        dtype views them in place); what :meth:`_unspilled` maps them back by."""
        offset = -(-self._spill.tell() // _SPILL_ALIGN) * _SPILL_ALIGN
        self._spill.seek(offset)
        self._spill.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        return _Spilled(tensor.dtype, tuple(tensor.shape), offset)

    def _unspilled(self) -> dict[str, Tensor]:
        """The queued tensors as views of the spill file mapped (copy-on-write: nothing written
        back), the pages read as the shard is written."""
        self._spill.flush()
        size = os.fstat(self._spill.fileno()).st_size
        storage = torch.UntypedStorage.from_file(
            str(self.directory / SPILL_NAME), shared=False, nbytes=size
        ) if size else None  # fmt: skip
        tensors = {}
        for key, spilled in self._queued.items():
            if isinstance(spilled, Tensor):  # empty: kept as it is
                tensors[key] = spilled
                continue
            view = torch.empty(0, dtype=spilled.dtype)
            item = view.element_size()
            tensors[key] = view.set_(storage, spilled.offset // item, spilled.shape)
        return tensors

    def _flush(self) -> None:
        """Write the queued tensors as the next shard (under a provisional name) and drop them."""
        from safetensors.torch import save_file  # looked up here: tests replace it

        name = f"model-{len(self._written) + 1:05d}.safetensors.part"
        tensors = self._queued if self._spill is None else self._unspilled()
        save_file(tensors, str(self.directory / name), metadata=dict(SHARD_METADATA))
        del tensors
        if self._spill is not None:  # the mapping is gone with the views: start the file over
            self._spill.seek(0)
            self._spill.truncate()
        self._written.append((name, list(self._queued)))
        self._queued = {}
        self._queued_bytes = 0

    def close(self) -> dict[str, str]:
        """Write the last shard; name the files as Hugging Face does (``model.safetensors`` when
        there is one shard, else ``model-00001-of-0000N.safetensors``, renamed at close) and, for
        several, write ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
        "weight_map": {key: file}}``); return ``{file name: sha256}`` of every weights file
        written, the index included."""
        if self._closed:
            raise LowbitError("this ShardWriter is already closed")
        if self._queued or not self._written:  # no tensor at all: one empty model.safetensors
            self._flush()
        self._closed = True
        if self._spill is not None:
            self._spill.close()
            (self.directory / SPILL_NAME).unlink()
        count = len(self._written)
        checksums: dict[str, str] = {}
        weight_map: dict[str, str] = {}
        for index, (provisional, keys) in enumerate(self._written, start=1):
            final = shard_name(index, count)
            os.replace(self.directory / provisional, self.directory / final)
            checksums[final] = file_sha256(self.directory / final)
            weight_map.update(dict.fromkeys(keys, final))
        if count > 1:
            index_file = self.directory / INDEX_NAME
            document = {
                "metadata": {"total_size": self._total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            index_file.write_text(json.dumps(document, indent=2) + "\n")
            checksums[INDEX_NAME] = file_sha256(index_file)
        return checksums


def read_weight_map(directory: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` ({tensor key: shard file name}) of a sharded directory, or None
    when it has no ``model.safetensors.index.json``. Refuses, with one sentence, an index that
    is not JSON of that shape or names a file outside the directory."""
    path = Path(directory) / INDEX_NAME
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LowbitError(f"{path} is not valid JSON ({err})") from err
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise LowbitError(f"{path} has no weight_map of tensor names to file names")
    for name in set(weight_map.values()):
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise LowbitError(f"{path} names {name!r}, not a safetensors file beside it")
    return weight_map
