"""llama.cpp's byte layouts of its 256-weight super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).

:func:`pack_super_blocks` turns a super-block's parts -- one code per weight (the index of its
level: ``q`` for the affine types, ``q + 4`` for Q3_K, ``q + 32`` for Q6_K), the integer scale
(and minimum) of every sub-block, the fp16 super-scale ``d`` (and ``dmin``) -- into the bytes of
llama.cpp's ``block_q*_K`` structs (``ggml-common.h``), in the order the ``gguf`` package's
reader (``gguf.quants``) unpacks them. Pure numpy; the grid math is
:mod:`lowbit.formats.gguf_blocks`'.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SUPER_BLOCK", "pack_super_blocks"]

SUPER_BLOCK = 256


def _bits(parts: np.ndarray, width: int) -> np.ndarray:
    """[..., k, n] small integers -> [..., n] bytes, part ``j`` at bit ``j * width``."""
    out = np.zeros(parts.shape[:-2] + parts.shape[-1:], dtype=np.uint8)
    for j in range(parts.shape[-2]):
        out |= (parts[..., j, :] << (j * width)).astype(np.uint8)
    return out


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """[..., nb] fp16 -> [..., nb, 2] bytes."""
    return x.astype(np.float16).reshape(*x.shape, 1).view(np.uint8)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's twelve bytes of eight 6-bit scales and eight 6-bit minimums.

    Bytes 0-3 hold scales 0-3 in their low six bits and the top two bits of scales 4-7;
    bytes 4-7 likewise for the minimums; bytes 8-11 the low nibbles of scale and minimum 4-7.
    """
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)  # [..., 8] each, 0..63
    first = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    second = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    third = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=-1)  # [..., 12]


def _q3_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K's twelve bytes of sixteen 6-bit scales stored as ``scale + 32``: the low nibbles of
    scales i and i + 8 in byte i (i < 8), the top two bits of scale ``4 s + k`` at bit ``2 s``
    of byte 8 + k."""
    u = (sc.astype(np.int16) + 32).astype(np.uint8)  # [..., 16], 0..63
    low = (u[..., :8] & 15) | ((u[..., 8:] & 15) << 4)  # [..., 8]
    high = _bits(((u >> 4) & 3).reshape(*u.shape[:-1], 4, 4), 2)  # [..., 4]
    return np.concatenate([low, high], axis=-1)


def pack_super_blocks(
    type_name: str,
    codes: np.ndarray,
    d: np.ndarray,
    sub_scale: np.ndarray,
    dmin: np.ndarray | None = None,
    sub_min: np.ndarray | None = None,
) -> np.ndarray:
    """llama.cpp's bytes of super-blocks.

    Args:
        type_name: Q2_K, Q3_K, Q4_K, Q5_K or Q6_K.
        codes: [rows, nb, 256] level indices.
        d: [rows, nb] fp16 super-scales; ``dmin`` likewise (Q2_K, Q4_K, Q5_K).
        sub_scale: [rows, nb, sub-blocks] integer sub-block scales (signed for Q3_K, Q6_K);
            ``sub_min`` likewise (Q2_K, Q4_K, Q5_K).

    Returns:
        [rows, nb * bytes per super-block] uint8.
    """
    rows, nb, _ = codes.shape
    c = codes.astype(np.uint8)
    if type_name == "Q2_K":  # scales[16] qs[64] d dmin
        scales = (sub_scale.astype(np.uint8) & 15) | (sub_min.astype(np.uint8) << 4)
        qs = _bits(c.reshape(rows, nb, 2, 4, 32), 2).reshape(rows, nb, 64)
        parts = [scales, qs, _fp16_bytes(d), _fp16_bytes(dmin)]
    elif type_name == "Q3_K":  # hmask[32] qs[64] scales[12] d
        hmask = _bits((c >> 2).reshape(rows, nb, 8, 32), 1)
        qs = _bits((c & 3).reshape(rows, nb, 2, 4, 32), 2).reshape(rows, nb, 64)
        parts = [hmask, qs, _q3_scales(sub_scale), _fp16_bytes(d)]
    elif type_name in ("Q4_K", "Q5_K"):  # d dmin scales[12] (qh[32]) qs[128]
        qs = _bits((c & 15).reshape(rows, nb, 4, 2, 32), 4).reshape(rows, nb, 128)
        parts = [_fp16_bytes(d), _fp16_bytes(dmin), _k_scales(sub_scale, sub_min)]
        if type_name == "Q5_K":
            parts.append(_bits((c >> 4).reshape(rows, nb, 8, 32), 1))
        parts.append(qs)
    elif type_name == "Q6_K":  # ql[128] qh[64] scales[16] d
        ql = _bits((c & 15).reshape(rows, nb, 2, 2, 64), 4).reshape(rows, nb, 128)
        qh = _bits((c >> 4).reshape(rows, nb, 2, 4, 32), 2).reshape(rows, nb, 64)
        scales = sub_scale.astype(np.int8).view(np.uint8)
        parts = [ql, qh, scales, _fp16_bytes(d)]
    else:
        raise ValueError(f"{type_name} is not a super-block type")
    blocks = np.concatenate([p.reshape(rows, nb, -1) for p in parts], axis=-1)
    return blocks.reshape(rows, -1)
