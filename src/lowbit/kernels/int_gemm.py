"""Prefill product with packed integer weights: ``x [M, K] @ Wᵀ`` for large M (Triton).

The torch reference is :func:`lowbit.kernels.int_layout.tiled_reference`. At large M the
product is compute-bound (``2 * M * N * K`` flops against ``N * K * b / 8`` weight bytes), so
the kernel is a tiled GEMM whose weight operand is decoded in registers on its way to the
tensor cores: per ``[BLOCK_M, BLOCK_N]`` output tile and per K tile of the layout
(:mod:`lowbit.kernels.int_layout`), it loads the ``[TILE_WORDS, BLOCK_N]`` words once and for
each slot decodes a ``[TILE_WORDS, BLOCK_N]`` weight block, ``(code - zero) * scale`` in fp32
cast to x's dtype (the same arithmetic and rounding as the reference backend's weight; with
fp16 inputs and fp16 scales it is computed in fp16, two weights per instruction, which rounds
the exact product once, to the same value), and accumulates ``tl.dot(x [BLOCK_M, TILE_WORDS],
w)`` in fp32. Decoding costs a few ops per
weight per ``BLOCK_M`` rows, so it is amortised over the M tile; the scale goes on the weight
(``TILE_WORDS * BLOCK_N`` multiplies per slot) rather than on the accumulator
(``BLOCK_M * BLOCK_N``) because BLOCK_M >= 64 > TILE_WORDS here.

A K tile's scales (and zeros) are loaded before its first dot, once a group, so that a warp
waits for them once a tile rather than once a slot behind each dot.

Programs are ordered in groups of ``GROUP_M`` row tiles so neighbouring programs share weight
tiles in L2. Tile sizes, warps and pipeline stages are measured per shape on the GPU by
:func:`int_gemm` (the wrapper times candidates once with
:func:`~lowbit.kernels.triton_support.time_call` and caches the fastest); under
``TRITON_INTERPRET=1`` (no driver) it uses fixed sizes and fp32 dot operands (the interpreter's
bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from lowbit.kernels.int_layout import check_operands, tiled_reference
from lowbit.kernels.triton_support import (
    cached_config,
    capturing,
    compile_ahead,
    fastest_config,
    round_bf16,
)

__all__ = ["int_gemm"]

INTERPRET = bool(triton.knobs.runtime.interpret)
#: measure launch configurations on a GPU's first call per shape (LOWBIT_TRITON_TUNE=0: no)
TUNE = os.environ.get("LOWBIT_TRITON_TUNE", "1") != "0"


@triton.jit
def slot_scale_offset(
    scale_ptr, zero_ptr, offs_n, mask_n, k0, K, stride_sg, stride_zg,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, SYMMETRIC: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_N]`` scales of the group that holds a slot's run from column ``k0``, and the
    offset ``2**23 + zero`` (``2**23 + 2**(BITS - 1)`` symmetric) that turns the float bits
    ``code | 0x4B000000`` into ``code - zero``."""
    group = tl.minimum(k0, K - 1) // GROUP_SIZE  # the run lies in one group
    scale = tl.load(scale_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0)
    if SYMMETRIC:
        offset = tl.zeros_like(offs_n).to(tl.float32) + (8388608.0 + (1 << (BITS - 1)))
    else:
        zero = tl.load(zero_ptr + group * stride_zg + offs_n, mask=mask_n, other=0)
        offset = zero.to(tl.float32) + 8388608.0  # [BLOCK_N]
    return scale, offset


@triton.jit
def _int_gemm_kernel(
    x_ptr, words_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sg, stride_zg, stride_om,
    BITS: tl.constexpr, TILE_WORDS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    SYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr, K_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    PPW: tl.constexpr = 32 // BITS  # codes per word
    TILE_K: tl.constexpr = PPW * TILE_WORDS  # codes per tile
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    MAGIC: tl.constexpr = 0x4B000000  # float bits of 2**23: (code | MAGIC) as f32 = 2**23 + code
    # groups start at the same slots of every tile (whole groups a tile, or whole tiles a group)
    SAME_GROUP: tl.constexpr = TILE_K % GROUP_SIZE == 0 or GROUP_SIZE % TILE_K == 0
    # grouped ordering: GROUP_M row tiles sweep the same column tiles together (L2 reuse)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_w = tl.arange(0, TILE_WORDS)  # [TILE_WORDS]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # constexpr trip count: the interpreter (numpy >= 2.4) cannot take a runtime range bound
    for t in range(K_TILES):
        w_ptrs = words_ptr + offs_n[None, :] * stride_wn + (t * TILE_WORDS + offs_w)[:, None]
        words = tl.load(w_ptrs, mask=mask_n[None, :], other=0)  # [TILE_WORDS, BLOCK_N] int32
        # every slot's scales (and zeros) loaded before the tile's first dot, once a group
        # where groups start at the same slots in every tile: loaded slot by slot, each waited
        # a round trip of its own behind the dot before (tools/kernel_sass.py, its round trips)
        slot_scales = ()
        for j in tl.static_range(PPW):
            if j == 0 or not SAME_GROUP or (j * TILE_WORDS) % GROUP_SIZE == 0:
                group_scales = slot_scale_offset(scale_ptr, zero_ptr, offs_n, mask_n,
                                                 t * TILE_K + j * TILE_WORDS, K, stride_sg,
                                                 stride_zg, BITS, GROUP_SIZE, SYMMETRIC)  # fmt: skip
            slot_scales = slot_scales + (group_scales,)
        for j in tl.static_range(PPW):
            k0 = t * TILE_K + j * TILE_WORDS  # first code of slot j's run
            offs_k = k0 + offs_w  # [TILE_WORDS]
            scale, offset = slot_scales[j]
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
            if x.dtype == tl.float16 and scale.dtype == tl.float16:
                # fp16 all the way, two weights per instruction: bits (code | 0x6400) are
                # 1024 + code, code - zero is exact, and the fp16 product of it with an fp16
                # scale is the reference's fp32 product rounded once to fp16: the same weight
                codes16 = (((words >> (j * BITS)) & CODE_MASK) | 0x6400).to(tl.uint16)
                offset16 = (offset - (8388608.0 - 1024.0)).to(tl.float16)  # [BLOCK_N]
                q = codes16.to(tl.float16, bitcast=True) - offset16[None, :]
                w = q * scale[None, :]  # [TILE_WORDS, BLOCK_N] fp16
            else:
                codes = ((words >> (j * BITS)) & CODE_MASK) | MAGIC  # [TILE_WORDS, BLOCK_N]
                q = codes.to(tl.float32, bitcast=True) - offset[None, :]  # code - zero, exact
                w = q * scale.to(tl.float32)[None, :]  # [TILE_WORDS, BLOCK_N] fp32
            if INTERPRET:  # its bf16 dot is wrong and its bf16 casts truncate: fp32 operands
                if x.dtype == tl.bfloat16:
                    w = round_bf16(w)  # the weight the GPU path (and the reference) uses
                else:
                    w = w.to(x.dtype).to(tl.float32)
                acc = tl.dot(x.to(tl.float32), w, acc)
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_bf16(acc)  # then the cast below is exact
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _launch(x, words, scale, zero, bias, bits, group_size, tile, config, probe=False):
    """One launch (the product ``[M, N]``), or with ``probe`` the compiled kernel only."""
    m, n, k = x.shape[0], words.shape[0], x.shape[1]
    block_m, block_n, num_warps, num_stages = config
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    compiled = _int_gemm_kernel.run(
        x, words, scale, words if zero is None else zero, x if bias is None else bias, out,
        m, n, k,
        x.stride(0), words.stride(0), scale.stride(0), 0 if zero is None else zero.stride(0),
        out.stride(0),
        BITS=bits, TILE_WORDS=tile, GROUP_SIZE=group_size or k, SYMMETRIC=zero is None,
        HAS_BIAS=bias is not None, K_TILES=words.shape[1] // tile, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8,
        INTERPRET=INTERPRET, num_warps=num_warps, num_stages=num_stages, grid=grid,
        warmup=probe,
    )  # fmt: skip
    return compiled if probe else out


def _candidates():
    """Tile shapes ``(BLOCK_M, BLOCK_N, warps, stages)``, the default first; every one compiles
    for sm_90 within its limits (tests/kernels/test_kernel_resources.py: the 128 x 128 tile
    fits at 2 stages, not 3)."""
    yield from ((64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3))


#: |kernel - reference| <= TOL * max|reference| for a tuning candidate (the tests' bounds)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_TUNED: dict[tuple, tuple[int, int, int, int]] = {}


def int_gemm(
    x: Tensor,
    words: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    bias: Tensor | None,
    *,
    bits: int,
    group_size: int | None,
    tile: int,
    config: tuple[int, int, int, int] | None = None,
    tune: bool = True,
) -> Tensor:
    """``x @ Wᵀ + bias`` for any M (meant for M > 16) with ``W`` in the tiled int32 layout.

    Args:
        x: ``[M, K]`` fp16/bf16.
        words, scale, zero, bias, bits, group_size, tile: see
            :func:`lowbit.kernels.int_layout.check_operands`.
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` to force one configuration.
        tune: on a GPU, time the candidates once per shape (M rounded up to a power of two)
            and keep the fastest that computes the reference's product.

    Returns:
        ``[M, N]`` in ``x``'s dtype (fp32 accumulation).
    """
    m, n, k = check_operands(x, words, scale, zero, bias, bits, group_size, tile)
    x = x.contiguous()
    args = (x, words, scale, zero, bias, bits, group_size, tile)
    if config is None:
        key = (triton.next_power_of_2(m), n, k, bits, group_size, tile, zero is None, x.dtype,
               x.device)  # fmt: skip
        config = cached_config(_TUNED, key, lambda: _choose(args, tune))
    return _launch(*args, config)


def _choose(args, tune: bool) -> tuple[int, int, int, int]:
    """The launch configuration: the fastest candidate that computes the reference's product
    on a GPU (tuning on, outside a graph capture), else the default."""
    configs = list(_candidates())
    if INTERPRET:
        return 16, 32, 4, 1  # small tiles: the interpreter runs them one by one
    if not (tune and TUNE) or capturing():  # (a capture may take nothing but the product)
        return configs[0]
    expected = tiled_reference(*args)
    compile_ahead(lambda c: _launch(*args, c, probe=True), configs)
    return fastest_config(lambda c: _launch(*args, c), configs, expected, TOL[args[0].dtype])
