"""The ``triton`` backend: Triton kernels for packed 2, 3, 4 and 8-bit integer weights.

``prepare`` converts a layer's canonical bit stream to the tiled int32 layout
(:mod:`lowbit.kernels.int_layout`: whole words per thread, ten codes per word at 3 bits) and its
``[N, G]`` scales and zeros to ``[G, N]`` (one contiguous row of N per group, the kernels load a
slot's scales as one coalesced vector). ``matmul`` runs :func:`~lowbit.kernels.int_gemv.int_gemv`
for M <= 16 (decode), :func:`~lowbit.kernels.int_gemm.int_gemm` up to ``DEQUANT_M`` rows, and
from there the weight decoded by :func:`~lowbit.kernels.int_dequant.int_dequant` times cuBLAS,
which also serves a layer whose GEMV kernel the device refuses (warned once).

Runs on CUDA tensors, or on any tensors under ``TRITON_INTERPRET=1`` (set before Triton is
imported; how the tests run the kernels on CPU). Takes fp16 and bf16 inputs, symmetric or
asymmetric codes, per channel or groups that are a multiple of 16. Triton is imported here
only: without it the backend stays registered and says why it cannot run. On a GPU the first
product of each shape times a few launch configurations (compiles of a few seconds each);
``LOWBIT_TRITON_TUNE=0`` takes the default configuration instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lowbit.formats.packing import unpack_bits
from lowbit.kernels.dispatch import WeightBackend, register_backend
from lowbit.kernels.int_layout import KERNEL_BITS, pack_tiles, tile_words
from lowbit.kernels.triton_support import gemv_unless_refused, input_refusal

try:  # without Triton the backend stays registered and says why it cannot run (unsupported)
    from lowbit.kernels.int_dequant import int_dequant
    from lowbit.kernels.int_gemm import int_gemm
    from lowbit.kernels.int_gemv import int_gemv
except ImportError:
    int_dequant = int_gemm = int_gemv = None

__all__ = ["TritonIntBackend", "SMALL_M", "DEQUANT_M"]

#: largest M that takes the decode kernel
SMALL_M = 16
#: smallest M that decodes the weight and calls cuBLAS instead of the fused prefill kernel:
#: decoding costs one write and one read of the fp16 weight, which the fused kernel's slower
#: MMA loses more than from about 200 rows (docs/results/gpu.md measures both on an H200 with
#: bench_gemv: at M = 256 0.82x against 0.39x cuBLAS fp16, at 2048 0.96x against 0.42x).
DEQUANT_M = 256


def _group(layer) -> int | None:
    """The layer's group size, None for one group per row (a group of K included)."""
    return None if layer.group_size in (None, layer.in_features) else layer.group_size


class TritonIntBackend(WeightBackend):
    """Triton GEMV/small-batch (M <= 16) and prefill kernels on the tiled int32 layout."""

    name = "triton"

    def unsupported(self, layer, x: Tensor) -> str | None:
        if layer.bits not in KERNEL_BITS:
            return f"its kernels take 2, 3, 4 or 8-bit codes, not {layer.bits}"
        if tile_words(layer.in_features, layer.bits, _group(layer)) is None:
            return f"its kernels take groups that are a multiple of 16, not {layer.group_size}"
        return input_refusal(x, layer.qdata)

    def prepare(self, layer) -> dict[str, Tensor]:
        n, k = layer.out_features, layer.in_features
        tile = tile_words(k, layer.bits, _group(layer))
        codes = unpack_bits(layer.qdata, layer.bits, n * k).view(n, k)  # [N, K] uint8
        return {
            "words": pack_tiles(codes, layer.bits, tile),  # [N, W] int32
            "scale": layer.scale.t().contiguous(),  # [G, N]
            "zero": None if layer.zero is None else layer.zero.t().contiguous(),  # [G, N] u8
            "static": dict(bits=layer.bits, group_size=_group(layer), tile=tile),
        }

    def prepare_group(self, layers: list) -> dict[str, Any] | None:
        """Layers with one input width, code width, group size and zero-point kind: their words
        and statistics stacked along ``N`` (``[ΣN, W]`` words, ``[G, ΣN]`` scales and zeros).
        Each kernel computes a row from that row's operands alone, so every output is the
        layer's own product; the fp32 partial sums may be split differently along K for the
        stacked ``N`` (its own tuned launch), bit for bit where the launch is the same (the
        interpreter's)."""
        kinds = {(layer.in_features, layer.bits, _group(layer), layer.zero is None)
                 for layer in layers}  # fmt: skip
        if len(kinds) != 1:
            return None
        parts = [self.prepare(layer) for layer in layers]
        zeros = [part["zero"] for part in parts]
        sizes = [layer.out_features for layer in layers]
        return {
            "words": torch.cat([part["words"] for part in parts]),  # [ΣN, W] int32
            "scale": torch.cat([part["scale"] for part in parts], dim=1),  # [G, ΣN]
            "zero": None if zeros[0] is None else torch.cat(zeros, dim=1),  # [G, ΣN] u8
            "static": parts[0]["static"],
            "columns": [(sum(sizes[:i]), n) for i, n in enumerate(sizes)],
        }

    def matmul_layout(self, x: Tensor, prepared: dict[str, Any]) -> Tensor:
        return self.matmul(None, x, prepared, None)  # [M, ΣN]

    def matmul(self, layer, x: Tensor, prepared: dict, bias: Tensor | None) -> Tensor:
        operands = (prepared["words"], prepared["scale"], prepared["zero"], bias)
        if x.shape[0] <= SMALL_M:  # operands built by prepare: no shape checks per call
            out = gemv_unless_refused(
                prepared, x, lambda: int_gemv(x, *operands, **prepared["static"], check=False)
            )
            if out is not None:
                return out  # [M, N]
        elif x.shape[0] < DEQUANT_M:
            return int_gemm(x, *operands, **prepared["static"])  # [M, N]
        weight = int_dequant(*operands[:3], k=x.shape[1], dtype=x.dtype, **prepared["static"])
        return F.linear(x, weight, bias)  # [M, N]


register_backend(TritonIntBackend())
