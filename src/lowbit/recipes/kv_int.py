"""The ``kv-int`` recipe: an integer-quantized KV cache (QuaRot's cache with rotate_qk=hadamard).

Only the cache is quantized; weights and activations are left as they are, so this recipe also
serves as the KV part of other recipes (``quarot`` calls :func:`lowbit.kv.install_kv_quantization`
with :meth:`KVIntRecipe.quantizers`). Sinks and fp parts are stored in float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.kv.attention import ROTATIONS, install_kv_quantization
from lowbit.kv.cache import KVCacheLayout
from lowbit.kv.int_quant import IntChannelQuantizer, IntTokenQuantizer
from lowbit.kv.quantizer import KVQuantizer
from lowbit.recipes.base import (
    OFF_BITS,
    QuantizeContext,
    Recipe,
    check_bits,
    check_clip,
    check_group,
    check_kv_fits,
    resolve_clip,
)
from lowbit.recipes.registry import register
from lowbit.settings import Count

#: QuaRot's KV clip ratio (Ashkboos et al., 2024), used at 4 bits or fewer when ``clip_ratio``
#: is unset
QUAROT_KV_CLIP = 0.95


@register
@dataclass
class KVIntRecipe(Recipe):
    """Asymmetric (or symmetric) integer keys and values, per token or keys per channel.

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them).
    """

    method = "kv-int"
    roles = frozenset({"kv"})
    paper = "QuaRot's KV cache (Ashkboos et al., 2024)"

    bits: int | None = None
    k_bits: int = 4
    v_bits: int = 4
    k_group: int | None = None
    v_group: int | None = None
    clip_ratio: float | None = None
    symmetric: bool = False
    pre_rope: bool = False
    per_channel_keys: bool = False
    key_token_group: int = 128
    rotate_qk: str = "none"
    sink_tokens: Count = 0

    def key_bits(self) -> int:
        return self.k_bits if self.bits is None else self.bits

    def value_bits(self) -> int:
        return self.v_bits if self.bits is None else self.bits

    def validate(self) -> None:
        if self.bits is not None:
            check_bits("bits", self.bits)
        check_bits("k_bits", self.k_bits)
        check_bits("v_bits", self.v_bits)
        check_group("k_group", self.k_group)
        check_group("v_group", self.v_group)
        check_group("key_token_group", self.key_token_group)
        check_clip("clip_ratio", self.clip_ratio)
        if self.rotate_qk not in ROTATIONS:
            raise LowbitError(f"rotate_qk must be one of {ROTATIONS}, not {self.rotate_qk!r}")
        if self.rotate_qk == "hadamard" and self.pre_rope:
            raise LowbitError("rotate_qk=hadamard acts after RoPE; it cannot be used with pre_rope")
        if self.per_channel_keys and self.k_group is not None:
            raise LowbitError(
                "k_group is for per-token keys; per_channel_keys uses key_token_group"
            )
        if isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise LowbitError(f"sink_tokens must be a non-negative integer, not {self.sink_tokens}")

    def nothing_to_do(self) -> str | None:
        if self.key_bits() == OFF_BITS and self.value_bits() == OFF_BITS:
            return "keys and values both at 16 bits leave the cache in float (KV bits are 2-8)"
        return None

    def check_model(self, model, context: QuantizeContext) -> None:
        check_kv_fits(context.adapter, [self.key_quantizer(), self.value_quantizer()])

    def _clip(self, bits: int) -> float:
        return resolve_clip(self.clip_ratio, bits, QUAROT_KV_CLIP)

    def key_quantizer(self) -> KVQuantizer | None:
        bits = self.key_bits()
        if bits == OFF_BITS:
            return None
        if self.per_channel_keys:
            return IntChannelQuantizer(
                bits,
                token_group=self.key_token_group,
                symmetric=self.symmetric,
                clip_ratio=self._clip(bits),
            )
        return IntTokenQuantizer(
            bits, group_size=self.k_group, symmetric=self.symmetric, clip_ratio=self._clip(bits)
        )

    def value_quantizer(self) -> KVQuantizer | None:
        bits = self.value_bits()
        if bits == OFF_BITS:
            return None
        return IntTokenQuantizer(
            bits, group_size=self.v_group, symmetric=self.symmetric, clip_ratio=self._clip(bits)
        )

    def quantizers(self, num_layers: int) -> tuple[list, list]:
        """Fresh (key, value) quantizer lists, one per layer."""
        return (
            [self.key_quantizer() for _ in range(num_layers)],
            [self.value_quantizer() for _ in range(num_layers)],
        )

    def layout(self, num_layers: int) -> KVCacheLayout:
        keys, values = self.quantizers(num_layers)
        return KVCacheLayout(
            keys,
            values,
            sink_tokens=self.sink_tokens,
            residual_dtype=torch.float16,
            track_positions=self.pre_rope,
        )

    def apply(self, model, context: QuantizeContext) -> None:
        keys, values = self.quantizers(context.adapter.num_layers)
        install_kv_quantization(
            model,
            context.adapter,
            key_quantizers=keys,
            value_quantizers=values,
            pre_rope=self.pre_rope,
            rotate_qk=self.rotate_qk,
            sink_tokens=self.sink_tokens,
            residual_dtype=torch.float16,
        )

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        return self.layout(adapter.num_layers).bytes_per_token(
            adapter.num_kv_heads, adapter.head_dim, context_length
        )
