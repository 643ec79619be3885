"""Block floating point KV and query quantizers (Trukhanov & Soloveychik, 2024): BFP12 keys,
BFP16 queries.

Blocks of ``block`` channels run along head_dim inside one head (``block`` must divide
head_dim, so a block never straddles heads), one 8-bit shared exponent per block and a signed
``mantissa_bits`` mantissa per element (:mod:`lowbit.formats.bfp`, OCP MX "floor" exponent).

K-sort enters as a per-head ``channel_order`` ``[H_kv, D]``: the channels are put in that
order before blocking and back after dequantization. This stores exactly the blocks the K-sort
weight permutation (:mod:`lowbit.transforms.permute`) produces — there the permuted keys come
out of ``W_k`` and RoPE carries the order; here the cache permutes them — so the quantized
values are identical, and the orders come from the same :func:`~lowbit.transforms.permute.ksort_order`
of ``W_k`` (or ``W_v``) rows. Queries are BFP16-quantized in their group's key order
(:class:`BFPQueryQuantizer`), per head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.formats.bfp import bfp_dequantize, bfp_quantize, fake_quant_bfp
from lowbit.formats.packing import pack_bits, packed_words_per_row, unpack_bits
from lowbit.kv.quantizer import KVQuantizer, PackedKV, check_kv, register_kv_quantizer
from lowbit.nn.spec import Rebuildable, register_module

__all__ = ["BFPPackedKV", "BFPKVQuantizer", "BFPQueryQuantizer", "check_bfp_block"]


def check_bfp_block(block: int, head_dim: int) -> None:
    """Raise LowbitError unless ``block`` is a positive divisor of ``head_dim``."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or head_dim % block:
        raise LowbitError(
            f"BFP block size {block!r} must divide head_dim {head_dim} (a block never "
            "straddles heads)"
        )


def _check_mantissa(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise LowbitError(f"BFP mantissa bits must be an integer from 2 to 8, not {bits!r}")


def _gather_channels(x: Tensor, order: Tensor) -> Tensor:
    """``x[b, h, t, order[h, j]]``: x [B, H, T, D], order [H, D]."""
    b, h, t, d = x.shape
    return x.gather(-1, order.view(1, h, 1, d).expand(b, h, t, d))


def _scatter_channels(x: Tensor, order: Tensor) -> Tensor:
    """Inverse of :func:`_gather_channels`."""
    b, h, t, d = x.shape
    return torch.empty_like(x).scatter_(-1, order.view(1, h, 1, d).expand(b, h, t, d), x)


@dataclasses.dataclass
class BFPPackedKV(PackedKV):
    """Packed BFP keys or values.

    Fields:
        mantissas: uint8 ``[B, H, T, ceil(D * p / 8)]``, ``p``-bit mantissas offset by
            ``2**(p-1)``, packed per token row in the sorted channel order.
        exponents: uint8 ``[B, H, T, D / block]`` biased shared exponents.
        quantizer: the quantizer, whose ``channel_order`` (shared, not per token) applies.
    """

    mantissas: Tensor | None = None
    exponents: Tensor | None = None
    mantissa_bits: int = 4
    block: int = 32
    quantizer: Any = None

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        b, h, t, d = self.shape
        p = self.mantissa_bits
        mant = unpack_bits(self.mantissas, p, d).to(torch.int16) - 2 ** (p - 1)  # [B, H, T, D]
        blocks = mant.to(torch.int8).view(b, h, t, d // self.block, self.block)
        out = bfp_dequantize(blocks, self.exponents).view(b, h, t, d)
        order = self.quantizer.channel_order
        if order is not None:
            out = _scatter_channels(out, order)
        return out.to(self.dtype if dtype is None else dtype)


@register_kv_quantizer
class BFPKVQuantizer(KVQuantizer):
    """BFP keys or values per token, blocks along head_dim, optional K-sort channel order.

    Args:
        mantissa_bits: ``p`` (4 = BFP12, 8 = BFP16).
        block: channels per shared exponent, a divisor of head_dim.
        num_heads, head_dim: the layer's KV heads and head size (for the order buffer).
        sorted: keep a ``channel_order`` buffer (set it from ``ksort_order``).
    """

    kind = "bfp"
    token_group = 1

    def __init__(
        self,
        mantissa_bits: int = 4,
        block: int = 32,
        num_heads: int = 1,
        head_dim: int = 64,
        sorted: bool = False,
    ) -> None:
        super().__init__()
        _check_mantissa(mantissa_bits)
        check_bfp_block(block, head_dim)
        self.mantissa_bits, self.block = mantissa_bits, block
        self.num_heads, self.head_dim, self.sorted = num_heads, head_dim, bool(sorted)
        order = torch.arange(head_dim).expand(num_heads, -1).clone() if sorted else None
        self.register_buffer("channel_order", order)

    def settings(self) -> dict[str, Any]:
        return dict(
            mantissa_bits=self.mantissa_bits,
            block=self.block,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            sorted=self.sorted,
        )

    def check(self, head_dim: int) -> None:
        if head_dim != self.head_dim:
            raise LowbitError(f"this BFP quantizer was built for head_dim {self.head_dim}")
        check_bfp_block(self.block, head_dim)

    def bits_per_element(self, head_dim: int) -> float:
        """``p + 8 / block`` (mantissas in whole bytes per token row)."""
        self.check(head_dim)
        return 8 * packed_words_per_row(head_dim, self.mantissa_bits) / head_dim + 8 / self.block

    def quantize(self, x: Tensor) -> BFPPackedKV:
        check_kv(x, self.token_group)
        b, h, t, d = x.shape
        self.check(d)
        if self.channel_order is not None:
            x = _gather_channels(x, self.channel_order)
        mant, exponents = bfp_quantize(x, self.mantissa_bits, self.block, axis=-1)
        unsigned = (mant.to(torch.int16) + 2 ** (self.mantissa_bits - 1)).to(torch.uint8)
        return BFPPackedKV(
            shape=x.shape,
            dtype=x.dtype,
            mantissas=pack_bits(unsigned.view(b, h, t, d), self.mantissa_bits),
            exponents=exponents,  # [B, H, T, D / block]
            mantissa_bits=self.mantissa_bits,
            block=self.block,
            quantizer=self,
        )


@register_module
class BFPQueryQuantizer(Rebuildable, nn.Module):
    """Simulated BFP quantization of queries ``[B, H_q, S, D]`` (BFP16: 8-bit mantissas), per
    head in the channel order of the head's KV group (``order`` ``[H_kv, D]`` or None)."""

    spec_fields = {"mantissa_bits": int, "block": int, "head_dim": int, "order_shape": list | None}

    def __init__(
        self, mantissa_bits: int, block: int, head_dim: int, order: Tensor | None = None
    ) -> None:
        super().__init__()
        _check_mantissa(mantissa_bits)
        check_bfp_block(block, head_dim)
        self.mantissa_bits, self.block, self.head_dim = mantissa_bits, block, head_dim
        self.register_buffer("order", order)

    def spec(self) -> dict[str, Any]:
        order = self.order
        return {
            "mantissa_bits": self.mantissa_bits,
            "block": self.block,
            "head_dim": self.head_dim,
            "order_shape": None if order is None else list(order.shape),  # [H_kv, D]
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> BFPQueryQuantizer:
        shape = spec["order_shape"]
        if shape is not None and (
            len(shape) != 2 or not all(type(n) is int and n > 0 for n in shape)
        ):
            raise LowbitError(f"the checkpoint's BFPQueryQuantizer has a bad order shape {shape!r}")
        order = None if shape is None else torch.zeros(shape, dtype=torch.long)
        return cls(spec["mantissa_bits"], spec["block"], spec["head_dim"], order)

    def forward(self, q: Tensor) -> Tensor:
        if self.order is None:
            return fake_quant_bfp(q, self.mantissa_bits, self.block, -1)
        order = self.order.repeat_interleave(q.shape[1] // self.order.shape[0], dim=0)  # [H_q, D]
        sorted_q = _gather_channels(q, order)
        return _scatter_channels(
            fake_quant_bfp(sorted_q, self.mantissa_bits, self.block, -1), order
        )

    def extra_repr(self) -> str:
        return f"mantissa_bits={self.mantissa_bits}, block={self.block}"
