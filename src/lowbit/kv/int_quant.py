"""Integer KV quantizers: per token (groups along head_dim) and per channel (groups of tokens).

Decisions:

* One container, :class:`IntPackedKV`: codes packed per token row (``ceil(D * bits / 8)`` bytes,
  :func:`lowbit.formats.pack_bits` order), fp16 scales, and either integer zero points (uint8,
  one byte each) or real-valued fp16 minima. Statistics cover ``token_group`` tokens x
  ``channel_group`` channels: ``[B, H, T / token_group, D / channel_group]``. Per token is
  ``(1, group)``, per channel is ``(token_group, 1)``; both concatenate on the token axis.
* ``zero="int"`` follows :mod:`lowbit.formats.intq` (QuaRot/GPTQ): the range
  ``[min(x_min, 0), max(x_max, 0)] * clip_ratio`` maps to codes ``0 .. 2**b - 1`` with an
  integer zero point; codes are chosen with the fp32 scale and the scale is stored in fp16, so
  dequantized values equal ``fake_quant_int(..., scale_dtype=torch.float16)`` bit for bit.
* ``zero="fp16"`` is KIVI's min-max form: ``x ~ q * scale + min`` over ``[x_min, x_max]``, scale
  and min stored in fp16 and used (rounded) to choose the codes.
* ``symmetric=True`` stores no zero point (``zero`` is then ignored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.intq import int_quantize_with, int_scale_zero
from lowbit.formats.packing import pack_bits, packed_words_per_row, unpack_bits
from lowbit.kv.native import quantize_int_tokens
from lowbit.kv.quantizer import (
    KVQuantizer,
    PackedKV,
    TokenRoom,
    check_kv,
    register_kv_quantizer,
)

__all__ = ["IntPackedKV", "IntTokenQuantizer", "IntChannelQuantizer"]

_ZERO_KINDS = ("int", "fp16")
_ZERO_BITS = {"int": 8, "fp16": 16}


@dataclasses.dataclass
class IntPackedKV(PackedKV):
    """Integer-coded keys or values.

    Fields:
        codes: uint8 ``[B, H, T, ceil(D * bits / 8)]``, unsigned codes packed per token row
            (``q + 2**(bits-1)`` when symmetric).
        scale: fp16 ``[B, H, T / token_group, D / channel_group]``.
        zero: uint8 integer zero points (same shape), or None.
        minimum: fp16 real-valued offsets (same shape, ``zero="fp16"``), or None.
    """

    codes: Tensor | None = None
    scale: Tensor | None = None
    zero: Tensor | None = None
    minimum: Tensor | None = None
    bits: int = 4
    symmetric: bool = False
    token_group: int = 1
    channel_group: int = 1

    @property
    def token_stride(self) -> int:
        return self.token_group

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        b, h, t, d = self.shape
        q = unpack_bits(self.codes, self.bits, d).float()  # [B, H, T, D]
        if self.symmetric:
            q = q - 2 ** (self.bits - 1)
        tg, cg = self.token_group, self.channel_group
        q = q.view(b, h, t // tg, tg, d // cg, cg)

        def stat(s: Tensor) -> Tensor:
            return s.float()[:, :, :, None, :, None]  # [B, H, T/tg, 1, D/cg, 1]

        if self.zero is not None:
            out = (q - stat(self.zero)) * stat(self.scale)
        elif self.minimum is not None:
            out = q * stat(self.scale) + stat(self.minimum)
        else:
            out = q * stat(self.scale)
        return out.view(b, h, t, d).to(self.dtype if dtype is None else dtype)


def _check_settings(bits: int, symmetric: bool, clip_ratio: float, zero: str) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise LowbitError(f"KV cache bits must be an integer from 2 to 8, not {bits!r}")
    if not 0.0 < float(clip_ratio) <= 1.0:
        raise LowbitError(f"clip_ratio must be in (0, 1], not {clip_ratio!r}")
    if zero not in _ZERO_KINDS:
        raise LowbitError(f"zero must be one of {_ZERO_KINDS}, not {zero!r}")


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise LowbitError(f"{name} must be a positive integer, not {value!r}")


class _IntKVQuantizer(KVQuantizer):
    """Shared code of the two integer layouts; ``_axis`` is -1 (per token) or -2 (per channel)."""

    _axis = -1

    def __init__(self, bits: int, *, symmetric: bool, clip_ratio: float, zero: str) -> None:
        super().__init__()
        _check_settings(bits, symmetric, clip_ratio, zero)
        self.bits = bits
        self.symmetric = symmetric
        self.clip_ratio = float(clip_ratio)
        self.zero = zero

    def _groups(self, head_dim: int) -> tuple[int, int]:
        """(token_group, channel_group) of the statistics."""
        raise NotImplementedError

    def _zero_bits(self) -> int:
        return 0 if self.symmetric else _ZERO_BITS[self.zero]

    def bits_per_element(self, head_dim: int) -> float:
        self.check(head_dim)
        tg, cg = self._groups(head_dim)
        code_bits = 8 * packed_words_per_row(head_dim, self.bits) / head_dim
        return code_bits + (16 + self._zero_bits()) / (tg * cg)

    def quantize(self, x: Tensor) -> IntPackedKV:
        check_kv(x, self.token_group)
        b, h, t, d = x.shape
        self.check(d)
        tg, cg = self._groups(d)
        group = cg if self._axis == -1 else tg
        if self._axis == -1 and not self.symmetric:
            # the compiled store where it is built (lowbit.kv.native), else torch below
            minimum = self.zero == "fp16"
            compiled = quantize_int_tokens(x, self.bits, cg, self.clip_ratio, minimum)
            if compiled is not None:
                codes, scale, zero = compiled
                return IntPackedKV(
                    shape=x.shape, dtype=x.dtype, codes=codes, scale=scale,
                    zero=None if minimum else zero, minimum=zero if minimum else None,
                    bits=self.bits, symmetric=False, token_group=tg, channel_group=cg,
                )  # fmt: skip
        if self.symmetric or self.zero == "int":
            scale, zero = int_scale_zero(
                x, self.bits, symmetric=self.symmetric, axis=self._axis, group_size=group,
                clip_ratio=self.clip_ratio,
            )  # fmt: skip
            q = int_quantize_with(
                x,
                scale,
                zero,
                self.bits,
                symmetric=self.symmetric,
                axis=self._axis,
                group_size=group,
            )  # fmt: skip  [B, H, T, D] int8 or uint8
            unsigned = (
                (q.to(torch.int16) + 2 ** (self.bits - 1)).to(torch.uint8) if self.symmetric else q
            )
            zero_stored = None if zero is None else zero.to(torch.uint8)
            minimum = None
            scale = scale.to(torch.float16)
        else:
            unsigned, scale, minimum = self._minmax_codes(x, tg, cg)
            zero_stored = None
        return IntPackedKV(
            shape=x.shape,
            dtype=x.dtype,
            codes=pack_bits(unsigned, self.bits),
            scale=scale,
            zero=zero_stored,
            minimum=minimum,
            bits=self.bits,
            symmetric=self.symmetric,
            token_group=tg,
            channel_group=cg,
        )

    def _minmax_codes(self, x: Tensor, tg: int, cg: int) -> tuple[Tensor, Tensor, Tensor]:
        """KIVI's form: codes of ``(x - min) / scale`` with fp16 min and scale."""
        b, h, t, d = x.shape
        xg = x.float().view(b, h, t // tg, tg, d // cg, cg)
        lo = xg.amin(dim=(3, 5), keepdim=True)  # [B, H, T/tg, 1, D/cg, 1]
        hi = xg.amax(dim=(3, 5), keepdim=True)
        mid = 0.5 * (lo + hi)
        lo = mid + (lo - mid) * self.clip_ratio
        hi = mid + (hi - mid) * self.clip_ratio
        scale = (hi - lo) / (2**self.bits - 1)
        scale16 = torch.where(scale == 0, torch.ones_like(scale), scale).to(torch.float16)
        lo16 = lo.to(torch.float16)
        q = torch.round((xg - lo16.float()) / scale16.float()).clamp_(0, 2**self.bits - 1)
        return (
            q.view(b, h, t, d).to(torch.uint8),
            scale16.view(b, h, t // tg, d // cg),
            lo16.view(b, h, t // tg, d // cg),
        )


@register_kv_quantizer
class IntTokenQuantizer(_IntKVQuantizer):
    """Per-token integer quantization in groups of ``group_size`` channels (None = head_dim).

    QuaRot's cache: ``IntTokenQuantizer(bits, group_size=None, symmetric=False,
    clip_ratio=0.95)`` on keys rotated by the online Hadamard after RoPE.
    """

    kind = "int-token"
    token_group = 1
    _axis = -1

    def __init__(
        self,
        bits: int = 4,
        group_size: int | None = None,
        symmetric: bool = False,
        clip_ratio: float = 1.0,
        zero: str = "int",
    ) -> None:
        super().__init__(bits, symmetric=symmetric, clip_ratio=clip_ratio, zero=zero)
        _check_positive("group_size", group_size)
        self.group_size = group_size

    def check(self, head_dim: int) -> None:
        if self.group_size is not None and head_dim % self.group_size:
            raise LowbitError(
                f"KV group size {self.group_size} does not divide head_dim {head_dim}"
            )

    def _groups(self, head_dim: int) -> tuple[int, int]:
        return 1, self.group_size or head_dim

    def extend(self, page: PackedKV, x: Tensor, capacity: int) -> PackedKV:
        """``page`` followed by ``x``: the new tokens quantized and copied into the page's
        :class:`~lowbit.kv.quantizer.TokenRoom` for ``capacity`` tokens (made on the first
        extension: one copy of the page), every stored tensor being one row a token; joined
        (:meth:`KVQuantizer.extend`) where they do not fit."""
        room = page.room
        if not isinstance(room, TokenRoom) or not room.holds(page):
            if page.num_tokens + x.shape[2] > capacity or not TokenRoom.takes(page):
                return super().extend(page, x, capacity)
            room = TokenRoom(page, capacity)
        part = self.quantize(x)
        return room.page(page) if room.write(part) else type(page).concat([page, part])

    def settings(self) -> dict[str, Any]:
        return dict(
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            clip_ratio=self.clip_ratio,
            zero=self.zero,
        )


@register_kv_quantizer
class IntChannelQuantizer(_IntKVQuantizer):
    """Per-channel integer quantization over runs of ``token_group`` tokens.

    Each channel of each head gets one scale (and zero/min) per ``token_group`` consecutive
    tokens; tokens of an unfinished group wait in the cache's fp residual buffer. KIVI's keys:
    ``IntChannelQuantizer(bits, token_group=32, zero="fp16")``.
    """

    kind = "int-channel"
    _axis = -2

    def __init__(
        self,
        bits: int = 4,
        token_group: int = 128,
        symmetric: bool = False,
        clip_ratio: float = 1.0,
        zero: str = "int",
    ) -> None:
        super().__init__(bits, symmetric=symmetric, clip_ratio=clip_ratio, zero=zero)
        _check_positive("token_group", token_group)
        self.token_group = token_group

    def _groups(self, head_dim: int) -> tuple[int, int]:
        return self.token_group, 1

    def settings(self) -> dict[str, Any]:
        return dict(
            bits=self.bits,
            token_group=self.token_group,
            symmetric=self.symmetric,
            clip_ratio=self.clip_ratio,
            zero=self.zero,
        )
