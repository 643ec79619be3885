"""Quantized KV caches: the quantizer interface, integer and KIVI quantizers, the transformers
Cache, and the attention that feeds it (pre-RoPE caching, online Hadamard on q/k)."""

from lowbit.kv.quantizer import (
    KV_QUANTIZERS,
    KVQuantizer,
    PackedKV,
    check_kv,
    kv_quantizer_from_dict,
    register_kv_quantizer,
)

__all__ = [
    "KV_QUANTIZERS",
    "KVQuantizer",
    "PackedKV",
    "check_kv",
    "kv_quantizer_from_dict",
    "register_kv_quantizer",
]
