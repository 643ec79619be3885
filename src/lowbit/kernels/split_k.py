"""The output side of the split-K GEMV kernels (integer, SpQR, 2/4/16): one launch per product.

Each kernel runs a grid of ``cdiv(N, BLOCK_N) x SPLIT_K`` programs, each over one share of K.
With one split a program's sum is final: it adds the bias and stores the output dtype. With
more, every program stores its fp32 partial sums in an ``[SPLIT_K, M, N]`` workspace and counts
itself in an int32 arrival counter of its output tile (``pid_n``); the program that arrives last
sums the tile's partials in split order (deterministic whatever the arrival order, unlike
atomic adds of floats), adds the bias, rounds once to the output dtype and resets the counter
for the next launch. The reduction, the cast and the bias therefore cost no launch of their own.

Ordering on the GPU: every thread's partial stores come before a block barrier, the counter's
atomic add is acquire-release at GPU scope, and the last program reads the partials with
``.cg`` loads (L2, never a stale L1 line). The counters of a device are one zeroed buffer that
every launch leaves zeroed again (:func:`arrival_counters`); launches that use it must not run
concurrently on two streams.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.kernels.triton_support import round_bf16

__all__ = ["arrival_counters", "split_buffers", "store_output", "MAX_TILES"]

#: output tiles (programs along N) a split launch may have: the counter buffer's length
MAX_TILES = 1 << 16
#: one zeroed counter buffer per device (kernels reset what they count)
_COUNTERS: dict[torch.device, Tensor] = {}


@triton.jit
def _store_final(out_ptrs, out, mask, bias_ptr, offs_n, mask_n,
                 HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if INTERPRET and out_ptrs.dtype.element_ty == tl.bfloat16:
        out = round_bf16(out)  # then the cast below is exact
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def store_output(
    out_ptrs, part_ptrs, stride_ps, count_ptr, out, mask, bias_ptr, offs_n, mask_n,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Store one program's fp32 ``out [BLOCK_N, BLOCK_M]`` (rows ``offs_n``) at ``out_ptrs``
    plus the bias, in the output dtype: directly with one split; else through the fp32
    partials at ``part_ptrs + split * stride_ps``, summed by the tile's last program."""
    if SPLIT_K == 1:
        _store_final(out_ptrs, out, mask, bias_ptr, offs_n, mask_n, HAS_BIAS, INTERPRET)
    else:
        tile = tl.program_id(0)
        tl.store(part_ptrs + tl.program_id(1) * stride_ps, out, mask=mask)
        tl.debug_barrier()  # every thread's partials are issued before the count moves
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the tile's last program: the others' partials are visible
            total = tl.zeros_like(out)
            # split order: the same sum whoever arrives last. Unrolled, so that the loads are
            # independent instructions issued together: a loop waits for each one's round trip
            # to L2 before it issues the next (SPLIT_K of them in series)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptrs + s * stride_ps, mask=mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            _store_final(out_ptrs, total, mask, bias_ptr, offs_n, mask_n, HAS_BIAS, INTERPRET)
            tl.atomic_xchg(count_ptr + tile, 0)  # zeroed for the next launch


def arrival_counters(device: torch.device, tiles: int) -> Tensor:
    """The device's zeroed int32 counter buffer (``MAX_TILES``), allocated on its first use."""
    if tiles > MAX_TILES:
        raise LowbitError(f"a split-K launch takes at most {MAX_TILES} output tiles, not {tiles}")
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters


def split_buffers(x: Tensor, split_k: int, n: int, tiles: int, out_dtype=None):
    """``(out [M, N], partials [SPLIT_K, M, N] fp32, counters)`` for a launch on ``x [M, K]``
    with ``tiles`` programs along N; with one split the partials and counters are ``out``
    itself (never read). ``out`` is in ``out_dtype`` (x's dtype by default)."""
    m = x.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)  # [M, N]
    if split_k == 1:
        return out, out, out
    partials = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
    return out, partials, arrival_counters(x.device, tiles)
