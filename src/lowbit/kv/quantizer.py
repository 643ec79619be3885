"""The KV quantizer interface: what a quantized KV cache asks of a number format.

A :class:`KVQuantizer` turns a run of keys or values ``[B, H_kv, T, D]`` into a
:class:`PackedKV` that really holds packed bits; the cache (:mod:`lowbit.kv.cache`) keeps a list
of those per layer and hands dequantized tensors to attention. One quantizer object serves one
layer and one of K or V, so calibrated state (codebooks, thresholds, channel orders) lives on it.

Decisions:

* ``token_group``: the cache hands ``quantize`` exactly a multiple of this many tokens (1 for
  per-token formats; KIVI's per-channel keys use 32). Tokens not yet making a whole group wait
  in the cache's fp residual buffer. Groups are aligned to the first cached token after the
  attention sinks, so the same tokens form the same groups however the sequence arrives.
* Stored tensors are batch-first: every tensor a :class:`PackedKV` stores has the batch as
  axis 0 and a token-proportional axis 2 (``T`` or ``T / token_group`` rows). That is what lets
  the cache select batch rows (beam search, ``batch_select_indices``), append chunks
  (``concat``) and drop trailing tokens (``head``, for ``crop``) without knowing the format. A
  format that breaks this overrides ``select_batch`` / ``concat`` / ``head``. State shared
  across tokens (a codebook) stays on the quantizer; a PackedKV may reference it, and it is not
  counted per token.
* New tokens join the cache's open page through ``extend(page, x, capacity)``: the same stored
  bits as joining ``page`` and ``quantize(x)``; the default joins (``concat``), a format may
  write in place into room it keeps for the page (KVQuant's decode step).
* Two faces, one result: ``fake_quant(x)`` (simulated) equals ``quantize(x).dequantize()`` bit
  for bit. The default ``fake_quant`` is exactly that; a faster override must keep it.
* ``nbytes()`` is measured (``numel * element_size`` of the stored tensors), never computed from
  the format; ``bits_per_element(head_dim)`` is the analytic figure with all metadata counted.
* Quantizers are ``nn.Module``s so that calibrated tensors are buffers: they move with
  ``model.to(device)`` and save through ``state_dict()`` (safetensors, no pickle); the
  settings round-trip through ``to_dict()`` / :func:`kv_quantizer_from_dict`, which finds the
  class by its ``kind`` in :data:`KV_QUANTIZERS` (a :class:`~lowbit.registry.Registry`: each
  class registers itself with ``@register_kv_quantizer``, and the builtins table names the module
  of each of lowbit's own, so a checkpoint's cache is rebuilt whatever was imported before) and
  checks the settings against the constructor's annotations first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.nn.spec import StoredFloatBuffers
from lowbit.registry import Registry
from lowbit.settings import check_fields, field_annotations

__all__ = [
    "PackedKV",
    "TokenRoom",
    "KVQuantizer",
    "register_kv_quantizer",
    "kv_quantizer_from_dict",
    "KV_QUANTIZERS",
    "check_kv",
]


@dataclasses.dataclass
class PackedKV:
    """Packed keys or values of ``shape = [B, H_kv, T, D]``.

    Subclasses are dataclasses; their Tensor fields are the stored data (batch-first, axis 2
    proportional to tokens). Non-tensor fields are format settings, equal across chunks of one
    quantizer.
    """

    shape: torch.Size  # [B, H_kv, T, D] of the original tensor
    dtype: torch.dtype  # dtype ``dequantize()`` returns by default
    #: the open page's buffers these tensors are views of, where the next tokens are written in
    #: place (:meth:`KVQuantizer.extend`); None for every other page (a cut, a join or a batch
    #: selection makes one)
    room: Any = dataclasses.field(default=None, repr=False, compare=False, kw_only=True)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The values, ``[B, H_kv, T, D]`` in ``dtype`` (default: the quantized input's)."""
        raise NotImplementedError

    @property
    def num_tokens(self) -> int:
        return int(self.shape[2])

    def stored_tensors(self) -> dict[str, Tensor]:
        """The tensors this object stores, by field name (None fields left out)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }

    def nbytes(self) -> int:
        """Bytes of the stored tensors, measured: ``sum(numel * element_size)``."""
        return sum(t.numel() * t.element_size() for t in self.stored_tensors().values())

    def select_batch(self, index: Tensor) -> PackedKV:
        """The rows ``index`` of the batch (every stored tensor is batch-first)."""
        picked = {
            k: t.index_select(0, index.to(t.device)) for k, t in self.stored_tensors().items()
        }
        shape = torch.Size((len(index), *self.shape[1:]))
        return dataclasses.replace(self, shape=shape, room=None, **picked)

    def head(self, tokens: int) -> PackedKV:
        """The first ``tokens`` tokens (a multiple of the format's token group): each stored
        tensor cut on axis 2 in proportion."""
        n = self.num_tokens
        if not 0 <= tokens <= n:
            raise LowbitError(f"cannot keep {tokens} of {n} tokens")
        cut = {k: t[:, :, : tokens * t.shape[2] // n] for k, t in self.stored_tensors().items()}
        shape = torch.Size((*self.shape[:2], tokens, self.shape[3]))
        return dataclasses.replace(self, shape=shape, room=None, **cut)

    @property
    def token_stride(self) -> int:
        """Tokens that share statistics: a slice starts and ends on a multiple of this."""
        return 1

    @property
    def rotation(self) -> Tensor | None:
        """``R`` ``[D, D]`` when the stored basis is rotated (``dequantize() = stored @ Rᵀ``)
        and ``dequantize(rotate_back=False)`` returns the stored basis; None otherwise."""
        return None

    def slice_tokens(self, start: int, stop: int) -> PackedKV:
        """Tokens ``start:stop`` (multiples of ``token_stride``, or the end): each stored tensor
        cut on axis 2 in proportion, no copy."""
        n = self.num_tokens
        if (start, stop) == (0, n):
            return self
        if not 0 <= start <= stop <= n:
            raise LowbitError(f"cannot slice tokens {start}:{stop} of {n}")
        cut = {
            k: t[:, :, start * t.shape[2] // n : stop * t.shape[2] // n]
            for k, t in self.stored_tensors().items()
        }
        shape = torch.Size((*self.shape[:2], stop - start, self.shape[3]))
        return dataclasses.replace(self, shape=shape, room=None, **cut)

    def dequantize_tokens(
        self, start: int, stop: int, dtype: torch.dtype, *, rotate_back: bool = True
    ) -> Tensor:
        """Tokens ``start:stop`` dequantized, ``[B, H_kv, stop - start, D]``: only the token
        groups that hold them are decoded (what chunked attention reads per chunk).
        ``rotate_back=False`` leaves a rotated format in its stored basis (see ``rotation``)."""
        g = self.token_stride
        lo, hi = start // g * g, min(-(-stop // g) * g, self.num_tokens)
        part = self.slice_tokens(lo, hi)
        if self.rotation is not None:
            out = part.dequantize(dtype, rotate_back=rotate_back)
        else:
            out = part.dequantize(dtype)
        return out if (lo, hi) == (start, stop) else out[:, :, start - lo : stop - lo]

    @classmethod
    def concat(cls, parts: list[PackedKV]) -> PackedKV:
        """Parts of one stream, in token order, as one object (stored tensors joined on axis 2)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        joined = {
            name: torch.cat([p.stored_tensors()[name] for p in parts], dim=2)
            for name in first.stored_tensors()
        }
        tokens = sum(p.num_tokens for p in parts)
        shape = torch.Size((first.shape[0], first.shape[1], tokens, first.shape[3]))
        return dataclasses.replace(first, shape=shape, room=None, **joined)


class TokenRoom:
    """An open page's buffers with room for ``capacity`` tokens, for formats that store one row
    a token in every tensor (axis 2): new tokens are copied in (a decode step copies a token,
    not the page), and the pages made from it are views of its first ``tokens``, which later
    writes never touch."""

    def __init__(self, page: PackedKV, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: dict[str, Tensor] = {}  # name -> [B, H, capacity, ...]
        for name, t in page.stored_tensors().items():
            self.buffers[name] = t.new_empty(*t.shape[:2], capacity, *t.shape[3:])
            self.buffers[name][:, :, : t.shape[2]] = t
        self.tokens = page.num_tokens

    @staticmethod
    def takes(page: PackedKV) -> bool:
        """Whether every stored tensor of ``page`` holds one row a token."""
        return all(t.shape[2] == page.num_tokens for t in page.stored_tensors().values())

    def layout(self) -> tuple:
        """What its pages' descriptors hold besides the token count: nothing, the buffers
        never move."""
        return ()

    def holds(self, page: PackedKV) -> bool:
        """``page`` is this room's latest view (so tokens may be written after it)."""
        ours, theirs = self.buffers.get("codes"), getattr(page, "codes", None)
        return (
            page.num_tokens == self.tokens
            and ours is not None and theirs is not None
            and theirs.data_ptr() == ours.data_ptr() and theirs.shape[0] == ours.shape[0]
        )  # fmt: skip

    def write(self, part: PackedKV) -> bool:
        """Copy ``part``'s tokens in after the room's; False (nothing written) where they do
        not fit or ``part`` stores other tensors."""
        tensors, n, t = part.stored_tensors(), self.tokens, part.num_tokens
        if n + t > self.capacity or tensors.keys() != self.buffers.keys():
            return False
        for name, tensor in tensors.items():
            self.buffers[name][:, :, n : n + t] = tensor
        self.tokens = n + t
        return True

    def page(self, like: PackedKV) -> PackedKV:
        """The tokens written so far as a page (views), with ``like``'s settings."""
        n = self.tokens
        views = {name: t[:, :, :n] for name, t in self.buffers.items()}
        shape = torch.Size((*like.shape[:2], n, like.shape[3]))
        return dataclasses.replace(like, shape=shape, room=self, **views)


#: every KV quantizer class by ``kind``
KV_QUANTIZERS: Registry[str, type[KVQuantizer]] = Registry(
    "KV quantizer",
    key=lambda cls: cls.kind,
    builtins={
        "int-token": "lowbit.kv.int_quant",
        "int-channel": "lowbit.kv.int_quant",
        "kivi-key": "lowbit.kv.kivi",
        "kivi-value": "lowbit.kv.kivi",
        "kvquant": "lowbit.kv.kvquant",
        "bfp": "lowbit.kv.bfp_quant",
    },
)

#: class decorator: make a KVQuantizer subclass loadable by its ``kind``
register_kv_quantizer = KV_QUANTIZERS.register


class KVQuantizer(StoredFloatBuffers):
    """Quantizes one layer's keys or values. Subclasses set ``kind`` and implement ``quantize``,
    ``bits_per_element`` and ``settings``; calibrated state goes in buffers, which keep their
    dtype when the model's is cast (:class:`~lowbit.nn.spec.StoredFloatBuffers`).

    Attributes:
        token_group: the cache calls ``quantize`` with a multiple of this many tokens.
    """

    kind: ClassVar[str] = ""
    token_group: int = 1

    def quantize(self, x: Tensor) -> PackedKV:
        """Pack ``x``: ``[B, H_kv, T, D]`` float, ``T`` a multiple of ``token_group``."""
        raise NotImplementedError

    def extend(self, page: PackedKV, x: Tensor, capacity: int) -> PackedKV:
        """``page`` followed by the tokens ``x``, as a new PackedKV equal to joining ``page``
        and ``quantize(x)``; ``page`` is left as it was. ``capacity``: the most tokens the
        cache will put in this page, so a format may keep room for them and write new tokens
        in place (a decode step then costs one token, not a copy of the page). The default
        joins (``concat``), which raises NotImplementedError where the format cannot."""
        return type(page).concat([page, self.quantize(x)])

    def fake_quant(self, x: Tensor) -> Tensor:
        """Simulated face: ``quantize(x).dequantize()``, bit for bit; same shape and dtype."""
        return self.quantize(x).dequantize()

    def forward(self, x: Tensor) -> Tensor:
        return self.fake_quant(x)

    def bits_per_element(self, head_dim: int) -> float:
        """Analytic storage per key/value element, every scale, zero and index counted."""
        raise NotImplementedError

    def check(self, head_dim: int) -> None:
        """Raise LowbitError if this quantizer cannot serve heads of ``head_dim`` channels."""

    def settings(self) -> dict[str, Any]:
        """JSON-serialisable constructor arguments (calibrated tensors go in ``state_dict``)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.settings()}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings().items())


def kv_quantizer_from_dict(
    data: dict[str, Any], state: dict[str, Tensor] | None = None
) -> KVQuantizer:
    """Rebuild a quantizer from ``to_dict()`` output (its settings checked against the
    constructor's annotations) and, if given, its ``state_dict()``."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        raise LowbitError(f"a KV quantizer entry needs a kind: {data!r}"[:200])
    cls = KV_QUANTIZERS.get(kind)
    settings = {k: v for k, v in data.items() if k != "kind"}
    check_fields(settings, field_annotations(cls.__init__), f"{kind} KV quantizer")
    quantizer = cls(**settings)
    if state is not None:
        quantizer.load_state_dict(state)
    return quantizer


def check_kv(x: Tensor, token_group: int = 1) -> None:
    """Raise LowbitError unless ``x`` is a float ``[B, H, T, D]`` tensor with ``T`` a multiple
    of ``token_group``."""
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.dim() != 4:
        raise LowbitError(
            f"keys/values must be a float [batch, heads, tokens, head_dim] tensor, got "
            f"{type(x).__name__} {getattr(x, 'dtype', '')} of shape {tuple(getattr(x, 'shape', ()))}"
        )
    if x.shape[2] % token_group:
        raise LowbitError(
            f"this quantizer takes tokens in groups of {token_group}, got {x.shape[2]} tokens"
        )
