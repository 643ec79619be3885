"""Quantized KV caches: the quantizer interface, integer and KIVI quantizers, the transformers
Cache, and the attention that feeds it (pre-RoPE caching, online Hadamard on q/k)."""

from lowbit.kv.attention import KVQuantAttention, install_kv_quantization
from lowbit.kv.cache import KVCacheLayout, QuantizedKVCache, QuantizedKVLayer
from lowbit.kv.int_quant import IntChannelQuantizer, IntPackedKV, IntTokenQuantizer
from lowbit.kv.kivi import KIVIKeyQuantizer, KIVIValueQuantizer
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
    "IntPackedKV",
    "IntTokenQuantizer",
    "IntChannelQuantizer",
    "KIVIKeyQuantizer",
    "KIVIValueQuantizer",
    "KVCacheLayout",
    "QuantizedKVCache",
    "QuantizedKVLayer",
    "KVQuantAttention",
    "install_kv_quantization",
]
