"""The ``ksort-bfp`` recipe: K-sort + block floating point KV cache (Trukhanov & Soloveychik, 2024).

Keys are cached before RoPE in BFP12 (4-bit mantissas, one 8-bit exponent per ``block``
channels of a head), their channels sorted per head by the norm of the ``W_k`` rows that make
them, so large channels share exponents; queries go through BFP16 in the same channel order;
values optionally through BFP (``v_mantissa_bits``), optionally sorted by ``W_v`` row norms.

Where the sort lives: the cache's quantizers hold the per-head orders (see
:mod:`lowbit.kv.bfp_quant`), which stores exactly the blocks the compile-time weight
permutation of :func:`lowbit.transforms.permute.ksort_qk` gives (that transform is tested
function-preserving on its own). Queries are quantized after RoPE, as they enter q kᵀ (the
KV attention's query quantizer slot), in blocks of the same sorted channels as the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.kv.attention import install_kv_quantization
from lowbit.kv.bfp_quant import BFPKVQuantizer, BFPQueryQuantizer, check_bfp_block
from lowbit.kv.cache import KVCacheLayout
from lowbit.recipes.base import OFF_BITS, QuantizeContext, Recipe, check_kv_fits
from lowbit.recipes.registry import register
from lowbit.transforms.permute import ksort_order


def _check_mantissa(name: str, bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not (2 <= bits <= 8 or bits == 16):
        raise LowbitError(f"{name} must be between 2 and 8 or 16 for off, not {bits!r}")


@register
@dataclass
class KSortBFPRecipe(Recipe):
    """A block floating point KV cache on K-sorted channels: BFP12 keys before RoPE, BFP16
    queries, values optionally in BFP.

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them).
    """

    method = "ksort-bfp"
    roles = frozenset({"kv"})  # queries are quantized inside the cache's attention
    paper = "K-sort + BFP (Trukhanov & Soloveychik, 2024)"

    k_mantissa_bits: int = 4
    block: int = 32
    sort: bool = True
    q_mantissa_bits: int = 8
    v_mantissa_bits: int = OFF_BITS
    permute_v: bool = False
    pre_rope: bool = True

    def validate(self) -> None:
        for name in ("k_mantissa_bits", "q_mantissa_bits", "v_mantissa_bits"):
            _check_mantissa(name, getattr(self, name))
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise LowbitError(f"block must be a positive integer, not {self.block!r}")
        if self.permute_v and not (self.sort and self.v_mantissa_bits != OFF_BITS):
            raise LowbitError(
                "permute_v sorts the channels of quantized values: it needs sort=true and "
                "v_mantissa_bits 2-8"
            )

    def nothing_to_do(self) -> str | None:
        if OFF_BITS == self.k_mantissa_bits == self.v_mantissa_bits == self.q_mantissa_bits:
            return "keys, values and queries all at 16 bits leave attention in float"
        return None

    def check_model(self, model, context: QuantizeContext) -> None:
        keys, values, _ = self.quantizers(context.adapter)  # checks the block against head_dim
        check_kv_fits(context.adapter, [*keys, *values])

    def quantizers(self, adapter, model=None) -> tuple[list, list, list]:
        """Per-layer key, value and query quantizers; orders from ``model``'s weights when
        sorting (None: identity orders, for the bytes accounting)."""
        h, d = adapter.num_kv_heads, adapter.head_dim
        check_bfp_block(self.block, d)
        keys, values, queries = [], [], []
        for layer in range(adapter.num_layers):
            view = adapter.block(layer) if model is not None else None
            k_order = v_order = None
            if self.sort and view is not None:
                k_order = ksort_order(view.k_proj.weight, h)  # [H_kv, D] on the weight's device
                if self.permute_v:
                    v_order = ksort_order(view.v_proj.weight, h)
            # a layer's quantizers are made where its orders (its weights) are
            device = torch.get_default_device() if view is None else view.k_proj.weight.device
            with torch.device(device):
                for bits, order, sorted_, out in (
                    (self.k_mantissa_bits, k_order, self.sort, keys),
                    (self.v_mantissa_bits, v_order, self.sort and self.permute_v, values),
                ):
                    if bits == OFF_BITS:
                        out.append(None)
                        continue
                    quantizer = BFPKVQuantizer(bits, self.block, h, d, sorted=sorted_)
                    if order is not None:
                        quantizer.channel_order.copy_(order)
                    out.append(quantizer)
                queries.append(
                    None
                    if self.q_mantissa_bits == OFF_BITS
                    else BFPQueryQuantizer(self.q_mantissa_bits, self.block, d, k_order)
                )
        return keys, values, queries

    def apply(self, model, context: QuantizeContext) -> None:
        adapter = context.adapter
        keys, values, queries = self.quantizers(adapter, model)
        install_kv_quantization(
            model,
            adapter,
            key_quantizers=keys,
            value_quantizers=values,
            query_quantizers=queries,
            pre_rope=self.pre_rope,
            residual_dtype=torch.float16,
        )

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        keys, values, _ = self.quantizers(adapter)
        layout = KVCacheLayout(
            keys, values, residual_dtype=torch.float16, track_positions=self.pre_rope
        )
        return layout.bytes_per_token(adapter.num_kv_heads, adapter.head_dim, context_length)
