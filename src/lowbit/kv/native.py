"""The compiled CPU kernels of a quantized KV cache's decode step (``packed_attention.c``).

:func:`library` is ``packed_attention.c`` beside this module built by
:func:`lowbit.native.compile_library`; where it cannot be built it is None and the cache stays
on its torch path (:func:`lowbit.kv.decode.chunked_attention`, the torch quantizers), which
gives the same numbers, slower.

:mod:`lowbit.kv.page_descriptors` describes packed pages to the attention kernels.
:func:`quantize_int_tokens` is the store of per-token integer caches (kv-int, QuaRot's, KIVI's values),
:func:`quantize_kvquant_tokens` KVQuant's.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from lowbit.native import compile_library

__all__ = [
    "library",
    "quantize_int_tokens",
    "quantize_kvquant_tokens",
    "store_kvquant_tokens",
    "kvquant_words",
    "Dense",
    "Page",
    "Rope",
    "Stream",
    "Stat",
    "SOURCE",
    "rope_blocks",
]


SOURCE = Path(__file__).with_name("packed_attention.c")
MAX_DIM, MAX_GROUPS = 512, 64  # LB_MAX_DIM, LB_MAX_GROUPS in the source

_F16, _F32, _U8, _BF16 = 1, 2, 3, 4
#: dtypes of page statistics the kernels read (LB_F16, LB_F32, LB_U8)
STAT_DTYPES = {torch.float16: _F16, torch.float32: _F32, torch.uint8: _U8}


class Stat(ctypes.Structure):
    """``lb_stat``: one statistic of a page (data, dtype, strides of batch, head, token group,
    channel group)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("stride", ctypes.c_int64 * 4),
    ]


class Page(ctypes.Structure):
    """``lb_page``: one packed page as the kernels read it (see packed_attention.c)."""

    _fields_ = [
        ("batch", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("codes", ctypes.c_void_p),
        ("code_stride", ctypes.c_int64 * 3),
        ("bits", ctypes.c_int32),
        ("levels_per_channel", ctypes.c_int32),
        ("levels", ctypes.c_void_p),
        ("level_bias", ctypes.c_float),
        ("token_group", ctypes.c_int32),
        ("channel_group", ctypes.c_int32),
        ("scale", Stat),
        ("zero", Stat),
        ("offset", Stat),
        ("row_ptr", ctypes.c_void_p),
        ("col_val", ctypes.c_void_p),
    ]


class Rope(ctypes.Structure):
    """``lb_rope``: cos/sin tables ``[P, D]``, the cached tokens' positions ``[B, T]``, and
    optionally the same tables in blocks of 16 positions ``[P / 16 + 1, D, 16]``
    (:func:`rope_blocks`), which 16-token tiles read."""

    _fields_ = [
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("positions_stride", ctypes.c_int64),
        ("cos_blocks", ctypes.c_void_p),
        ("sin_blocks", ctypes.c_void_p),
        ("block_channels", ctypes.c_int64),
    ]


class Dense(ctypes.Structure):
    """``lb_dense``: a run of fp tokens beside the pages (a sink, the fp residual), ``[B, H, n,
    D]`` rows with contiguous channels in float32, float16 or bfloat16, its first slot, and
    whether they are pre-RoPE keys (rotated by the library at their positions)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("rotate", ctypes.c_int32),
        ("start", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("stride", ctypes.c_int64 * 3),
    ]


class Stream(ctypes.Structure):
    """``lb_stream``: the keys or the values of a layer, as packed pages (and the slot of each
    one's first token) and fp runs."""

    _fields_ = [
        ("pages", ctypes.c_void_p),
        ("starts", ctypes.c_void_p),
        ("n_pages", ctypes.c_int64),
        ("dense", ctypes.c_void_p),
        ("n_dense", ctypes.c_int64),
    ]


#: float dtypes the library reads (tokens to store, fp runs beside the pages)
FLOAT_DTYPES = {torch.float32: _F32, torch.float16: _F16, torch.bfloat16: _BF16}


def rope_blocks(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin tables ``[P, D]`` in blocks of 16 positions, ``[ceil(P / 16) + 1, C, 16]``
    float32 (zeros past ``P``): a tile of 16 consecutive positions reads each channel's values
    from two adjacent blocks, contiguous in memory. ``C`` is ``D``, or ``D / 2`` where both
    tables' halves are equal bit for bit (rotate-half RoPE: the kernels read the first half for
    both, and the blocks are half the bytes to stream)."""
    p, d = cos.shape
    if d % 2 == 0 and all(torch.equal(t[:, : d // 2], t[:, d // 2 :]) for t in (cos, sin)):
        cos, sin, d = cos[:, : d // 2], sin[:, : d // 2], d // 2
    blocks = -(-p // 16) + 1
    out = []
    for table in (cos, sin):
        padded = torch.zeros(blocks * 16, d, dtype=torch.float32, device=table.device)
        padded[:p] = table
        out.append(padded.view(blocks, 16, d).transpose(1, 2).contiguous())  # [blocks, C, 16]
    return out[0], out[1]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be (see module doc)."""
    lib = compile_library(SOURCE)
    if lib is None:
        return None
    pointer, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.lb_scores.argtypes = [pointer, pointer, i64, pointer, pointer, i64, pointer, i64, f32, c_int]  # fmt: skip
    lib.lb_accumulate.argtypes = [pointer, pointer, i64, pointer, i64, i64, pointer, c_int]
    lib.lb_scores.restype = lib.lb_accumulate.restype = c_int
    lib.lb_tile_width.argtypes, lib.lb_tile_width.restype = [], c_int
    lib.lb_attend.argtypes = [pointer, pointer, pointer, pointer, c_int, i64, i64, i64, i64, i64, f32, pointer, i64, pointer, c_int, pointer, c_int]  # fmt: skip
    lib.lb_attend.restype = c_int
    lib.lb_quantize_int_rows.argtypes = [pointer, c_int, i64, i64, i64, c_int, f32, c_int, pointer, i64, pointer, pointer]  # fmt: skip
    lib.lb_quantize_int_rows.restype = c_int
    lib.lb_quantize_kvquant.argtypes = [pointer, i64, i64, i64, i64, c_int, pointer, c_int, pointer, pointer, c_int, i64, pointer, i64, pointer, pointer, i64, pointer, pointer, i64, pointer]  # fmt: skip
    lib.lb_quantize_kvquant.restype = c_int
    return lib


def quantize_int_tokens(
    x: Tensor, bits: int, group: int, clip: float, minimum: bool = False
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Per-token asymmetric integer codes of ``x`` ``[B, H, T, D]`` in groups of ``group``
    channels, computed by the compiled library: ``(codes uint8 [B, H, T, ceil(D * bits / 8)],
    scale fp16 [B, H, T, D / group], zero)``, ``zero`` the integer zero points (uint8, same
    shape) or with ``minimum`` the fp16 minimums of KIVI's form; equal bit for bit to
    :class:`~lowbit.kv.int_quant.IntTokenQuantizer`'s torch path. None where it cannot (no
    library, not on the CPU, another dtype, a NaN or an infinity, a statistic beyond fp16)."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype not in FLOAT_DTYPES:
        return None
    b, h, t, d = x.shape
    rows = x.contiguous()
    row_bytes = -(-d * bits // 8)
    codes = torch.empty(b, h, t, row_bytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b, h, t, d // group, dtype=torch.float16, device=x.device)
    zero_dtype = torch.float16 if minimum else torch.uint8
    zero = torch.empty(b, h, t, d // group, dtype=zero_dtype, device=x.device)
    status = lib.lb_quantize_int_rows(
        rows.data_ptr(), FLOAT_DTYPES[x.dtype], b * h * t, d, group, bits, clip, int(minimum),
        codes.data_ptr(), row_bytes, scale.data_ptr(), zero.data_ptr(),
    )  # fmt: skip
    return None if status else (codes, scale, zero)


def quantize_kvquant_tokens(
    x: Tensor, quantizer
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor] | None:
    """KVQuant codes of ``x`` ``[B, H, T, D]`` float32 (in the quantizer's rotated basis where it
    rotates) by the compiled library: ``(codes uint8 [B, H, T, row bytes], center fp16 [B, H, T,
    1] or None, half_range (same), row_ptr int32 [T * B + 1], col_val int32 [nnz])``, equal bit
    for bit to :meth:`~lowbit.kv.kvquant.KVQuantQuantizer.quantize`'s torch path. None where it
    cannot (no library, not on the CPU, a NaN or infinity, an outlier beyond fp16)."""
    q = quantizer
    b, h, t, d = x.shape
    row_bytes = -(-d * q.bits // 8)
    codes = torch.empty(b, h, t, row_bytes, dtype=torch.uint8, device=x.device)
    per_token = not q.per_channel
    center = torch.empty(b, h, t, 1, dtype=torch.float16, device=x.device) if per_token else None
    half = torch.empty(b, h, t, 1, dtype=torch.float16, device=x.device) if per_token else None
    row_ptr = torch.zeros(t * b + 1, dtype=torch.int32, device=x.device)
    col_val = torch.empty(kvquant_words(x.shape, q), dtype=torch.int32, device=x.device)
    n = store_kvquant_tokens(x, q, codes, center, half, row_ptr, col_val)
    if n is None:
        return None
    return codes, center, half, row_ptr, col_val[:n].clone() if n < col_val.numel() else col_val


def kvquant_words(shape: torch.Size, quantizer) -> int:
    """The most outlier words KVQuant's store of tokens ``shape`` ``[B, H, T, D]`` can write."""
    b, h, t, d = shape
    return b * h * t * d if quantizer.per_channel else b * t * quantizer.outliers_per_token


def store_kvquant_tokens(
    x: Tensor,
    quantizer,
    codes: Tensor,
    center: Tensor | None,
    half: Tensor | None,
    row_ptr: Tensor,
    col_val: Tensor,
    first: int = 0,
) -> int | None:
    """Write KVQuant's codes of ``x`` ``[B, H, T, D]`` (as :func:`quantize_kvquant_tokens`) into
    buffers with room for ``C >= first + T`` tokens a head, from token ``first`` on: ``codes``
    ``[B, H, C, row bytes]`` (contiguous), ``center`` and ``half`` the same of ``[B, H, C, 1]``
    fp16 (per-token ranges; else None), ``row_ptr`` ``[C * B + 1]`` the CSR rows (entry
    ``first * B`` the outliers already stored), ``col_val`` every word of the page with room
    for :func:`kvquant_words` more. Returns the outlier words stored after the call, or None
    where the library cannot (see :func:`quantize_kvquant_tokens`; then nothing written is to
    be trusted)."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    constants = _kvquant_constants(quantizer)
    if constants is None:
        return None
    b, h, t, d = x.shape
    rows = x.contiguous()
    row_bytes = codes.shape[-1]
    nnz = ctypes.c_int64(0)
    status = lib.lb_quantize_kvquant(
        rows.data_ptr(), b, h, t, d, *constants[0],
        codes.data_ptr() + first * row_bytes, row_bytes,
        None if center is None else center.data_ptr() + 2 * first,
        None if half is None else half.data_ptr() + 2 * first, codes.shape[2],
        row_ptr.data_ptr() + 4 * first * b, col_val.data_ptr(), col_val.numel(), ctypes.byref(nnz),
    )  # fmt: skip
    return None if status else nnz.value


def _kvquant_constants(quantizer) -> tuple | None:
    """``lb_quantize_kvquant``'s arguments that come from ``quantizer`` alone (bits, codebook,
    ranges, outliers), kept on it while its state is unchanged; None where the library cannot
    read it (state off the CPU, or ranges not in fp16)."""
    q = quantizer
    state = q._buffers  # codebook, center, half_range (direct: a module's getattr is slow)
    codebook, center, half = state["codebook"], state["center"], state["half_range"]
    key = (codebook.data_ptr(), codebook._version, center.data_ptr(), center._version,
           half.data_ptr(), half._version)  # fmt: skip
    kept = q.__dict__.get("_native_constants")
    if kept is not None and kept[0] == key:  # the same memory (kept alive there), unchanged
        return kept[1]
    if any(t.device.type != "cpu" for t in (codebook, center, half)):
        return None  # the quantizer's state elsewhere (meta while a model is built): torch's
    if q.per_channel and center.dtype != torch.float16:
        return None
    levels = codebook.float().contiguous()
    stats = (center.contiguous(), half.contiguous()) if q.per_channel else None
    arguments = (
        q.bits, levels.data_ptr(), int(q.channel_codebooks),
        stats[0].data_ptr() if stats else None, stats[1].data_ptr() if stats else None,
        int(q.outlier_fraction > 0), 0 if q.per_channel else q.outliers_per_token,
    )  # fmt: skip
    q.__dict__["_native_constants"] = (key, (arguments, levels, stats), (codebook, center, half))
    return arguments, levels, stats
