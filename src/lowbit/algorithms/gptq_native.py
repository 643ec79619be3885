"""GPTQ's column loop compiled (``gptq_columns.c``, built by :func:`lowbit.native.compile_library`).

A column's rounding, error and rank-1 update are a dozen torch operations on vectors of ``out``
elements, each paying torch's dispatch; the compiled loop runs a run of columns whose grid is
fixed (a GPTQ block, or the columns up to the next dynamic group or GGUF block, whose grid
torch fits in between) in one call. The same float32 operations in the same order as the torch
loop (:func:`lowbit.algorithms.gptq._quantize_columns`, :mod:`lowbit.algorithms.gguf_spec`),
with the rank-1 update fused as torch's vectorized ``addr_`` fuses it: equal bit for bit where
torch vectorizes the whole row (``out`` a multiple of 32 on AVX2 and AVX-512 CPUs), within a
rounding step of the update on the last ``out % 16`` outputs otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from lowbit.native import compile_library

__all__ = ["library", "quantize_columns", "GRID_INT", "GRID_LEVELS"]

SOURCE = Path(__file__).with_name("gptq_columns.c")
GRID_INT, GRID_LEVELS = 0, 1  # LB_GRID_INT, LB_GRID_LEVELS in the source


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled loop, built on first use; None where it cannot be."""
    lib = compile_library(SOURCE)
    if lib is None:
        return None
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.lb_gptq_columns.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, p, p, p, ctypes.c_int, p, p, p, f32, f32]  # fmt: skip
    lib.lb_gptq_columns.restype = ctypes.c_int
    return lib


def _ready(*tensors: Tensor | None) -> bool:
    return all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
        for t in tensors
    )


def quantize_columns(
    block: Tensor,
    block_u: Tensor,
    i0: int,
    i1: int,
    errors: Tensor,
    codes: Tensor,
    values: Tensor,
    rows: Tensor,
    grid: int,
    a: Tensor | None,
    s: Tensor,
    z: Tensor | None,
    qmin: float,
    qmax: float,
) -> bool:
    """Columns ``i0..i1`` of ``block`` ``[b, out]`` (Wᵀ, updated in place) quantized onto the
    stats rows ``rows`` ``[b]`` int64 of ``a``/``s``/``z`` ``[G, out]``, with ``block_u`` ``[b,
    b]`` the block of H⁻¹'s upper Cholesky factor; ``errors``, ``codes`` and ``values``
    ``[b, out]`` filled on those rows (see the source for the grids). False, having done
    nothing, where the compiled loop cannot run (no library, not CPU float32 contiguous)."""
    lib = library()
    if lib is None or rows.dtype != torch.int64 or rows.device.type != "cpu":
        return False
    if block_u.dtype != torch.float32 or block_u.device.type != "cpu":
        return False
    if not _ready(block, errors, codes, values, a, s, z):
        return False
    b, out = block.shape
    status = lib.lb_gptq_columns(
        block.data_ptr(), out, b, block_u.data_ptr(), *block_u.stride(), i0, i1,
        errors.data_ptr(), codes.data_ptr(), values.data_ptr(), rows.contiguous().data_ptr(),
        grid, None if a is None else a.data_ptr(), s.data_ptr(),
        None if z is None else z.data_ptr(), qmin, qmax,
    )  # fmt: skip
    return status == 0
