"""KVQuant's KV quantizer (Hooper et al., 2024): nuqX codebooks, per-channel keys,
dense-and-sparse outliers.

One :class:`KVQuantQuantizer` per layer and per K/V. Every element is coded with ``bits``-bit
indices into a per-layer codebook of ``2**bits`` levels on ``[-1, 1]`` after a normalization:

* ``per_channel=True`` (keys): each channel of each head is normalized by a range calibrated
  offline, ``center ± half_range`` (fp16 buffers ``[H_kv, D]``), from quantiles of the
  calibration keys (the first token of every sample masked out). Elements outside their
  channel's range are the outliers (thresholds per channel, calibrated offline). KVQuant puts
  ``outlier_fraction / 2`` of every channel outside at each end (``outlier_allocation="even"``);
  by default the layer's ``outlier_fraction`` goes to the channels and ends where it cuts the
  most Fisher-weighted error (``"least-error"``, :func:`_allocated_channel_range`), at the
  same bytes: key channels are not alike (some heavy-tailed, most not), so an even split
  spends outliers where they cut little (docs/results/kv-cache.md). With no outliers the
  range is the per-channel quantile range with the least (Fisher-weighted) squared error, and
  values beyond it clamp.
* ``per_channel=False`` (values; keys in the per-token ablation): each token of each head is
  normalized online by the min/max of its non-outlier elements (fp16 center and half range per
  token and head). The outliers are the ``round(outlier_fraction * H_kv * D)`` largest
  magnitudes of each token (thresholds per token, online).

``rotate=True`` (values, per token; not in KVQuant) codes each token's head vector ``x`` as
``x @ R``, ``R`` QuaRot's randomized Hadamard over head_dim (:func:`token_rotation`), and
dequantizes to ``x̂ Rᵀ``: a few large channels no longer set every token's range, and the
rotated values are closer to Gaussian, which the codebook fits. Ranges, outliers, codes and the
codebook all live in the rotated basis; the Fisher weights are those of the rotated values.
A fused kernel would rotate back once per query instead, on ``Σ a_t x̂_t`` (``Rᵀ`` is linear).
It costs no bytes; its effect at each width is in docs/results/kv-cache.md.

Outliers are kept as fp16 in CSR, one row per token (and batch row) over the token's
``H_kv * D`` channels, with :mod:`lowbit.formats.sparse`'s 32-bit words (16-bit channel index,
fp16 value) — KVQuant appends one compressed row per token (keys CSR; values CSC of ``Vᵀ``, the
same storage). Their dense code is whatever the clamped value maps to; dequantization
overwrites it with the stored fp16 value, so outliers come back exactly as fp16.

The codebook is ``lowbit.formats.nuq.fit_codebook`` on the calibration samples' normalized
non-outlier values, weighted by their Fisher information times ``half_range²``: the paper's
objective ``Σ F (a - â)²`` in activation units (KVQuant's nuqX), Lloyd started from the uniform
grid. Lloyd only finds a local minimum, and from its default start (the weighted quantiles) the
heavy-tailed Fisher weights left it worse than the uniform grid in some layers, on its own
objective. Started from the grid it ends no worse than the grid (held-out check in
docs/results/kv-cache.md). Without outliers the end levels stay at ±1, where each range's
largest-magnitude elements sit, so they are reproduced rather than clamped. ``nuq=False`` uses
the uniform grid ``linspace(-1, 1, 2**bits)``, which is asymmetric min-max integer
quantization. ``channel_codebooks=True`` (per-channel keys) fits one codebook per channel
instead, as Algorithm 1 of Zhou's technical review of KVQuant stores them (``[H_kv * D, 2**bits]``
per layer); it is off by default, since it helped the embedded model at 2 bits and not at 3
(docs/results/kv-cache.md). Codebooks and key ranges are the calibrated state
(buffers, saved with ``state_dict``); everything else is computed online.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.formats.accounting import kvquant_bits
from lowbit.formats.nuq import fit_codebook, nuq_dequantize, nuq_quantize
from lowbit.formats.packing import pack_bits, packed_words_per_row, unpack_bits
from lowbit.formats.sparse import pack_index_value, unpack_index_value
from lowbit.kv.native import kvquant_words, quantize_kvquant_tokens, store_kvquant_tokens
from lowbit.kv.quantizer import KVQuantizer, PackedKV, check_kv, register_kv_quantizer
from lowbit.transforms.hadamard import random_hadamard_matrix

__all__ = ["KVQuantPackedKV", "KVQuantQuantizer", "token_rotation", "uniform_codebook"]

#: how calibrated per-channel key ranges share the outliers (see ``KVQuantQuantizer.calibrate``)
OUTLIER_ALLOCATIONS = ("least-error", "even")


def check_outlier_allocation(value: str) -> None:
    """Raise a one-sentence error unless ``value`` is one of :data:`OUTLIER_ALLOCATIONS`."""
    if value not in OUTLIER_ALLOCATIONS:
        choices = ", ".join(OUTLIER_ALLOCATIONS)
        raise LowbitError(f"outlier_allocation must be one of {choices}, not {value!r}")


#: at most this many calibration elements go into one codebook fit (a fixed random subset)
MAX_CODEBOOK_SAMPLES = 2_000_000


#: seed of the random signs of :func:`token_rotation`
ROTATION_SEED = 0


def token_rotation(head_dim: int, device: torch.device | str | None = None) -> Tensor:
    """The orthonormal ``[D, D]`` fp32 rotation ``R`` a ``rotate=True`` quantizer applies to each
    token's head vector before quantizing it (``x @ R``): QuaRot's randomized Hadamard (a random
    orthogonal matrix where no Hadamard of order ``D`` is known), drawn on the CPU and put on
    ``device`` (default: the default device)."""
    return random_hadamard_matrix(
        head_dim, seed=ROTATION_SEED, dtype=torch.float32, device=device, allow_random=True
    )


def uniform_codebook(bits: int, device: torch.device | str | None = None) -> Tensor:
    """``2**bits`` evenly spaced levels on ``[-1, 1]`` (min-max integer quantization)."""
    return torch.linspace(-1.0, 1.0, 2**bits, device=device, dtype=torch.float32)


def _check_settings(bits: int, num_heads: int, head_dim: int, outlier_fraction: float) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise LowbitError(f"KVQuant bits must be an integer from 2 to 8, not {bits!r}")
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LowbitError(f"{name} must be a positive integer, not {value!r}")
    if not 0.0 <= float(outlier_fraction) < 0.5:
        raise LowbitError(f"outlier_fraction must be in [0, 0.5), not {outlier_fraction!r}")
    if num_heads * head_dim > 65536:
        raise LowbitError("a token's outlier row has more than 65536 channels (16-bit indices)")


@dataclasses.dataclass
class _PageRoom:
    """An open page's buffers, with room for ``capacity`` tokens, written in place as tokens
    come: the page objects made from it are views of the first ``tokens`` (and ``words``
    outlier words), which later writes never touch."""

    codes: Tensor  # [B, H, capacity, row bytes] uint8
    center: Tensor | None  # [B, H, capacity, 1] fp16 (per-token ranges), else None
    half_range: Tensor | None
    row_ptr: Tensor  # [capacity * B + 1] int32
    col_val: Tensor  # [room for words] int32, doubled when full
    tokens: int
    words: int

    @classmethod
    def holding(cls, page: KVQuantPackedKV, capacity: int) -> _PageRoom:
        """A room for ``capacity`` tokens holding a copy of ``page``."""
        b, h, t, _ = page.shape

        def room(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            out = x.new_empty(b, h, capacity, x.shape[3])
            out[:, :, :t] = x
            return out

        row_ptr = page.row_ptr.new_empty(capacity * b + 1)
        row_ptr[: t * b + 1] = page.row_ptr
        words = page.col_val.numel()
        col_val = page.col_val.new_empty(max(2 * words, 64))
        col_val[:words] = page.col_val
        return cls(room(page.codes), room(page.center), room(page.half_range), row_ptr, col_val,
                   t, words)  # fmt: skip

    def layout(self) -> tuple:
        """What its latest page's descriptor holds besides the token count and buffers that
        never move: where the outliers' words are, and whether there are any yet."""
        return self.col_val.data_ptr(), self.words > 0

    def holds(self, page: KVQuantPackedKV) -> bool:
        """``page`` is this room's latest view (so tokens may be written after it)."""
        return (
            page.num_tokens == self.tokens
            and page.shape[0] == self.codes.shape[0]
            and page.codes.data_ptr() == self.codes.data_ptr()
        )

    def page(self, like: KVQuantPackedKV) -> KVQuantPackedKV:
        """The tokens written so far as a page (views), with ``like``'s settings."""
        b, h, _, d = like.shape
        n = self.tokens
        return KVQuantPackedKV(
            shape=torch.Size((b, h, n, d)),
            dtype=like.dtype,
            codes=self.codes[:, :, :n],
            center=None if self.center is None else self.center[:, :, :n],
            half_range=None if self.half_range is None else self.half_range[:, :, :n],
            row_ptr=self.row_ptr[: n * b + 1],
            col_val=self.col_val[: self.words],
            quantizer=like.quantizer,
            room=self,
        )


@dataclasses.dataclass
class KVQuantPackedKV(PackedKV):
    """Packed KVQuant keys or values.

    Fields:
        codes: uint8 ``[B, H, T, ceil(D * bits / 8)]`` codebook indices packed per token row.
        center, half_range: fp16 ``[B, H, T, 1]`` per-token normalization, or None when the
            quantizer's per-channel calibrated ranges are used.
        row_ptr: int32 ``[T * B + 1]`` CSR row pointers, one row per (token, batch row) in
            token-major order, so chunks append rows.
        col_val: int32 ``[nnz]`` words: channel ``h * D + d`` << 16 | fp16 bits of the value.
        quantizer: the quantizer (codebook, channel ranges: shared state, not per token).
        room: the open page's buffers these tensors are views of, where the decode step writes
            the next tokens in place (:meth:`KVQuantQuantizer.extend`); None for other pages.
    """

    codes: Tensor | None = None
    center: Tensor | None = None
    half_range: Tensor | None = None
    row_ptr: Tensor | None = None
    col_val: Tensor | None = None
    quantizer: Any = None

    def _outliers(self) -> tuple[Tensor, Tensor, Tensor]:
        """(row, channel, fp32 value) of every stored outlier."""
        counts = (self.row_ptr[1:] - self.row_ptr[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        channels, values = unpack_index_value(self.col_val)
        return rows, channels, values

    def dequantize(self, dtype: torch.dtype | None = None, *, rotate_back: bool = True) -> Tensor:
        """The values ``[B, H, T, D]``; ``rotate_back=False`` keeps a ``rotate`` quantizer's
        stored basis (``x R``), so attention can rotate ``Σ a_t x̂_t`` once instead."""
        b, h, t, d = self.shape
        q = self.quantizer
        idx = unpack_bits(self.codes, q.bits, d)  # [B, H, T, D]
        if self.center is None:
            center = q.center.float()[None, :, None, :]  # [1, H, 1, D]
            half = q.half_range.float()[None, :, None, :]
        else:
            center, half = self.center.float(), self.half_range.float()
        out = q.decode(idx) * half + center  # [B, H, T, D] fp32, contiguous
        if self.col_val.numel():
            rows, channels, values = self._outliers()  # rows: token * B + batch row
            token, batch = rows // b, rows % b
            head, dim = channels // d, channels % d
            flat = ((batch * h + head) * t + token) * d + dim  # [nnz] into [B, H, T, D]
            out = out.contiguous()  # a chunk of the pages may be a strided view
            out.view(-1)[flat] = values
        if q.rotate and rotate_back:  # back from the rotated basis: x = (x R) Rᵀ
            out = out @ q.rotation.float().T
        return out.to(self.dtype if dtype is None else dtype)

    @property
    def rotation(self) -> Tensor | None:
        return self.quantizer.rotation if self.quantizer.rotate else None

    def slice_tokens(self, start: int, stop: int) -> KVQuantPackedKV:
        """Tokens ``start:stop``: codes and statistics cut on axis 2, CSR rows (token-major)
        cut and rebased."""
        b, h, t, d = self.shape
        if (start, stop) == (0, t):
            return self
        if not 0 <= start <= stop <= t:
            raise LowbitError(f"cannot slice tokens {start}:{stop} of {t}")
        row_ptr = self.row_ptr[start * b : stop * b + 1]
        first, last = int(row_ptr[0]), int(row_ptr[-1])
        return dataclasses.replace(
            self,
            shape=torch.Size((b, h, stop - start, d)),
            codes=self.codes[:, :, start:stop],
            center=None if self.center is None else self.center[:, :, start:stop],
            half_range=None if self.half_range is None else self.half_range[:, :, start:stop],
            row_ptr=row_ptr - first,
            col_val=self.col_val[first:last],
            room=None,  # a room is written only through its latest page
        )

    def select_batch(self, index: Tensor) -> KVQuantPackedKV:
        b, h, t, d = self.shape
        index = index.to(self.codes.device)
        rows, channels, values = self._outliers()
        dense = torch.zeros(t, b, h * d, device=values.device)  # [T, B, H*D]
        mask = torch.zeros(t, b, h * d, dtype=torch.bool, device=values.device)
        dense.view(t * b, -1)[rows, channels] = values
        mask.view(t * b, -1)[rows, channels] = True
        row_ptr, col_val = _csr(dense[:, index], mask[:, index])
        pick = {
            k: v.index_select(0, index)
            for k, v in (("codes", self.codes), ("center", self.center), ("half", self.half_range))
            if v is not None
        }
        return dataclasses.replace(
            self,
            shape=torch.Size((len(index), h, t, d)),
            codes=pick["codes"],
            center=pick.get("center"),
            half_range=pick.get("half"),
            row_ptr=row_ptr,
            col_val=col_val,
            room=None,  # a room is written only through its latest page
        )

    def head(self, tokens: int) -> KVQuantPackedKV:
        b, h, t, d = self.shape
        if not 0 <= tokens <= t:
            raise LowbitError(f"cannot keep {tokens} of {t} tokens")
        row_ptr = self.row_ptr[: tokens * b + 1]  # CSR rows are token-major
        return dataclasses.replace(
            self,
            shape=torch.Size((b, h, tokens, d)),
            codes=self.codes[:, :, :tokens],
            center=None if self.center is None else self.center[:, :, :tokens],
            half_range=None if self.half_range is None else self.half_range[:, :, :tokens],
            row_ptr=row_ptr,
            col_val=self.col_val[: int(row_ptr[-1])],
            room=None,  # a room is written only through its latest page
        )

    @classmethod
    def concat(cls, parts: list[KVQuantPackedKV]) -> KVQuantPackedKV:
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        ptrs, offset = [first.row_ptr[:1]], 0
        for p in parts:
            ptrs.append(p.row_ptr[1:] + offset)
            offset += int(p.row_ptr[-1])

        def cat(name: str) -> Tensor | None:
            if getattr(first, name) is None:
                return None
            return torch.cat([getattr(p, name) for p in parts], dim=2)

        tokens = sum(p.num_tokens for p in parts)
        return dataclasses.replace(
            first,
            shape=torch.Size((first.shape[0], first.shape[1], tokens, first.shape[3])),
            codes=cat("codes"),
            center=cat("center"),
            half_range=cat("half_range"),
            row_ptr=torch.cat(ptrs),
            col_val=torch.cat([p.col_val for p in parts]),
            room=None,  # a room is written only through its latest page
        )


def _csr(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """CSR of ``values`` under ``mask`` (both ``[T, B, C]``): one row per (token, batch row)."""
    t, b, c = values.shape
    rows, channels = mask.reshape(t * b, c).nonzero(as_tuple=True)
    words = pack_index_value(channels, values.reshape(t * b, c)[rows, channels])
    counts = torch.bincount(rows, minlength=t * b)
    row_ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return row_ptr, words


def _top_magnitudes(x: Tensor, k: int) -> Tensor:
    """Mask of the ``k`` largest ``|x|`` of each token over all heads: x [B, H, T, D]. Equal
    magnitudes are taken lower channel first (a stable sort: ``topk`` leaves their order open),
    so the selection is defined and the compiled store makes the same one."""
    b, h, t, d = x.shape
    mask = torch.zeros(b, t, h * d, dtype=torch.bool, device=x.device)
    if k > 0:
        flat = x.abs().permute(0, 2, 1, 3).reshape(b, t, h * d)  # [B, T, H*D]
        order = flat.sort(dim=2, descending=True, stable=True).indices  # [B, T, H*D]
        mask.scatter_(2, order[..., :k], True)
    return mask.view(b, t, h, d).permute(0, 2, 1, 3)  # [B, H, T, D]


def _token_range(x: Tensor, outliers: Tensor) -> tuple[Tensor, Tensor]:
    """fp16-rounded (center, half_range) ``[..., 1]`` of each token's non-outlier elements."""
    inf = torch.finfo(torch.float32).max
    hi = x.masked_fill(outliers, -inf).amax(-1, keepdim=True)
    lo = x.masked_fill(outliers, inf).amin(-1, keepdim=True)
    center = ((hi + lo) / 2).to(torch.float16)
    half = ((hi - lo) / 2).to(torch.float16)
    return center, torch.where(half == 0, torch.ones_like(half), half)


#: candidate clip quantiles of the no-outlier per-channel ranges: ``[q, 1 - q]`` per channel
CLIP_QUANTILES = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.02, 0.05, 0.1)

#: candidate tail quantiles of the per-channel ranges with outliers: a channel's range runs from
#: its ``q``-quantile to its ``1 - q'``-quantile, ``q`` and ``q'`` chosen apart from these
TAIL_QUANTILES = (0.0, 2.5e-4, 5e-4, 1e-3, 2e-3, 3.5e-3, 5e-3, 7.5e-3, 0.01, 0.015, 0.02, 0.03, 0.05)  # fmt: skip
#: at most this many calibration tokens (evenly strided) estimate each candidate range's error
ERROR_TOKENS = 2048


def _midrange(low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
    """(center, half_range) of the ranges ``[low, high]``."""
    return (high + low) / 2, (high - low) / 2


def _range_error(
    x: Tensor, weights: Tensor, bits: int, low: Tensor, high: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-channel weighted squared error ``[H, D]`` of ``x`` ``[N, H, D]`` on ``2**bits``
    uniform levels over ``[low, high]`` (``[H, D]``, values outside clamp), and the mask
    ``[N, H, D]`` of the elements outside."""
    center, half = _midrange(low, high)
    half = half.clamp_min(torch.finfo(torch.float32).tiny)
    normalized = (x - center) / half  # [N, H, D]
    steps = 2**bits - 1  # the nearest of the uniform levels, by rounding (ties: to even)
    restored = ((normalized.clamp(-1.0, 1.0) + 1) * (steps / 2)).round_() * (2 / steps) - 1
    error = weights * (restored * half + center - x).square()  # [N, H, D]
    return error, normalized.abs() > 1


def _clipped_channel_range(x: Tensor, fisher: Tensor | None, bits: int) -> tuple[Tensor, Tensor]:
    """Per-channel (center, half_range) ``[H, D]`` of calibration samples ``x`` ``[N, H, D]``
    with no outliers: the ``[q, 1 - q]`` quantile range, ``q`` from :data:`CLIP_QUANTILES`
    with the least (Fisher-weighted) squared error of ``2**bits`` uniform levels, clamping
    included.

    Offline ranges cover every calibration token, so the min-max range of thousands of tokens
    is set by a few extremes; clamping those costs less than coarser steps for all the others.
    """
    q = torch.tensor(CLIP_QUANTILES, dtype=x.dtype, device=x.device)  # [Q]
    lows, highs = torch.quantile(x, q, dim=0), torch.quantile(x, 1 - q, dim=0)  # [Q, H, D]
    weights = torch.ones_like(x) if fisher is None else fisher.float()
    errors = [
        _range_error(x, weights, bits, low, high)[0].sum(0)  # [H, D]
        for low, high in zip(lows, highs, strict=True)
    ]
    best = torch.stack(errors).argmin(0, keepdim=True)  # [1, H, D], first of equals
    low, high = lows.gather(0, best)[0], highs.gather(0, best)[0]
    return _midrange(low, high)


def _even_channel_range(x: Tensor, fraction: float) -> tuple[Tensor, Tensor]:
    """KVQuant's per-channel (center, half_range) ``[H, D]`` of calibration samples ``x``
    ``[N, H, D]``: ``fraction / 2`` of every channel's elements outside at each end."""
    low = torch.quantile(x, fraction / 2, dim=0)  # [H, D]
    high = torch.quantile(x, 1 - fraction / 2, dim=0)
    return _midrange(low, high)


def _allocated_channel_range(
    x: Tensor, fisher: Tensor | None, bits: int, fraction: float
) -> tuple[Tensor, Tensor]:
    """Per-channel (center, half_range) ``[H, D]`` of calibration samples ``x`` ``[N, H, D]``
    whose outsides, the outliers, hold at most ``fraction`` of all the elements, given to the
    channels where they cut the most error.

    Each channel's range runs between two of its quantiles from :data:`TAIL_QUANTILES` (and
    ``fraction / 2``, KVQuant's even split), low and high end chosen apart. The
    choice minimizes ``sum_c error_c + lambda * outliers_c`` over the layer's channels,
    ``error_c`` the squared error of the channel's in-range elements on ``2**bits`` uniform
    levels weighted by its mean Fisher information (the outliers are stored exactly; weighting
    each element by its own was no better, docs/results/kv-cache.md), with
    ``lambda`` found by bisection as the smallest whose outliers fit the budget. A heavy-tailed
    channel gets several percent, a flat one none.
    """
    n, h, d = x.shape
    q = torch.tensor(sorted({*TAIL_QUANTILES, fraction / 2}), dtype=x.dtype, device=x.device)
    lows, highs = torch.quantile(x, q, dim=0), torch.quantile(x, 1 - q, dim=0)  # [Q, H, D]
    # outliers counted on every sample; in-range error estimated on at most ERROR_TOKENS
    below = torch.stack([(x < low).sum(0) for low in lows]).double()  # [Q, H, D]
    above = torch.stack([(x > high).sum(0) for high in highs]).double()
    count = (below[:, None] + above[None, :]).flatten(0, 1)  # [Q * Q, H, D], low-major
    sub = x[:: -(-n // ERROR_TOKENS)]  # [<= ERROR_TOKENS, H, D]
    # each channel's mean Fisher information (see above)
    weights = torch.ones_like(x[:1]) if fisher is None else fisher.float().mean(0, keepdim=True)
    errors = []
    for low, high in itertools.product(lows, highs):  # Q * Q candidate ranges
        error, outside = _range_error(sub, weights, bits, low, high)
        errors.append(error.masked_fill(outside, 0).sum(0, dtype=torch.float64))  # [H, D]
    error = torch.stack(errors) * (n / len(sub))  # [Q * Q, H, D]
    budget = fraction * n * h * d

    def choose(lam: float) -> Tensor:
        return (error + lam * count).argmin(0, keepdim=True)  # [1, H, D]

    # lambda = max error: no outlier pays off; search its exponent below that
    top = float(error.max()) or 1.0
    over, within = -16.0, 0.0  # exponents whose outliers exceed / fit the budget
    for _ in range(48):
        mid = (over + within) / 2
        if float(count.gather(0, choose(top * 10**mid)).sum()) > budget:
            over = mid
        else:
            within = mid
    best = choose(top * 10**within)
    qn = len(q)
    low, high = lows.gather(0, best // qn)[0], highs.gather(0, best % qn)[0]
    return _midrange(low, high)


def _fit(
    normalized: Tensor, weights: Tensor, bits: int, outlier_fraction: float, seed: int
) -> Tensor:
    """The nuqX codebook ``[2**bits]`` of normalized calibration values ``[M]`` weighted by
    ``weights`` ``[M]`` (all zero = unweighted), Lloyd started from the uniform grid."""
    if normalized.numel() > MAX_CODEBOOK_SAMPLES:
        generator = torch.Generator(device="cpu").manual_seed(seed)  # same subset everywhere
        keep = torch.randperm(normalized.numel(), generator=generator, device="cpu")
        keep = keep[:MAX_CODEBOOK_SAMPLES].to(normalized.device)  # [MAX_CODEBOOK_SAMPLES]
        normalized, weights = normalized[keep], weights[keep]
    if float(weights.sum()) <= 0:
        weights = None  # no gradient reached these values: fall back to plain k-means
    # without outliers the ends of each range hold the largest-magnitude elements (each
    # token's min and max; each channel's clamped extremes): keep levels there, as the
    # uniform grid does. With outliers those are stored exactly and the ends move freely.
    pin_ends = outlier_fraction == 0
    grid = uniform_codebook(bits, normalized.device)
    return fit_codebook(normalized, 2**bits, weights, pin_ends=pin_ends, init=grid)


@register_kv_quantizer
class KVQuantQuantizer(KVQuantizer):
    """KVQuant nuqX quantizer of one layer's keys or values (see module doc).

    Args:
        bits: index bits, 2-8 (``2**bits`` codebook levels).
        num_heads, head_dim: the layer's KV heads and channels per head.
        per_channel: calibrated per-channel ranges (keys) instead of online per-token ones.
        outlier_fraction: share of elements kept as fp16 outliers (0 = none).
        channel_codebooks: one codebook per channel (``[H_kv * D, 2**bits]``, as in Algorithm 1 of
            Zhou's KVQuant review) instead of one per layer; needs ``per_channel``.
        rotate: code each token's head vector in the basis of :func:`token_rotation` (``x @ R``,
            dequantized ``x̂ Rᵀ``); needs per-token ranges (``per_channel=False``).

    Build calibrated quantizers with :meth:`calibrate`; the constructor gives the uniform
    codebook and unit channel ranges (state then comes from ``load_state_dict``).
    """

    kind = "kvquant"
    token_group = 1

    def __init__(
        self,
        bits: int = 3,
        num_heads: int = 1,
        head_dim: int = 64,
        per_channel: bool = False,
        outlier_fraction: float = 0.01,
        channel_codebooks: bool = False,
        rotate: bool = False,
    ) -> None:
        super().__init__()
        _check_settings(bits, num_heads, head_dim, outlier_fraction)
        if channel_codebooks and not per_channel:
            raise LowbitError("per-channel codebooks need per-channel ranges (per_channel=True)")
        if rotate and per_channel:
            raise LowbitError("rotated tokens need per-token ranges (per_channel=False)")
        self.bits, self.num_heads, self.head_dim = bits, num_heads, head_dim
        self.per_channel = bool(per_channel)
        self.outlier_fraction = float(outlier_fraction)
        self.channel_codebooks = bool(channel_codebooks)
        self.rotate = bool(rotate)
        rotation = token_rotation(head_dim) if rotate else torch.empty(0, 0)
        self.register_buffer("rotation", rotation, persistent=False)  # derived from head_dim
        grid = uniform_codebook(bits)
        if channel_codebooks:
            grid = grid.repeat(num_heads * head_dim, 1)  # [H*D, K]
        self.register_buffer("codebook", grid)
        shape = (num_heads, head_dim) if per_channel else (0, 0)
        self.register_buffer("center", torch.zeros(shape, dtype=torch.float16))
        self.register_buffer("half_range", torch.ones(shape, dtype=torch.float16))

    @property
    def outliers_per_token(self) -> int:
        """Outliers per token of the online (per-token) selection."""
        return round(self.outlier_fraction * self.num_heads * self.head_dim)

    def settings(self) -> dict[str, Any]:
        return dict(
            bits=self.bits,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            per_channel=self.per_channel,
            outlier_fraction=self.outlier_fraction,
            channel_codebooks=self.channel_codebooks,
            rotate=self.rotate,
        )

    def check(self, head_dim: int) -> None:
        if head_dim != self.head_dim:
            raise LowbitError(
                f"this KVQuant quantizer was built for head_dim {self.head_dim}, not {head_dim}"
            )

    def bits_per_element(self, head_dim: int) -> float:
        """Index bits + 32 bits per outlier + a 32-bit CSR row pointer per token (over the
        token's ``H_kv * D`` elements) + per-token fp16 center and half range (online only);
        the codebook and per-channel ranges are per layer, not per token.

        Per-channel: exactly :func:`~lowbit.formats.accounting.kvquant_bits` with
        ``hidden = H_kv * D`` (the calibrated outlier fraction is nominal).
        """
        self.check(head_dim)
        hidden = self.num_heads * head_dim
        index_bits = 8 * packed_words_per_row(head_dim, self.bits) / head_dim
        if self.per_channel:
            fraction = self.outlier_fraction
            return index_bits + kvquant_bits(0, fraction, hidden)
        fraction = self.outliers_per_token / hidden
        return index_bits + kvquant_bits(0, fraction, hidden) + 32 / head_dim

    # -- quantization ------------------------------------------------------------------------
    def encode(self, normalized: Tensor) -> Tensor:
        """uint8 index of the nearest codebook level of each normalized ``[B, H, T, D]``."""
        if not self.channel_codebooks:
            return nuq_quantize(normalized, self.codebook, axis=-1, normalize=None)[0]
        b, h, t, d = normalized.shape
        rows = normalized.permute(0, 2, 1, 3).reshape(b, t, h * d)  # [B, T, H*D]
        idx, _, _ = nuq_quantize(rows, self.codebook, axis=-1, normalize=None, codebook_axis=-1)
        return idx.view(b, t, h, d).permute(0, 2, 1, 3)

    def decode(self, idx: Tensor) -> Tensor:
        """fp32 normalized levels ``[B, H, T, D]`` of indices ``idx`` (inverse of encode)."""
        if not self.channel_codebooks:  # nuq_dequantize(idx, codebook, 0, 1), one gather
            flat = torch.index_select(self.codebook.float(), 0, idx.reshape(-1).long())
            return flat.view(idx.shape)
        b, h, t, d = idx.shape
        rows = idx.permute(0, 2, 1, 3).reshape(b, t, h * d)  # [B, T, H*D]
        levels = nuq_dequantize(rows, self.codebook, 0.0, 1.0, codebook_axis=-1)
        return levels.view(b, t, h, d).permute(0, 2, 1, 3)

    def _outlier_mask(self, xf: Tensor) -> Tensor:
        if self.per_channel:
            if self.outlier_fraction == 0:
                return torch.zeros_like(xf, dtype=torch.bool)
            center = self.center.float()[None, :, None, :]
            half = self.half_range.float()[None, :, None, :]
            return (xf - center).abs() > half
        return _top_magnitudes(xf, self.outliers_per_token)

    def _coded_input(self, x: Tensor) -> Tensor:
        """``x`` ``[B, H, T, D]`` checked, as the float32 the codes are taken of (rotated where
        this quantizer rotates)."""
        check_kv(x, self.token_group)
        self.check(x.shape[3])
        if x.shape[1] != self.num_heads:
            raise LowbitError(f"expected {self.num_heads} KV heads, got {x.shape[1]}")
        xf = x.float().contiguous()
        if self.rotate:
            xf = xf @ self.rotation.float()  # [B, H, T, D], each token's head vector rotated
        return xf

    def extend(self, page: PackedKV, x: Tensor, capacity: int) -> PackedKV:
        """``page`` followed by ``x``, written in place into the page's room for ``capacity``
        tokens (made on the first extension: one copy of the page) by the compiled store; the
        joined page (:meth:`KVQuantizer.extend`) where the library cannot."""
        t = x.shape[2]
        room = page.room if isinstance(page, KVQuantPackedKV) else None
        if room is None or not room.holds(page):
            if not isinstance(page, KVQuantPackedKV) or page.num_tokens + t > capacity:
                return super().extend(page, x, capacity)
            room = _PageRoom.holding(page, capacity)
        if room.tokens + t > room.codes.shape[2]:
            return super().extend(page, x, capacity)
        xf = self._coded_input(x)
        need = room.words + kvquant_words(x.shape, self)
        if need > room.col_val.numel():  # double the outliers' room
            grown = room.col_val.new_empty(max(need, 2 * room.col_val.numel()))
            grown[: room.words] = room.col_val[: room.words]
            room.col_val = grown
        n = room.tokens
        words = store_kvquant_tokens(
            xf, self, room.codes, room.center, room.half_range, room.row_ptr, room.col_val, n
        )
        if words is None:  # nothing of it kept: the torch quantizer says what was wrong
            return super().extend(page, x, capacity)
        room.tokens, room.words = n + t, words
        return room.page(page)

    def quantize(self, x: Tensor) -> KVQuantPackedKV:
        xf = self._coded_input(x)
        b, h, t, d = x.shape
        compiled = quantize_kvquant_tokens(xf, self)  # the compiled store where it is built
        if compiled is not None:
            codes, center16, half16, row_ptr, col_val = compiled
            return KVQuantPackedKV(
                shape=x.shape, dtype=x.dtype, codes=codes, center=center16, half_range=half16,
                row_ptr=row_ptr, col_val=col_val, quantizer=self,
            )  # fmt: skip
        outliers = self._outlier_mask(xf)  # [B, H, T, D] bool
        if self.per_channel:
            center16 = half16 = None
            center = self.center.float()[None, :, None, :]
            half = self.half_range.float()[None, :, None, :]
        else:
            center16, half16 = _token_range(xf, outliers)  # [B, H, T, 1]
            center, half = center16.float(), half16.float()
        idx = self.encode(((xf - center) / half).clamp_(-1.0, 1.0))  # [B, H, T, D] uint8
        values = xf.permute(2, 0, 1, 3).reshape(t, b, h * d)  # [T, B, H*D]
        mask = outliers.permute(2, 0, 1, 3).reshape(t, b, h * d)
        row_ptr, col_val = _csr(values, mask)
        return KVQuantPackedKV(
            shape=x.shape,
            dtype=x.dtype,
            codes=pack_bits(idx, self.bits),
            center=center16,
            half_range=half16,
            row_ptr=row_ptr,
            col_val=col_val,
            quantizer=self,
        )

    # -- calibration -------------------------------------------------------------------------
    @classmethod
    def calibrate(
        cls,
        samples: Tensor,
        fisher: Tensor | None,
        *,
        bits: int,
        per_channel: bool,
        outlier_fraction: float = 0.01,
        channel_codebooks: bool = False,
        rotate: bool = False,
        nuq: bool = True,
        outlier_allocation: str = "least-error",
        codebook_tokens: Tensor | None = None,
        seed: int = 0,
    ) -> KVQuantQuantizer:
        """A quantizer fitted to calibration activations.

        Args:
            samples: ``[N, H_kv, D]`` keys or values (sink tokens already masked out).
            fisher: ``[N, H_kv, D]`` Fisher information of ``samples`` as they are coded (with
                ``rotate``, of ``samples @ R``: ``(gradients @ R) ** 2``); None = unweighted.
            bits, per_channel, outlier_fraction, channel_codebooks, rotate: as for the
                constructor.
            nuq: fit the codebook (else the uniform grid).
            outlier_allocation: how per-channel ranges share the outliers: ``"least-error"``
                where they cut the most error (:func:`_allocated_channel_range`), ``"even"``
                the same share of every channel (KVQuant).
            codebook_tokens: ``[N]`` bool, the samples the codebook is fitted on (None: all);
                ranges and thresholds always use every sample.
            seed: seed of the subset used when there are more than
                :data:`MAX_CODEBOOK_SAMPLES` normalized elements.
        """
        if samples.dim() != 3:
            raise LowbitError("calibration samples must be [tokens, heads, head_dim]")
        check_outlier_allocation(outlier_allocation)
        n, h, d = samples.shape
        with torch.device(samples.device):  # the quantizer lives where it is calibrated
            quantizer = cls(bits, h, d, per_channel, outlier_fraction, channel_codebooks, rotate)
        x = samples.float()
        if rotate:
            x = x @ quantizer.rotation  # [N, H, D]
        if per_channel:
            if outlier_fraction > 0 and outlier_allocation == "even":
                center, half = _even_channel_range(x, outlier_fraction)
            elif outlier_fraction > 0:
                center, half = _allocated_channel_range(x, fisher, bits, outlier_fraction)
            else:
                center, half = _clipped_channel_range(x, fisher, bits)
            half = half.to(torch.float16)
            quantizer.center.copy_(center.to(torch.float16))
            quantizer.half_range.copy_(torch.where(half == 0, torch.ones_like(half), half))
        if not nuq:
            return quantizer
        batch = x.transpose(0, 1).unsqueeze(0)  # [1, H, N, D] as the cache sees it
        outliers = quantizer._outlier_mask(batch)
        if per_channel:
            center = quantizer.center.float()[None, :, None, :]
            half = quantizer.half_range.float()[None, :, None, :]
        else:
            center, half = (s.float() for s in _token_range(batch, outliers))
        fit = ~outliers
        if codebook_tokens is not None:
            fit &= codebook_tokens.to(fit.device).view(1, 1, -1, 1)
        normalized = ((batch - center) / half).clamp(-1.0, 1.0)  # [1, H, N, D]
        # Σ F (a - â)² in activation units: a normalized error counts half_range² times
        weights = half.square().expand_as(normalized)  # [1, H, N, D]
        if fisher is not None:
            weights = weights * fisher.float().transpose(0, 1).unsqueeze(0)
        if not channel_codebooks:
            codebook = _fit(normalized[fit], weights[fit], bits, outlier_fraction, seed)
            quantizer.codebook.copy_(codebook)
            return quantizer
        for channel, (head, dim) in enumerate(itertools.product(range(h), range(d))):
            keep = fit[0, head, :, dim]  # [N]
            if int(keep.sum()) < 2**bits:
                continue  # too few samples: the channel keeps the uniform grid
            w = weights[0, head, :, dim][keep]
            codebook = _fit(normalized[0, head, :, dim][keep], w, bits, outlier_fraction, seed)
            quantizer.codebook[channel].copy_(codebook)
        return quantizer

    def extra_repr(self) -> str:
        return super().extra_repr() + f", levels={math.prod(self.codebook.shape)}"
