"""A transformers ``Cache`` whose layers hold keys and values as packed bits.

Per layer and per stream (K, V) the layer stores, in token order:

1. sink tokens: the first ``sink_tokens`` cache slots, kept in floating point;
2. packed pages: :class:`~lowbit.kv.quantizer.PackedKV` objects of ``PAGE_TOKENS`` tokens each
   (the last one open: new tokens extend it, :meth:`~lowbit.kv.quantizer.KVQuantizer.extend`,
   in place where the format keeps room for a page, else by a join that copies at most a
   page, never the whole cache);
3. an fp residual: tokens not yet quantized. After each update the oldest tokens leave the
   residual in whole ``token_group``s as long as at least ``fp_window`` tokens stay behind
   (KIVI's last 128 tokens; 0 for per-token formats, so then the residual is empty). The
   residual grows in place in a buffer of its own, written only past its end, so earlier views
   of it never change and a decode step does not copy the window.

lowbit's attention (:mod:`lowbit.kv.attention`) stores with ``store`` and reads the pages a
chunk at a time (``chunks``, :func:`lowbit.kv.decode.chunked_attention`); transformers'
``update`` returns the whole sequence, dequantized, in the input's dtype (the reference path).
Either way attention sees what the cache really stores, the tokens of the current step
included: evaluating a window
in one pass (``use_cache=False``; attention then uses a throw-away layer) or in chunks gives the
same numbers for per-token formats. For token-grouped formats (per-channel keys) a token is
quantized only once its group is complete, so results depend on how tokens arrive, as in
KIVI's own decoding.

Decisions:

* Sinks are the first ``sink_tokens`` cache *slots*, and also every later token whose position
  is below ``sink_tokens`` when the attention passes positions: with left padding a padded
  row's sink slots hold pads (masked anyway), and its real first tokens are kept in floating
  point beside the packed data ("pinned": row, slot and the fp vector) and written over their
  dequantized slots. Unpadded batches pin nothing.
* Pre-RoPE caching needs every cached token's position; one :class:`PositionTrack` (int32
  ``[B, T]``) is shared by all layers of a cache and counted once, in layer 0's bytes.
* ``residual_dtype`` (default: the model's dtype) is the dtype of sinks and residual; recipes use
  float16 so that the measured bytes match a half-precision deployment.
* ``nbytes()`` is measured from the stored tensors (``numel * element_size``);
  ``get_seq_length`` counts tokens; ``get_mask_sizes`` is ``(past + query, 0)`` as for
  transformers' ``DynamicLayer`` (nothing is evicted, sliding windows are left to the mask).
* ``crop`` (assisted decoding) drops trailing tokens. Per-token formats cut exactly, so the
  cache equals one that never saw the dropped tokens; with token-grouped formats (KIVI's
  per-channel keys) the kept tokens of a split group return to the fp residual as their
  dequantized values, and are quantized again with their group once it completes. The fp
  window is not refilled from packed tokens. Beam search works through ``reorder_cache`` /
  ``batch_select_indices`` on every stored tensor.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from lowbit.errors import LowbitError
from lowbit.kv.quantizer import KVQuantizer, PackedKV

__all__ = ["PositionTrack", "QuantizedKVLayer", "QuantizedKVCache", "KVCacheLayout"]


class PositionTrack:
    """Positions of the cached tokens, ``[B, T]`` int32, shared by the layers of one cache."""

    def __init__(self) -> None:
        self.positions: Tensor | None = None
        self._bounds: tuple | None = None  # (weak reference to positions, its version, low, high)

    def bounds(self) -> tuple[int, int]:
        """The least and the greatest position held: computed once while the same tensor holds
        the positions unchanged (a decode step asks once a layer)."""
        kept = self._bounds
        if kept is None or kept[0]() is not self.positions or kept[1] != self.positions._version:
            low, high = (int(x) for x in torch.aminmax(self.positions))
            kept = self._bounds = (weakref.ref(self.positions), self.positions._version, low, high)
        return kept[2], kept[3]

    def append(self, positions: Tensor) -> None:
        positions = positions.to(torch.int32)
        self.positions = (
            positions if self.positions is None else torch.cat([self.positions, positions], 1)
        )

    def nbytes(self) -> int:
        return 0 if self.positions is None else self.positions.numel() * 4

    def select(self, index: Tensor) -> None:
        if self.positions is not None:
            self.positions = self.positions.index_select(0, index.to(self.positions.device))


class _Stream:
    """Sink + packed chunks + fp residual of one of K or V."""

    def __init__(self, quantizer: KVQuantizer | None, fp_window: int) -> None:
        self.quantizer = quantizer
        self.fp_window = fp_window
        self.sink: Tensor | None = None  # [B, H, s, D]
        self.chunks: list[PackedKV] = []
        self.residual: Tensor | None = None  # [B, H, r, D]
        self.pinned_rows: Tensor | None = None  # [P] int32 batch row of each pinned token
        self.pinned_slots: Tensor | None = None  # [P] int32 cache slot
        self.pinned: Tensor | None = None  # [P, H, D] fp values
        # the residual's buffer [B, H, capacity, D] while it is ``residual_view`` (None: none),
        # and the first slot of the buffer never written
        self.residual_room: Tensor | None = None
        self.residual_view: Tensor | None = None
        self.residual_end = 0

    def append(
        self, x: Tensor, sink_room: int, fp_dtype: torch.dtype, start: int, pin: Tensor | None
    ) -> None:
        """Store new tokens ``x`` [B, H, S, D] at slots ``start..``; the first ``sink_room`` of
        them go to the sink; ``pin`` ([B, S] bool or None) marks later ones also kept in fp."""
        x = x.to(fp_dtype)
        if pin is not None:
            pin = pin.clone()
            pin[:, :sink_room] = False
            rows, steps = pin.nonzero(as_tuple=True)
            if rows.numel():
                values = x[rows, :, steps]  # [P, H, D]
                slots = (steps + start).to(torch.int32)
                self.pinned_rows = _cat(self.pinned_rows, rows.to(torch.int32))
                self.pinned_slots = _cat(self.pinned_slots, slots)
                self.pinned = _cat(self.pinned, values)
        if sink_room > 0:
            head, x = x[:, :, :sink_room], x[:, :, sink_room:]
            # its own storage, not a view holding the whole prompt's keys or values alive
            self.sink = head.contiguous() if self.sink is None else torch.cat([self.sink, head], 2)
        if x.shape[2] == 0:
            return
        group = 1 if self.quantizer is None else self.quantizer.token_group
        packed_now = self.quantizer is not None and self.fp_window == 0 and x.shape[2] % group == 0
        if self.residual is None and packed_now:
            self.residual = x  # every token is packed below: no buffer (per-token formats)
        else:
            self._grow_residual(x, group)
        if self.quantizer is None:
            return
        page = self.page_tokens
        n = max(self.residual.shape[2] - self.fp_window, 0) // group * group
        if n == 0:
            return
        done = 0
        while done < n:  # fill the open page, then whole new pages
            last = self.chunks[-1] if self.chunks else None
            room = page - last.num_tokens if last is not None else page
            if room <= 0:
                last, room = None, page
            take = min(n - done, room)
            whole = take == self.residual.shape[2]  # a decode step's one token: no view to cut
            tokens = self.residual if whole else self.residual[:, :, done : done + take]
            packed = None
            if last is not None:
                try:  # O(page) per step at most, never O(cache)
                    packed = self.quantizer.extend(last, tokens, page)
                    self.chunks.pop()
                except NotImplementedError:
                    pass  # a format that cannot join its chunks keeps small pages
            self.chunks.append(packed if packed is not None else self.quantizer.quantize(tokens))
            done += take
        rest = None if n == self.residual.shape[2] else self.residual[:, :, n:]
        self.residual = rest
        self.residual_view = rest if rest is not None and self.residual_room is not None else None
        if rest is None or self.residual_view is None:
            self.residual_room = self.residual_view = None
        elif self.residual_room.shape[2] > 2 * self._steady_room(group):  # after a long prompt
            self.residual = self.residual_room = None
            self._grow_residual(rest, group)

    def _steady_room(self, group: int) -> int:
        """Tokens of a residual buffer for decode steps: the window, two groups and a tile."""
        return self.fp_window + 2 * group + 16

    def _grow_residual(self, x: Tensor, group: int) -> None:
        """``residual`` followed by ``x`` [B, H, S, D], written in place past the end of the
        residual's buffer where it has room (else in a new one, the residual copied once)."""
        b, h, s, d = x.shape
        held = 0 if self.residual is None else self.residual.shape[2]
        room = self.residual_room
        usable = (
            room is not None
            and self.residual is self.residual_view
            and self.residual_end + s <= room.shape[2]
            and (room.shape[0], room.shape[1], room.shape[3]) == (b, h, d)
            and room.dtype == x.dtype
            and room.device == x.device
        )
        if not usable:
            capacity = max(self._steady_room(group), 2 * (held + s))
            room = self.residual_room = x.new_empty(b, h, capacity, d)
            if held:
                room[:, :, :held] = self.residual
            self.residual_end = held
        end = self.residual_end
        room[:, :, end : end + s] = x
        self.residual_end = end + s
        self.residual = self.residual_view = room[:, :, end - held : end + s]

    @property
    def page_tokens(self) -> int:
        """Tokens of a full page: ``PAGE_TOKENS`` rounded up to whole token groups."""
        group = self.quantizer.token_group
        return -(-PAGE_TOKENS // group) * group

    def layout_key(self) -> tuple:
        """What a description of :meth:`regions` depends on, in one cheap tuple: the identity of
        the sink, of every page (a page's tokens never change) and of the residual, and for an
        open page of a room and a residual growing in its buffer (both written in place from
        step to step) the room or buffer and where it starts instead, the token count alone
        moving. A caller keying descriptions by this keeps those objects alive
        (:meth:`layout_objects`), so that their ids are not reused."""
        chunks = self.chunks
        room = chunks[-1].room if chunks else None
        closed = chunks[:-1] if room is not None else chunks
        open_page = None if room is None else (id(room), room.layout())
        residual = id(self.residual)
        if self.residual is not None and self.residual is self.residual_view:  # grows in place
            residual = (id(self.residual_room), self.residual_end - self.residual.shape[2])
        return id(self.sink), residual, tuple(map(id, closed)), open_page

    def layout_objects(self) -> tuple:
        """The objects whose ids :meth:`layout_key` holds."""
        return self.sink, self.residual, self.residual_room, tuple(self.chunks)

    def heads(self) -> int:
        """The number of KV heads of the stored tokens (0 when none are stored)."""
        part = self.sink if self.sink is not None else (self.chunks or [self.residual])[0]
        return 0 if part is None else part.shape[1]

    def regions(self) -> list[tuple[int, int, Tensor | PackedKV]]:
        """``(start, stop, data)`` of the sink, each packed page and the residual, in slot
        order; ``data`` is an fp tensor or a :class:`PackedKV`."""
        out, start = [], 0
        parts = [] if self.sink is None else [self.sink]
        parts += self.chunks
        if self.residual is not None:
            parts.append(self.residual)
        for part in parts:
            n = part.shape[2] if isinstance(part, Tensor) else part.num_tokens
            if n:
                out.append((start, start + n, part))
            start += n
        return out

    def decode(
        self, region: tuple[int, int, Tensor | PackedKV], start: int, stop: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor | None]:
        """Slots ``start:stop`` (inside ``region``) as ``([B, H, n, D] in dtype, R or None)``:
        a rotated format's values stay in their stored basis and ``R`` is returned (the value
        is ``x @ Rᵀ``); pinned tokens in the range are written over their slots."""
        r0, _, data = region
        rotation = None
        if isinstance(data, Tensor):
            out = data[:, :, start - r0 : stop - r0].to(dtype)
        else:
            rotation = data.rotation
            out = data.dequantize_tokens(start - r0, stop - r0, dtype, rotate_back=False)
        if self.pinned is not None:
            hit = (self.pinned_slots >= start) & (self.pinned_slots < stop)
            if bool(hit.any()):
                pinned = self.pinned[hit].to(dtype)  # [P', H, D]
                if rotation is not None:  # pinned fp values, moved to the stored basis
                    pinned = pinned @ rotation.to(dtype)
                out = out.clone() if isinstance(data, Tensor) else out
                rows, slots = self.pinned_rows[hit].long(), self.pinned_slots[hit].long()
                out[rows, :, slots - start] = pinned
        return out, rotation

    def full(self, dtype: torch.dtype) -> Tensor:
        """Every stored token, dequantized, [B, H, T, D] in ``dtype``."""
        parts = [] if self.sink is None else [self.sink.to(dtype)]
        parts += [c.dequantize(dtype) for c in self.chunks]
        if self.residual is not None:
            parts.append(self.residual.to(dtype))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
        if self.pinned is not None:
            out = out.clone() if len(parts) == 1 else out
            out[self.pinned_rows.long(), :, self.pinned_slots.long()] = self.pinned.to(dtype)
        return out

    def crop(self, keep: int, fp_dtype: torch.dtype) -> None:
        """Keep the first ``keep`` cache slots. Whole token groups stay packed; the kept tokens
        of a group the cut splits go back to the fp residual as their dequantized values."""
        if self.pinned is not None:
            kept = self.pinned_slots < keep
            self.pinned_rows, self.pinned_slots = self.pinned_rows[kept], self.pinned_slots[kept]
            self.pinned = self.pinned[kept]
        rest = keep
        if self.sink is not None:
            rest = max(keep - self.sink.shape[2], 0)
            self.sink = self.sink[:, :, :keep]
        chunks, tail = [], None
        for chunk in self.chunks:
            if rest >= chunk.num_tokens:
                chunks.append(chunk)
                rest -= chunk.num_tokens
                continue
            whole = rest // self.quantizer.token_group * self.quantizer.token_group
            if whole:
                chunks.append(chunk.head(whole))
            if rest > whole:
                tail = chunk.dequantize(fp_dtype)[:, :, whole:rest]
            rest = 0
            break
        else:
            if self.residual is not None:
                tail = self.residual[:, :, :rest]
        self.chunks = chunks
        self.residual = tail if tail is not None and tail.shape[2] else None

    def nbytes(self) -> int:
        total = sum(c.nbytes() for c in self.chunks)
        for t in (self.sink, self.residual, self.pinned, self.pinned_rows, self.pinned_slots):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def select(self, index: Tensor) -> None:
        self.chunks = [c.select_batch(index) for c in self.chunks]
        if self.sink is not None:
            self.sink = self.sink.index_select(0, index.to(self.sink.device))
        if self.residual is not None:
            self.residual = self.residual.index_select(0, index.to(self.residual.device))
        if self.pinned is not None:  # new row j takes old row index[j]'s pinned tokens
            match = self.pinned_rows[None, :] == index.to(self.pinned_rows.device)[:, None]
            new_rows, entries = match.nonzero(as_tuple=True)  # [P'] each
            self.pinned_rows = new_rows.to(torch.int32)
            self.pinned_slots = self.pinned_slots[entries]
            self.pinned = self.pinned[entries]


#: tokens per packed page: storage grows a page at a time, and chunked attention decodes one
#: page (or less) at a time
PAGE_TOKENS = 1024


def _cat(old: Tensor | None, new: Tensor) -> Tensor:
    return new if old is None else torch.cat([old, new])


class QuantizedKVLayer(CacheLayerMixin):
    """One decoder layer's quantized keys and values.

    Args:
        key_quantizer, value_quantizer: quantizers, or None to keep that stream in fp.
        sink_tokens: leading cache slots kept in floating point (attention sink).
        fp_window: most recent tokens kept in floating point (KIVI: 128).
        residual_dtype: dtype of the fp parts (None: the dtype of the first update).
        positions: the cache's shared :class:`PositionTrack` when keys are cached before RoPE.
        owns_positions: this layer appends to ``positions`` and counts its bytes (layer 0).
    """

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(
        self,
        key_quantizer: KVQuantizer | None = None,
        value_quantizer: KVQuantizer | None = None,
        *,
        sink_tokens: int = 0,
        fp_window: int = 0,
        residual_dtype: torch.dtype | None = None,
        positions: PositionTrack | None = None,
        owns_positions: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("sink_tokens", sink_tokens), ("fp_window", fp_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LowbitError(f"{name} must be a non-negative integer, not {value!r}")
        self.key_quantizer = key_quantizer
        self.value_quantizer = value_quantizer
        self.sink_tokens = sink_tokens
        self.fp_window = fp_window
        self.residual_dtype = residual_dtype
        self.track = positions
        self.owns_positions = owns_positions
        self._reset_storage()

    def _reset_storage(self) -> None:
        self.k = _Stream(self.key_quantizer, self.fp_window)
        self.v = _Stream(self.value_quantizer, self.fp_window)
        #: the Triton decode's fp keys rotated to their positions, by first slot: (weak reference
        #: to the stored tensor, its version and last slot, the rotated keys); a sink's never change
        self.rotated_fp_keys: dict[int, tuple] = {}
        #: decode attention's library structures of the keys and values, kept between steps
        #: (:func:`lowbit.kv.decode._stream`)
        self.decode_streams: dict[str, tuple] = {}
        self.length = 0
        self.keys = self.values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.residual_dtype is None:
            self.residual_dtype = key_states.dtype
        self.is_initialized = True

    def store(
        self, key_states: Tensor, value_states: Tensor, cache_kwargs: dict | None = None
    ) -> None:
        """Store new keys/values [B, H_kv, S, D] (packed a page at a time).

        ``cache_kwargs["positions"]`` ([B, S] or [1, S]) is required when the cache tracks
        positions (pre-RoPE keys); with sinks it also pins tokens at positions below
        ``sink_tokens`` that arrive after the sink slots (left padding).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = (cache_kwargs or {}).get("positions")
        batch, steps = key_states.shape[0], key_states.shape[2]
        if positions is not None:
            positions = positions.to(key_states.device).expand(batch, steps)
        if self.track is not None and self.owns_positions:
            if positions is None:
                raise LowbitError("a pre-RoPE KV cache needs the positions of the new tokens")
            self.track.append(positions)
        sink_room = max(self.sink_tokens - self.length, 0)
        pin = None
        if (
            self.sink_tokens
            and positions is not None
            and sink_room < steps
            and int(positions.min()) < self.sink_tokens  # left padding restarts positions
        ):
            pin = positions < self.sink_tokens  # [B, S]
        for stream, states in ((self.k, key_states), (self.v, value_states)):
            stream.append(states, sink_room, self.residual_dtype, self.length, pin)
        self.length += key_states.shape[2]

    def update(
        self, key_states: Tensor, value_states: Tensor, cache_kwargs: dict | None = None, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """Store new keys/values [B, H_kv, S, D]; return all of them, dequantized, [B, H_kv, T, D]
        (transformers' contract; lowbit's attention reads the pages instead: :meth:`store`,
        :meth:`chunks`). ``cache_kwargs`` as for :meth:`store`."""
        self.store(key_states, value_states, cache_kwargs)
        return self.k.full(key_states.dtype), self.v.full(value_states.dtype)

    def chunks(self, dtype: torch.dtype, max_tokens: int | None = None):
        """Every cached slot, a chunk at a time: yields ``(start, stop, k, k_rot, v, v_rot)``
        with ``k``, ``v`` ``[B, H_kv, stop - start, D]`` in ``dtype`` and ``*_rot`` the rotation
        ``R`` of a chunk left in its stored basis (the value is ``x @ Rᵀ``) or None. Chunks
        never cross a page, sink or residual boundary of either stream and hold at most
        ``max_tokens`` slots, so a step decodes one chunk at a time, never the whole cache."""
        max_tokens = max_tokens or PAGE_TOKENS
        regions_k, regions_v = self.k.regions(), self.v.regions()
        bounds = sorted({0} | {r[1] for r in regions_k} | {r[1] for r in regions_v})
        ik = iv = 0
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            for a in range(lo, hi, max_tokens):
                b = min(a + max_tokens, hi)
                while regions_k[ik][1] <= a:
                    ik += 1
                while regions_v[iv][1] <= a:
                    iv += 1
                k, k_rot = self.k.decode(regions_k[ik], a, b, dtype)
                v, v_rot = self.v.decode(regions_v[iv], a, b, dtype)
                yield a, b, k, k_rot, v, v_rot

    def positions(self, start: int = 0, stop: int | None = None) -> Tensor:
        """Positions of the cached tokens in slots ``start:stop`` (all by default), [B, n] long
        (pre-RoPE caches only)."""
        if self.track is None or self.track.positions is None:
            raise LowbitError("this KV cache does not track positions (keys are cached after RoPE)")
        return self.track.positions[:, start:stop].long()

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held by this layer's stored tensors (positions counted by the owner only)."""
        own = self.track.nbytes() if (self.track is not None and self.owns_positions) else 0
        return self.k.nbytes() + self.v.nbytes() + own

    def reset(self) -> None:
        self._reset_storage()
        if self.track is not None and self.owns_positions:
            self.track.positions = None

    def offload(self) -> None:  # storage is spread over several tensors; kept in place
        pass

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative
        count; assisted decoding rolls rejected draft tokens back this way)."""
        if tokens_to_remove > 0:
            raise LowbitError(
                f"crop takes a negative number of tokens to remove, not {tokens_to_remove}"
            )
        if tokens_to_remove == 0 or self.length == 0:
            return
        keep = max(self.length + tokens_to_remove, 0)
        self.k.crop(keep, self.residual_dtype)
        self.v.crop(keep, self.residual_dtype)
        if self.track is not None and self.owns_positions and self.track.positions is not None:
            self.track.positions = self.track.positions[:, :keep]
        self.length = keep

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.length == 0:
            return
        index = torch.arange(self._batch_size(), device=self.device)[indices]
        self._select(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length == 0:
            return
        batch = self._batch_size()
        self._select(torch.arange(batch, device=self.device).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length:
            self._select(beam_idx)

    def _batch_size(self) -> int:
        for t in (self.k.sink, self.k.residual):
            if t is not None:
                return t.shape[0]
        return self.k.chunks[0].shape[0]

    def _select(self, index: Tensor) -> None:
        self.k.select(index)
        self.v.select(index)
        if self.track is not None and self.owns_positions:
            self.track.select(index)


class QuantizedKVCache(Cache):
    """A ``Cache`` of :class:`QuantizedKVLayer`, one per decoder layer (build it with
    ``model.lowbit_make_cache()`` after installing quantization)."""

    def __init__(self, layers: list[QuantizedKVLayer]) -> None:
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        """Bytes of every stored tensor of every layer, measured."""
        return sum(layer.nbytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """Measured bytes per cached token (all layers, K and V, metadata, fp parts)."""
        tokens = self.get_seq_length()
        if tokens == 0:
            raise LowbitError("the KV cache is empty; run the model on some tokens first")
        batch = self.layers[0]._batch_size()
        return self.nbytes() / (tokens * batch)


@dataclasses.dataclass
class KVCacheLayout:
    """What every cache of one model stores: quantizers per layer and the fp parts.

    Attributes:
        key_quantizers, value_quantizers: one per decoder layer (None keeps that stream in fp).
        sink_tokens: leading slots kept in floating point.
        fp_window: most recent tokens kept in floating point.
        residual_dtype: dtype of the fp parts (None: the model's).
        track_positions: keys are cached before RoPE, so positions are kept.
    """

    key_quantizers: list[KVQuantizer | None]
    value_quantizers: list[KVQuantizer | None]
    sink_tokens: int = 0
    fp_window: int = 0
    residual_dtype: torch.dtype | None = None
    track_positions: bool = False

    def make_layers(self) -> list[QuantizedKVLayer]:
        """Fresh, empty layers for one cache (one shared position track when needed)."""
        track = PositionTrack() if self.track_positions else None
        return [
            QuantizedKVLayer(
                kq,
                vq,
                sink_tokens=self.sink_tokens,
                fp_window=self.fp_window,
                residual_dtype=self.residual_dtype,
                positions=track,
                owns_positions=(i == 0),
            )
            for i, (kq, vq) in enumerate(
                zip(self.key_quantizers, self.value_quantizers, strict=True)
            )
        ]

    def make_layer(self, index: int) -> QuantizedKVLayer:
        """A stand-alone layer (used for one forward pass without a cache)."""
        return QuantizedKVLayer(
            self.key_quantizers[index],
            self.value_quantizers[index],
            sink_tokens=self.sink_tokens,
            fp_window=self.fp_window,
            residual_dtype=self.residual_dtype,
            positions=PositionTrack() if self.track_positions else None,
            owns_positions=True,
        )

    def make_cache(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.make_layers())

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        """Analytic bits per quantized element of the keys and of the values, each the mean
        over the layers (16 where a layer keeps the stream in fp16): layers may differ, as
        ``kvquant``'s shared outliers do."""

        def mean(quantizers: list[KVQuantizer | None]) -> float:
            bits = [16.0 if q is None else q.bits_per_element(head_dim) for q in quantizers]
            return sum(bits) / len(bits)

        return mean(self.key_quantizers), mean(self.value_quantizers)

    def bytes_per_token(
        self, num_kv_heads: int, head_dim: int, context_length: int, fp_bytes: float = 2.0
    ) -> float:
        """Analytic bytes per token once ``context_length`` tokens are cached (batch 1).

        Sinks and the fp residual count ``fp_bytes`` per element (2: float16), quantized tokens
        ``bits_per_element / 8``, positions 4 bytes per token when tracked. The split between
        quantized and fp tokens does not depend on how the tokens arrived, so this equals the
        measured ``QuantizedKVCache.bytes_per_token()`` whenever the formats' stored bytes
        match their analytic bits (whole bytes per packed row).
        """
        if context_length < 1:
            raise LowbitError(f"context_length must be positive, not {context_length}")
        sink = min(self.sink_tokens, context_length)
        rest = context_length - sink
        total = 4.0 * context_length if self.track_positions else 0.0
        for quantizers in (self.key_quantizers, self.value_quantizers):
            for q in quantizers:
                if q is None:
                    total += num_kv_heads * head_dim * context_length * fp_bytes
                    continue
                packed = max(rest - self.fp_window, 0) // q.token_group * q.token_group
                fp_tokens = context_length - packed
                total += (
                    num_kv_heads
                    * head_dim
                    * (fp_tokens * fp_bytes + packed * q.bits_per_element(head_dim) / 8)
                )
        return total / context_length
