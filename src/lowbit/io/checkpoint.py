"""lowbit checkpoints: a Hugging Face–style directory holding a quantized model as packed bits.

Layout of a saved directory::

    config.json          the model's config; ``quantization_config`` holds lowbit's part:
                         {"quant_method": "lowbit", "format_version": 1, "recipe": {...},
                          "modules": {fqn: spec}, "kv": {...} | null, "rope_orders": {...},
                          "checksums": {"model.safetensors": sha256, "config.json": sha256}}
    model.safetensors    every tensor: packed weights (qdata, scale, zero), float parameters,
                         calibrated KV state (codebooks, ranges, channel orders)
    tokenizer files, generation_config.json

Everything a recipe calibrated is in the tensors or the JSON, so loading never recalibrates:
the model is built empty from its config (on the meta device), given lowbit's modules from the
specs (:mod:`lowbit.io.modules`), its KV cache layout and K-sort RoPE orders, and then filled.
Loading goes through transformers (:mod:`lowbit.io.hf` registers the ``lowbit`` quantization
method), so ``AutoModelForCausalLM.from_pretrained(dir)`` and :func:`load` are the same path;
:func:`load` checks the files first so that a damaged checkpoint is one sentence, not a
traceback or a silently wrong model.

Writes are atomic (a temporary directory beside the target, renamed at the end); nothing is
pickled; ``format_version`` lets a newer lowbit read this format and an older one refuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "WEIGHTS_NAME",
    "save",
    "check_save_target",
    "load",
    "describe",
    "restructure",
    "checkpoint_tensors",
    "is_lowbit_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
QUANT_METHOD = "lowbit"
WEIGHTS_NAME = "model.safetensors"


# -- describing a quantized model ------------------------------------------------------------------
def _kv_spec(model: nn.Module) -> dict[str, Any] | None:
    from lowbit.io.modules import dtype_name
    from lowbit.kv.attention import KVQuantAttention

    layout = getattr(model, "lowbit_kv", None)
    if layout is None:
        return None
    attns = [m for m in model.modules() if isinstance(m, KVQuantAttention)]
    if {(a.pre_rope, a.rotate_qk) for a in attns} != {(attns[0].pre_rope, attns[0].rotate_qk)}:
        raise LowbitError("the model's layers cache keys in different ways; it cannot be saved")

    def dicts(quantizers):
        return [None if q is None else q.to_dict() for q in quantizers]

    return {
        "pre_rope": attns[0].pre_rope,
        "rotate_qk": attns[0].rotate_qk,
        "sink_tokens": layout.sink_tokens,
        "fp_window": layout.fp_window,
        "residual_dtype": dtype_name(layout.residual_dtype),
        "key_quantizers": dicts(layout.key_quantizers),
        "value_quantizers": dicts(layout.value_quantizers),
    }


def describe(model: nn.Module) -> dict[str, Any]:
    """lowbit's ``quantization_config`` for ``model`` (everything but the checksums)."""
    from lowbit import __version__
    from lowbit.io.modules import module_spec
    from lowbit.models.adapter import adapter_for

    recipe = getattr(model, "lowbit_recipe", None)
    if recipe is None:
        raise LowbitError(
            "this model was not quantized by lowbit (lowbit.quantize); nothing to save"
        )
    modules = {}
    for fqn, module in model.named_modules():
        spec = module_spec(module)
        if spec is not None:
            modules[fqn] = spec
    adapter = adapter_for(model)
    rope_orders = {}
    for view in adapter.blocks():
        order = getattr(view.attn, "lowbit_rope_order", None)
        if order is not None:
            rope_orders[str(view.index)] = order.source.tolist()  # [H_kv, D]
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "lowbit_version": __version__,
        "recipe": recipe.to_dict(),
        "modules": modules,
        "kv": _kv_spec(model),
        "rope_orders": rope_orders,
    }


def checkpoint_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor to store, by state-dict key: simulated quantized linears as their packed
    buffers (the float weight is not stored), shared tensors (tied embeddings) once, on CPU."""
    from lowbit.nn.packed_linear import packed_format_for
    from lowbit.nn.quant_linear import FakeQuantLinear

    state = model.state_dict()
    for fqn, module in model.named_modules():
        if isinstance(module, FakeQuantLinear) and module.quantized_weight is not None:
            del state[f"{fqn}.weight"]
            packed = packed_format_for(module.quantized_weight).from_quantized(
                module.quantized_weight
            )
            for name, buffer in packed.named_buffers(recurse=False):
                if buffer is not None:
                    state[f"{fqn}.{name}"] = buffer
    tensors: dict[str, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, tensor in state.items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if storage in seen and tensor.numel():
            continue  # a tied copy: transformers ties it again from the config on load
        seen.add(storage)
        tensors[key] = tensor.detach().to("cpu").contiguous()
    return tensors


# -- rebuilding the structure ----------------------------------------------------------------------
def restructure(model: nn.Module, qconfig: dict[str, Any]) -> None:
    """Give an empty model of the checkpoint's config lowbit's modules, in place (no tensors
    are filled: the checkpoint's are loaded afterwards)."""
    from lowbit.io.modules import build_module, check_linear_inputs, dtype_from_name
    from lowbit.kv.attention import install_kv_quantization
    from lowbit.models.adapter import adapter_for
    from lowbit.nn.quant_linear import replace_module
    from lowbit.recipes.registry import recipe_from_dict
    from lowbit.transforms.permute import RopeOrder

    adapter = adapter_for(model)
    for index, order in qconfig.get("rope_orders", {}).items():
        source = torch.tensor(order, dtype=torch.long, device="cpu")  # [H_kv, D]
        adapter.block(int(index)).attn.lowbit_rope_order = RopeOrder.from_order(source)
    kv = qconfig.get("kv")
    if kv:
        with torch.device("cpu"):  # small, and the state they derive must be real numbers

            def quantizers(dicts):
                if not isinstance(dicts, list):
                    raise LowbitError("the checkpoint's KV quantizers are malformed")
                return [_kv_quantizer(d) for d in dicts]

            install_kv_quantization(
                model,
                adapter,
                key_quantizers=quantizers(kv["key_quantizers"]),
                value_quantizers=quantizers(kv["value_quantizers"]),
                pre_rope=kv["pre_rope"],
                rotate_qk=kv["rotate_qk"],
                sink_tokens=kv["sink_tokens"],
                fp_window=kv["fp_window"],
                residual_dtype=dtype_from_name(kv["residual_dtype"]),
            )
    modules = qconfig.get("modules", {})
    for fqn in sorted(modules, key=lambda name: name.count(".")):  # parents before children
        try:
            model.get_submodule(fqn.rpartition(".")[0])
        except AttributeError as err:
            raise LowbitError(
                f"the checkpoint names a module {fqn!r} this model does not have"
            ) from err
        replace_module(model, fqn, build_module(modules[fqn]))
    for fqn in modules:
        module = model.get_submodule(fqn)
        if hasattr(module, "in_features"):
            check_linear_inputs(module, fqn)
    model.lowbit_recipe = recipe_from_dict(qconfig["recipe"])


def _kv_quantizer(data: Any):
    """A KV quantizer from its ``to_dict()`` (None stays None), its fields type-checked."""
    from lowbit.io.modules import check_fields, fields_from_signature
    from lowbit.kv.quantizer import KV_QUANTIZERS, kv_quantizer_from_dict

    if data is None:
        return None
    if not isinstance(data, dict) or data.get("kind") not in KV_QUANTIZERS:
        raise LowbitError(f"the checkpoint has an unknown KV quantizer {data!r}"[:200])
    cls = KV_QUANTIZERS[data["kind"]]
    settings = {k: v for k, v in data.items() if k != "kind"}
    check_fields(settings, fields_from_signature(cls.__init__), f"{data['kind']} KV quantizer")
    return kv_quantizer_from_dict(data)


def refresh_derived_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers of lowbit's modules (Hadamard factors, token
    rotations): they are never stored, and a model built on the meta device holds none."""
    from lowbit.io.modules import build_module, module_spec
    from lowbit.kv.quantizer import KVQuantizer, kv_quantizer_from_dict

    for module in model.modules():
        derived = module._non_persistent_buffers_set
        if not derived:
            continue
        if isinstance(module, KVQuantizer):
            fresh = kv_quantizer_from_dict(module.to_dict())
        else:
            spec = module_spec(module)
            if spec is None:
                continue
            fresh = build_module(spec)
        for name in derived:
            old, new = module._buffers.get(name), fresh._buffers.get(name)
            device = old.device if old is not None and old.device.type != "meta" else "cpu"
            module._buffers[name] = None if new is None else new.to(device)


# -- saving ----------------------------------------------------------------------------------------
def _config_checksum(config: dict[str, Any]) -> str:
    """SHA-256 of the config as canonical JSON, its own checksums left out."""
    config = dict(config)
    qconfig = dict(config.get("quantization_config") or {})
    qconfig.pop("checksums", None)
    config["quantization_config"] = qconfig
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_save_target(target: Path) -> None:
    """Refuse, with one sentence, a save target that is not a new or empty directory."""
    if target.exists() and not target.is_dir():
        raise LowbitError(f"cannot save to {target}: it exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        raise LowbitError(f"cannot save to {target}: the directory exists and is not empty")
    if not target.parent.is_dir():
        raise LowbitError(f"cannot save to {target}: the directory {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise LowbitError(f"cannot save to {target}: {target.parent} is not writable")


def saved_config(model: nn.Module) -> dict[str, Any]:
    """``model.config`` as a JSON dict as it will read back, with the dtype the model's float
    tensors have now (``model.to(torch.bfloat16)`` does not update the config)."""
    config = json.loads(json.dumps(model.config.to_dict()))
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    return config


def _set_default_permissions(directory: Path) -> None:
    """Give the directory and its files the modes the umask allows (mkdtemp makes them 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def save(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None) -> Path:
    """Write ``model`` (quantized by lowbit, either face) as a checkpoint directory.

    Args:
        model: a model ``lowbit.quantize`` returned (or one loaded from a checkpoint).
        directory: where to write; must not exist or be empty.
        tokenizer: saved beside the model when given.

    Returns:
        The directory's path.
    """
    from safetensors.torch import save_file

    target = Path(directory).expanduser()
    check_save_target(target)
    qconfig = describe(model)
    tensors = checkpoint_tensors(model)
    _check_rebuilds(model.config, qconfig, tensors)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        config = saved_config(model)
        config["quantization_config"] = qconfig
        qconfig["checksums"] = {
            WEIGHTS_NAME: _sha256(tmp / WEIGHTS_NAME),
            "config.json": _config_checksum(config),
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _set_default_permissions(tmp)
        if target.is_dir():
            target.rmdir()  # empty (checked): replaced by the finished directory
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _skeleton(config, qconfig: dict[str, Any]) -> nn.Module:
    """The empty (meta-device) model a checkpoint describes, with lowbit's modules in place."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    restructure(model, qconfig)
    return model


def _expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}


def _check_rebuilds(config, qconfig: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Before writing: the model rebuilt from ``qconfig`` must take exactly ``tensors`` (a key,
    shape or dtype lowbit could not restore would otherwise load as garbage)."""
    expected = _expected_tensors(_skeleton(config, qconfig))
    for key, tensor in tensors.items():
        if key not in expected:
            raise LowbitError(f"lowbit cannot rebuild the module holding {key!r}; not saved")
        if expected[key][0] != tuple(tensor.shape):
            raise LowbitError(
                f"{key!r} would be rebuilt with shape {expected[key][0]}, not "
                f"{tuple(tensor.shape)}; not saved"
            )


# -- loading ---------------------------------------------------------------------------------------
def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise LowbitError(f"{directory} has no config.json: not a model directory")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LowbitError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise LowbitError(f"{path} does not hold a JSON object")
    return config


def is_lowbit_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` has a config.json whose quantization method is lowbit's."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return False
    try:
        qconfig = json.loads(path.read_text()).get("quantization_config")
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

    directory = Path(directory)
    raw = _read_config(directory)
    where = str(directory / "config.json")
    qconfig = raw.get("quantization_config")
    check_format(qconfig, where)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise LowbitError(f"{directory} has no {WEIGHTS_NAME}: the checkpoint is incomplete")
    checksums = qconfig.get("checksums")
    if not isinstance(checksums, dict):
        raise LowbitError(f"{where} has no checksums: it was not written by lowbit.save")
    if checksums.get("config.json") != _config_checksum(raw):
        raise LowbitError(f"{where} was changed after it was saved (its checksum differs)")
    if checksums.get(WEIGHTS_NAME) != _sha256(weights):
        raise LowbitError(
            f"{weights} does not match the checksum recorded when it was saved: the file is "
            "damaged or was changed"
        )
    try:
        config = AutoConfig.from_pretrained(directory)
        expected = _expected_tensors(_skeleton(config, qconfig))
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
    return raw


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
        dtype: float dtype for the unquantized parameters (None: as saved).
        packed: keep weights packed (True) or expand them to the simulated face (False).
        verify: check the files (keys, shapes, dtypes, checksum) before loading.

    Returns:
        The model in eval mode, with ``lowbit_recipe`` (and ``lowbit_kv`` /
        ``lowbit_make_cache`` when it has a quantized KV cache).
    """
    from transformers import AutoModelForCausalLM

    from lowbit.io.hf import register_with_transformers
    from lowbit.models.loader import quiet_transformers

    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise LowbitError(f"{directory} is not a directory")
    if verify:
        verify_checkpoint(directory)
    else:
        check_format(_read_config(directory).get("quantization_config"), str(directory))
    register_with_transformers()
    kwargs = {} if dtype is None else {"dtype": dtype}
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    if device is not None:
        model = model.to(device)
    if not packed:
        from lowbit.nn.packed_linear import unpack_model

        unpack_model(model)
    return model.eval()
