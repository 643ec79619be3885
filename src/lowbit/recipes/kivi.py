"""The ``kivi`` recipe: KIVI's KV cache (per-channel keys in token groups, per-token values,
the most recent tokens in float16), as lowbit quantizers in lowbit's cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.kv.attention import install_kv_quantization
from lowbit.kv.cache import KVCacheLayout
from lowbit.kv.kivi import KIVI_RESIDUAL, KIVIKeyQuantizer, KIVIValueQuantizer
from lowbit.recipes.base import QuantizeContext, Recipe, check_bits, check_group, check_kv_fits
from lowbit.recipes.registry import register
from lowbit.settings import Count


@register
@dataclass
class KIVIRecipe(Recipe):
    """KIVI's KV cache: keys per channel over token groups, values per token, the most recent
    tokens in float16.

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them).
    """

    method = "kivi"
    roles = frozenset({"kv"})
    paper = "KIVI (Liu et al., 2024)"

    bits: int = 2
    group: int = 32
    residual: Count = KIVI_RESIDUAL

    def validate(self) -> None:
        check_bits("bits", self.bits, allow_off=False)
        check_group("group", self.group)
        if isinstance(self.residual, bool) or self.residual < 0:
            raise LowbitError(f"residual must be a non-negative integer, not {self.residual}")

    def layout(self, num_layers: int) -> KVCacheLayout:
        return KVCacheLayout(
            [KIVIKeyQuantizer(self.bits, self.group) for _ in range(num_layers)],
            [KIVIValueQuantizer(self.bits, self.group) for _ in range(num_layers)],
            fp_window=self.residual,
            residual_dtype=torch.float16,
        )

    def check_model(self, model, context: QuantizeContext) -> None:
        layout = self.layout(1)
        check_kv_fits(context.adapter, [*layout.key_quantizers, *layout.value_quantizers])

    def apply(self, model, context: QuantizeContext) -> None:
        layout = self.layout(context.adapter.num_layers)
        install_kv_quantization(
            model,
            context.adapter,
            key_quantizers=layout.key_quantizers,
            value_quantizers=layout.value_quantizers,
            fp_window=layout.fp_window,
            residual_dtype=layout.residual_dtype,
        )

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        return self.layout(adapter.num_layers).bytes_per_token(
            adapter.num_kv_heads, adapter.head_dim, context_length
        )
