"""lowbit: run Hugging Face causal LMs in low bits (weights, activations, KV cache at 2-8 bits).

The top-level names are imported lazily so that `import lowbit` stays cheap, never imports
Triton and never initialises CUDA. transformers learns the ``lowbit`` quantization method (so
``AutoModelForCausalLM.from_pretrained`` loads lowbit checkpoints) when it loads its quantizer
registry, without ``import lowbit`` importing transformers.
"""

from importlib import import_module

from lowbit.io.hf import register_when_transformers_loads
from lowbit.version import __version__

_LAZY = {
    "LowbitError": "lowbit.errors",
    "load_model": "lowbit.api",
    "quantize": "lowbit.api",
    "quantize_to_directory": "lowbit.api",
    "get_recipe": "lowbit.recipes.registry",
    "list_recipes": "lowbit.recipes.registry",
    "evaluate": "lowbit.eval.evaluate",
    "save": "lowbit.io.checkpoint",
    "load": "lowbit.io.checkpoint",
    "pack_model": "lowbit.nn.packed_linear",
    "unpack_model": "lowbit.nn.packed_linear",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")


register_when_transformers_loads()
