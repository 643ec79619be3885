"""The output side of the split-K GEMV kernels (integer, SpQR, 2/4/16).

Each kernel runs a grid of ``cdiv(N, BLOCK_N) x SPLIT_K`` programs, each over one share of K.
With one split a program's sum is final: it adds the bias and stores the output dtype. With
more, programs store fp32 partial sums in an ``[SPLIT_K, M, N]`` buffer that torch sums in
split order (deterministic, unlike atomics) before adding the bias, so the output is rounded
once either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lowbit.kernels.triton_support import round_bf16

__all__ = ["output_buffer", "store_output", "sum_splits"]


@triton.jit
def store_output(
    out_ptrs, out, mask, bias_ptr, offs_n, mask_n,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Store one program's fp32 ``out [BLOCK_N, BLOCK_M]`` (rows ``offs_n``) at ``out_ptrs``:
    plus the bias in the output dtype when SPLIT_K is 1, else as an fp32 partial sum."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if INTERPRET and out_ptrs.dtype.element_ty == tl.bfloat16:
            out = round_bf16(out)  # then the cast below is exact
        tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, out, mask=mask)  # fp32 partial sums


def output_buffer(x: Tensor, split_k: int, n: int, final: bool = True) -> Tensor:
    """``[SPLIT_K, M, N]`` for a launch on ``x [M, K]``: in x's dtype when the kernel's single
    split is ``final`` (nothing is added after it), else fp32."""
    dtype = x.dtype if split_k == 1 and final else torch.float32
    return torch.empty(split_k, x.shape[0], n, dtype=dtype, device=x.device)


def sum_splits(out: Tensor, bias: Tensor | None) -> Tensor:
    """``[SPLIT_K, M, N]`` kernel output -> ``[M, N]`` fp32 with the bias (which the kernel
    already added when it ran one split)."""
    if out.shape[0] == 1:
        return out[0].float()
    total = out.sum(0)  # [M, N] fp32, in split order
    if bias is not None:
        total += bias.float()
    return total
