"""lowbit as a transformers quantization method: ``from_pretrained`` loads lowbit checkpoints.

transformers lets a library register a quantization config class and a quantizer under a
``quant_method`` name. Ours verifies the checkpoint's files (:func:`lowbit.io.format
.verify_checkpoint`: checksums, every tensor's key, shape and dtype; skipped inside
:func:`verified`, where the caller has just done it), rebuilds lowbit's modules on the empty
(meta) model before the weights load (:func:`lowbit.io.rebuild.restructure`) and recomputes the
derived buffers after.
:func:`register_with_transformers` is idempotent; ``import lowbit`` arranges for it to run as
soon as transformers' quantizer registry is imported (see :mod:`lowbit`), so
``AutoModelForCausalLM.from_pretrained(dir)`` works after ``import lowbit`` without lowbit
importing transformers itself.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["register_with_transformers", "register_when_transformers_loads", "verified"]

_REGISTERED = False
_REGISTRY_MODULE = "transformers.quantizers.auto"

#: checkpoint directories whose files the current caller has verified (see :func:`verified`)
_VERIFIED: set[Path] = set()


@contextlib.contextmanager
def verified(directory: str | os.PathLike) -> Iterator[None]:
    """Inside, loading ``directory`` through transformers does not verify its files again."""
    path = Path(directory).resolve()
    _VERIFIED.add(path)
    try:
        yield
    finally:
        _VERIFIED.discard(path)


def _checkpoint_directory(checkpoint_files: list[str] | None) -> Path | None:
    return Path(checkpoint_files[0]).resolve().parent if checkpoint_files else None


def _float_dtypes(model) -> dict[tuple[str, str], Any]:
    """``{(module name, tensor name): dtype}`` of every float parameter and buffer, as the model
    was built to run (before its weights load)."""
    return {
        (prefix, name): tensor.dtype
        for prefix, module in model.named_modules()
        for tensors in (module._parameters, module._buffers)
        for name, tensor in tensors.items()
        if tensor is not None and tensor.is_floating_point()
    }


def _cast_to_run_dtypes(model, dtypes: dict[tuple[str, str], Any]) -> None:
    """Cast each float tensor loaded in another dtype (an fp32 embedding of a model run in bf16)
    to the dtype the model was built with, one tensor at a time, giving back the pages of the
    stored one as soon as it is cast (:func:`lowbit.mapped.release_pages`). transformers casts
    as it loads, and the memory-mapped file keeps every page it read resident until the last of
    its tensors is gone: the stored fp32 tensors stayed resident beside their bf16 copies."""
    import torch

    from lowbit.mapped import release_pages

    cast: set[int] = set()
    for (prefix, name), dtype in dtypes.items():
        module = model.get_submodule(prefix)
        tensors = module._parameters if name in module._parameters else module._buffers
        tensor = tensors.get(name)
        if tensor is None or tensor.dtype == dtype or not tensor.is_floating_point():
            continue
        if id(tensor) in cast:  # tied: cast through the other name already
            continue
        stored = tensor.data
        copy = _cast_releasing(stored, dtype, release_pages)
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = copy  # the same Parameter: ties hold
        else:
            tensors[name] = copy
        cast.add(id(tensor))
        del stored


#: elements of a stored tensor cast at once (64 MiB of fp32)
_CAST_SLAB = 1 << 24


def _cast_releasing(stored, dtype, release_pages):
    """``stored.to(dtype)``, a slab of rows at a time for a large tensor, each slab's stored
    pages given back once cast: the transient is one slab, not the whole stored tensor (an 8B
    model's fp32 embedding is 2.1 GB)."""
    if stored.dim() == 0 or stored.numel() <= _CAST_SLAB or not stored.is_contiguous():
        copy = stored.to(dtype)
        release_pages([stored])
        return copy
    copy = stored.new_empty(stored.shape, dtype=dtype)
    step = max(1, _CAST_SLAB // max(1, stored[0].numel()))
    for start in range(0, stored.shape[0], step):
        copy[start : start + step] = stored[start : start + step]
        release_pages([stored[start : start + step]])
    return copy


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds transformers' quantizer registry like the normal path finder does, and registers
    lowbit right after that module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _REGISTRY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            register_with_transformers()

        loader.exec_module = exec_module
        return spec


def register_when_transformers_loads() -> None:
    """Register now if transformers' quantizer registry is loaded, else as soon as it is."""
    if _REGISTRY_MODULE in sys.modules:
        register_with_transformers()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def register_with_transformers() -> None:
    """Register the ``lowbit`` quantization method with transformers (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
    )
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from lowbit.io.format import QUANT_METHOD, check_format, verify_checkpoint

    class LowbitConfig(QuantizationConfigMixin):
        """lowbit's ``quantization_config`` (see :mod:`lowbit.io.format`), kept as given."""

        def __init__(self, **fields: Any):
            check_format(fields, "the model's quantization_config")
            self.__dict__.update(fields)
            self.quant_method = QUANT_METHOD

    class LowbitHfQuantizer(HfQuantizer):
        """Loads lowbit checkpoints (pre-quantized only: quantizing goes through lowbit)."""

        requires_calibration = True

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            directory = _checkpoint_directory(checkpoint_files)
            if directory is not None and directory not in _VERIFIED:
                verify_checkpoint(directory)
            from lowbit.io.rebuild import restructure  # on first use: loading transformers
            # imports this registration, and must not import lowbit's model-side modules

            restructure(model, self.quantization_config.to_dict())
            self.lowbit_run_dtypes = _float_dtypes(model)

        def get_new_dtype(self, converter, param, dtype):
            """Float tensors load as they are stored (views of the memory-mapped file);
            :func:`_cast_to_run_dtypes` casts them after, one at a time."""
            new = super().get_new_dtype(converter, param, dtype)
            return None if new is not None and new.is_floating_point else new

        def _process_model_after_weight_loading(self, model, **kwargs):
            from lowbit.io.rebuild import refresh_derived_buffers
            from lowbit.mapped import release_unused_pages

            _cast_to_run_dtypes(model, getattr(self, "lowbit_run_dtypes", {}))
            refresh_derived_buffers(model)
            release_unused_pages([*model.parameters(), *model.buffers()])
            return model

        def is_serializable(self):
            return (
                False  # lowbit.save writes the format (with its checksums); save_pretrained can't
            )

        @property
        def is_trainable(self):
            return False

    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(QUANT_METHOD, LowbitConfig)
    AUTO_QUANTIZER_MAPPING.setdefault(QUANT_METHOD, LowbitHfQuantizer)
    _REGISTERED = True
