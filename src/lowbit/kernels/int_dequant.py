"""The weight of a tiled int32 layout decoded to fp16/bf16 in one pass (Triton), for prefill.

At large M a packed product is compute-bound, and cuBLAS's tensor-core GEMM runs at more than
twice the rate of lowbit's fused prefill kernel (:mod:`lowbit.kernels.int_gemm`: 0.42x cuBLAS
fp16 at M = 2048 on an H200, docs/results/gpu.md). Decoding the weight once into the input's
dtype costs one write and one read of ``2 * N * K`` bytes, which at large M is small beside the
product: :class:`~lowbit.kernels.triton_int.TritonIntBackend` takes this path from
``DEQUANT_M`` rows up.

Each program decodes ``BLOCK_N`` rows of one K tile: it loads the tile's ``[BLOCK_N,
TILE_WORDS]`` words once and for each slot stores a contiguous run of ``TILE_WORDS`` weights
per row, ``(code - zero) * scale`` in fp32 rounded once to the output dtype: the same weight,
bit for bit, as the reference backend's ``dequantize_weight(dtype)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lowbit.kernels.int_gemm import slot_scale_offset
from lowbit.kernels.triton_support import round_bf16

__all__ = ["int_dequant"]

INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _int_dequant_kernel(
    words_ptr, scale_ptr, zero_ptr, out_ptr,
    N, K, stride_wn, stride_sg, stride_zg, stride_on,
    BITS: tl.constexpr, TILE_WORDS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    SYMMETRIC: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    PPW: tl.constexpr = 32 // BITS  # codes per word
    TILE_K: tl.constexpr = PPW * TILE_WORDS  # codes per tile
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    MAGIC: tl.constexpr = 0x4B000000  # float bits of 2**23: (code | MAGIC) as f32 = 2**23 + code
    t = tl.program_id(1)  # the K tile
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    offs_w = tl.arange(0, TILE_WORDS)  # [TILE_WORDS]
    w_ptrs = words_ptr + offs_n[:, None] * stride_wn + (t * TILE_WORDS + offs_w)[None, :]
    words = tl.load(w_ptrs, mask=mask_n[:, None], other=0)  # [BLOCK_N, TILE_WORDS] int32
    for j in tl.static_range(PPW):
        k0 = t * TILE_K + j * TILE_WORDS  # first code of slot j's run
        offs_k = k0 + offs_w  # [TILE_WORDS]
        scale, offset = slot_scale_offset(scale_ptr, zero_ptr, offs_n, mask_n, k0, K, stride_sg,
                                          stride_zg, BITS, GROUP_SIZE, SYMMETRIC)  # fmt: skip
        codes = ((words >> (j * BITS)) & CODE_MASK) | MAGIC  # [BLOCK_N, TILE_WORDS]
        q = codes.to(tl.float32, bitcast=True) - offset[:, None]  # code - zero, exact
        w = q * scale.to(tl.float32)[:, None]  # [BLOCK_N, TILE_WORDS] fp32, the reference's
        if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
            w = round_bf16(w)  # the interpreter's casts to bf16 truncate
        out_ptrs = out_ptr + offs_n[:, None] * stride_on + offs_k[None, :]
        mask = mask_n[:, None] & (offs_k < K)[None, :]
        tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def int_dequant(
    words: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    *,
    k: int,
    dtype: torch.dtype,
    bits: int,
    group_size: int | None,
    tile: int,
    block_n: int = 64,
    probe: bool = False,
) -> Tensor:
    """The ``[N, K]`` weight in ``dtype`` from the tiled layout (``words [N, W]`` int32,
    ``scale [G, N]``, ``zero [G, N]`` uint8 or None for symmetric codes; see
    :mod:`lowbit.kernels.int_layout`); with ``probe`` the compiled kernel only."""
    n = words.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=words.device)  # [N, K]
    grid = (triton.cdiv(n, block_n), words.shape[1] // tile)
    compiled = _int_dequant_kernel.run(
        words, scale, words if zero is None else zero, out,
        n, k, words.stride(0), scale.stride(0), 0 if zero is None else zero.stride(0),
        out.stride(0),
        BITS=bits, TILE_WORDS=tile, GROUP_SIZE=group_size or k, SYMMETRIC=zero is None,
        BLOCK_N=block_n, INTERPRET=INTERPRET, num_warps=4, grid=grid, warmup=probe,
    )  # fmt: skip
    return compiled if probe else out
