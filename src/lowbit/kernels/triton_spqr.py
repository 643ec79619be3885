"""The ``triton`` backend for SpQR layers (:class:`~lowbit.nn.spqr_linear.SpQRLinear`).

``prepare`` keeps the words as stored (the kernels read them directly, in the layout of Crnčević's
SpQR inference kernel, master's thesis, 2025), widens the 16-bit permutation to int32 (one load per
gathered input, no sign fix-up), and picks the outlier layout the kernel multiplies with: the
layer's ``sparse_format``, or with ``"auto"`` the faster of CSR and PTCSR for this tensor, timed
once on the GPU (Crnčević's thesis, §3.4.4: the better layout depends on the tensor and the device)
and cached per (device, shape, outlier pattern) for the process; under the interpreter, whenever
timing is off (``LOWBIT_TRITON_TUNE=0``), and for a layer first prepared inside a CUDA-graph
capture, the stored layout. ``LOWBIT_SPQR_SPARSE=csr|ptcsr``
overrides every layer set to ``"auto"``.

``matmul`` runs the fused dense-and-sparse kernel for M <= 16
(:func:`~lowbit.kernels.spqr_gemv.spqr_gemv`) and, above, decodes ``D'`` in fp16 with the Triton
decode kernel, adds the outliers at their positions in fp32, rounds once to the input's dtype
(the reference's weight; no fp32 copy of the whole weight) and calls a dense GEMM on the
permuted input; so does a layer whose fused kernel the device refuses (warned once).
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from lowbit.formats.sparse import CSRMatrix, PTCSRMatrix
from lowbit.kernels.dispatch import WeightBackend, register_backend
from lowbit.kernels.spqr_gemv import sparse_operands, spqr_dequantize_dense, spqr_gemv
from lowbit.kernels.triton_support import (
    LaunchRefused,
    capturing,
    fastest_config,
    gemv_unless_refused,
    input_refusal,
    interpreting,
)

__all__ = ["TritonSpQRBackend", "SMALL_M", "choose_sparse_format"]

#: largest M that takes the fused kernel
SMALL_M = 16
#: process cache of profiled outlier layouts: (device, N, K, pattern digest) -> "csr" | "ptcsr"
_SPARSE_CHOICE: dict[tuple, str] = {}


def _convert(sparse, kind: str):
    """``sparse`` as a ``"csr"`` or ``"ptcsr"`` container (itself when already so)."""
    if (kind == "csr") == isinstance(sparse, CSRMatrix):
        return sparse
    dense = sparse.to_dense(torch.float32)
    cls = CSRMatrix if kind == "csr" else PTCSRMatrix
    return cls.from_dense(dense, dense != 0, value_high=True)


def _pattern_key(layer, device) -> tuple:
    digest = hashlib.sha256(layer.sparse_ptr.cpu().numpy().tobytes()).hexdigest()[:16]
    return (str(device), layer.out_features, layer.in_features, layer.stored_sparse, digest)


def choose_sparse_format(layer, words, perm, device) -> str:
    """The outlier layout the kernel uses for ``layer`` (see the module docstring)."""
    choice = os.environ.get("LOWBIT_SPQR_SPARSE") if layer.sparse_format == "auto" else None
    choice = choice or layer.sparse_format
    if choice in ("csr", "ptcsr"):
        return choice
    stored = layer.stored_sparse
    if (
        device.type != "cuda"
        or interpreting()
        or os.environ.get("LOWBIT_TRITON_TUNE") == "0"
        or capturing()  # profiling would launch into the graph being captured
    ):
        return stored
    key = _pattern_key(layer, device)
    if key not in _SPARSE_CHOICE:
        _SPARSE_CHOICE[key] = _profile(layer, words, perm, device)
    return _SPARSE_CHOICE[key]


def _profile(layer, words, perm, device) -> str:
    """The faster layout for a one-row product (timed like a launch configuration); the stored
    one when the kernel cannot launch for this layer at all (its calls then decode the weight)."""
    x = torch.randn(1, layer.in_features, device=device, dtype=torch.float16)
    sparse = {kind: _convert(layer.outliers(), kind) for kind in ("csr", "ptcsr")}
    try:
        return fastest_config(
            lambda kind: spqr_gemv(x, words, perm, sparse[kind], None,
                                   out_features=layer.out_features),
            list(sparse),
        )  # fmt: skip
    except LaunchRefused:
        return layer.stored_sparse


class TritonSpQRBackend(WeightBackend):
    """Fused dense-and-sparse kernels on the packed words of Crnčević's SpQR kernel."""

    name = "triton"
    format_kind = "spqr"

    def unsupported(self, layer, x: Tensor) -> str | None:
        return input_refusal(x, layer.words)

    def prepare(self, layer) -> dict:
        words = layer.words
        perm = None if layer.perm is None else (layer.perm.to(torch.int32) & 0xFFFF)
        kind = choose_sparse_format(layer, words, perm, words.device)
        sparse = _convert(layer.outliers(), kind)
        return {
            "words": words,
            "perm": perm,
            "perm_long": None if perm is None else perm.long(),  # the prefill's gather index
            "sparse": sparse,
            "sparse_ops": sparse_operands(sparse),  # nnz read here, never per call
            "sparse_format": kind,
        }

    def matmul(self, layer, x: Tensor, prepared: dict, bias: Tensor | None) -> Tensor:
        return spqr_product(x, prepared, bias, layer.out_features)


def spqr_product(x: Tensor, prepared: dict, bias, n: int) -> Tensor:
    """``x [M, K] @ W'ᵀ + bias``: the fused kernel for M <= 16, decode + GEMM above."""
    words, perm = prepared["words"], prepared["perm"]
    if x.shape[0] <= SMALL_M:  # operands built by prepare: no checks per call
        out = gemv_unless_refused(
            prepared, x, lambda: spqr_gemv(x, words, perm, prepared["sparse_ops"], bias,
                                           out_features=n, check=False),
        )  # fmt: skip
        if out is not None:
            return out  # [M, N]
    weight = spqr_dequantize_dense(words, n, x.shape[1])  # [N, K] fp16 D', stored order
    rows, cols, values = prepared["sparse"]._coo()  # [nnz] each, unique positions, fp32 values
    # D' + S' rounded once to x's dtype (the reference's weight): only the outliers' positions
    # go through fp32; the rest is D' itself (fp16 x) or D' rounded once (bf16 x)
    outliers = (weight[rows, cols].float() + values).to(x.dtype)
    weight = weight.to(x.dtype)
    weight[rows, cols] = outliers
    xp = x if perm is None else x[:, prepared["perm_long"]]  # [M, K] stored order
    return F.linear(xp, weight, bias)  # [M, N]


register_backend(TritonSpQRBackend())
