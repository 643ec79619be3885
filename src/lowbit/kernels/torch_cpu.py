"""The ``torch-cpu`` backend: torch's own CPU kernels for 2-4-bit groups and 8-bit channels.

Which path runs, per weight format and input dtype (``M`` rows of ``x``, weight ``[N, K]``):

* **2, 3 or 4 bits, bf16 or fp16 input, groups that are a multiple of 32** (per channel counts
  as one group of ``K``): ``aten._weight_int4pack_mm_for_cpu``. The kernel decodes ``w = (c' -
  8) * s + z`` per group of 32/64/128/256 along ``K`` with unsigned 4-bit codes ``c'`` and ``(s,
  z)`` in the input's dtype, accumulating in fp32. A ``b``-bit code ``c`` becomes ``c' = c + 8 -
  2**(b-1)`` (a 4-bit code: ``c`` itself), so lowbit's symmetric ``(c - 2**(b-1)) * scale`` is
  ``z = 0`` and asymmetric ``(c - zero) * scale`` is ``z = (2**(b-1) - zero) * scale`` (exact in
  fp32). 2- and 3-bit weights so run at the 4-bit kernel's speed and hold 4 bits per weight in
  its layout at run time (their checkpoint keeps 2 or 3). A lowbit group of ``G`` is the
  kernel's largest group dividing ``G`` with the scale repeated; ``N`` is padded to the kernel's
  multiple of 16 with zero rows.
* **8 bits symmetric per channel, bf16 or fp16 input, K a multiple of 8**:
  ``aten._weight_int8pack_mm`` with int8 codes ``c - 128`` and one scale per row (its AVX2 loop
  has no K tail: other K read past the row).
* **Every other 2-4- or 8-bit case** (fp32 inputs, groups not a multiple of 32, grouped or
  asymmetric 8 bits): the reference's arithmetic (codes to fp32, ``(c - offset) * scale``, cast,
  ``F.linear``) with the codes unpacked once into a uint8 copy (4 and 8 bits: a view or a
  nibble split), so the output equals the reference's bit for bit, several times faster.
* 5, 6 and 7 bits, and non-CPU tensors: refused (:meth:`TorchCPUBackend.unsupported`).

Why fp32 inputs do not use the kernels: their fp32 paths are 9-30x slower than their bf16 paths
on an AVX2 CPU and no faster than unpack + fp32 BLAS at decode sizes, and running fp32 inputs in
bf16 would change the numbers ``lowbit eval`` reports. A model that wants the kernels runs in
bf16 (quantize the bf16 model). With bf16 inputs the kernels round the scales (and ``z``) to bf16
and the output to bf16: they agree with the reference (which rounds each weight to bf16) to
within bf16 precision; ``tests/kernels/test_torch_cpu.py`` states the tolerance and the
measured error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lowbit.formats.packing import unpack_bits
from lowbit.kernels.dispatch import WeightBackend, register_backend

__all__ = ["TorchCPUBackend", "unpack_codes", "dequantize_exact"]

_INT4_GROUPS = (256, 128, 64, 32)  # the group sizes _weight_int4pack_mm_for_cpu takes
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_BITS = (2, 3, 4, 8)


def unpack_codes(layer) -> Tensor:
    """A 2-4- or 8-bit layer's unsigned codes ``[N, K]`` uint8 from its canonical bit stream."""
    n, k = layer.out_features, layer.in_features
    if layer.bits == 8:
        return layer.qdata[: n * k].view(n, k)
    if layer.bits == 4:  # byte j holds element 2j in its low nibble and 2j + 1 in its high one
        pairs = torch.stack((layer.qdata & 0x0F, layer.qdata >> 4), dim=-1)  # [bytes, 2]
        return pairs.view(-1)[: n * k].view(n, k)
    return unpack_bits(layer.qdata, layer.bits, n * k).view(n, k)


def dequantize_exact(layer, dtype: torch.dtype, codes: Tensor | None = None) -> Tensor:
    """``[N, K]`` weight in ``dtype``, decoded in fp32 with the reference's arithmetic."""
    n, k = layer.out_features, layer.in_features
    group = layer.group_size or k
    codes = codes if codes is not None else unpack_codes(layer)
    codes = codes.view(n, k // group, group)  # [N, G, g]
    w = codes.to(torch.float32)
    scale = layer.scale.float().unsqueeze(-1)  # [N, G, 1]
    if layer.zero is None:
        w.sub_(float(2 ** (layer.bits - 1)))
    else:
        w.sub_(layer.zero.float().unsqueeze(-1))
    return w.mul_(scale).view(n, k).to(dtype)


def _int4_kernel_group(layer) -> int | None:
    """The kernel group size that expresses the layer's groups, or None if none does."""
    group = layer.group_size or layer.in_features
    return next((g for g in _INT4_GROUPS if group % g == 0), None)


def _kernel(layer) -> str | None:
    """``"int4"`` or ``"int8"`` where one of torch's kernels runs the format, else None."""
    if layer.bits <= 4 and _int4_kernel_group(layer) is not None:
        return "int4"
    if (
        layer.bits == 8
        and layer.zero is None
        and layer.group_size in (None, layer.in_features)
        and layer.in_features % 8 == 0
    ):
        return "int8"
    return None


def _in_dtype(prepared: dict[str, Tensor], key: str, dtype: torch.dtype) -> Tensor:
    """``prepared[key]`` cast to ``dtype``, cast once and kept beside it."""
    cast_key = f"{key}:{dtype}"
    if cast_key not in prepared:
        prepared[cast_key] = prepared[key].to(dtype)
    return prepared[cast_key]


class TorchCPUBackend(WeightBackend):
    """torch's int4/int8 CPU kernels for bf16/fp16 inputs; exact unpack + BLAS otherwise."""

    name = "torch-cpu"

    def unsupported(self, layer, x: Tensor) -> str | None:
        if x.device.type != "cpu":
            return f"it runs on the CPU only, and the input is on {x.device.type}"
        if layer.bits not in _BITS:
            return (
                f"torch has CPU kernels for 2-4- and 8-bit weights only, and this one has "
                f"{layer.bits} bits"
            )
        return None

    def prepare(self, layer) -> dict[str, Tensor]:
        kernel = _kernel(layer)
        codes = unpack_codes(layer)  # [N, K] uint8
        if kernel is None:  # the exact path; 2 and 3 bits keep their codes unpacked once
            return {} if layer.bits in (4, 8) else {"codes": codes}
        if kernel == "int8":
            int8, scale = _int8_parts(layer, codes)
            return {"int8": int8, "scale": scale}
        codes, scale_zero = _int4_parts(layer, codes)
        return _int4_layout(codes, scale_zero, _int4_kernel_group(layer))

    def prepare_group(self, layers: list) -> dict[str, Any] | None:
        """Layers with one input width and one kernel (int4 with one kernel group, or int8):
        their codes and scales stacked along ``N``, each layer's rows padded to the int4
        kernel's 16 as on its own, so every output equals the layer's own call bit for bit."""
        kernels = {(_kernel(layer), _int4_kernel_group(layer)) for layer in layers}
        widths = {layer.in_features for layer in layers}
        if len(kernels) != 1 or len(widths) != 1 or next(iter(kernels))[0] is None:
            return None
        kernel, group = next(iter(kernels))
        sizes = [layer.out_features for layer in layers]
        if kernel == "int8":
            parts = [_int8_parts(layer, unpack_codes(layer)) for layer in layers]
            prepared = {"int8": torch.cat([p[0] for p in parts]),  # [ΣN, K]
                        "scale": torch.cat([p[1] for p in parts])}  # fmt: skip
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
        else:
            parts = [_int4_parts(layer, unpack_codes(layer)) for layer in layers]
            codes = torch.cat([p[0] for p in parts])  # [Σ N16, K]
            prepared = _int4_layout(codes, torch.cat([p[1] for p in parts]), group)
            padded = [p[0].shape[0] for p in parts]
            starts = [sum(padded[:i]) for i in range(len(padded))]
        prepared["columns"] = list(
            zip(starts, sizes, strict=True)
        )  # each layer's [start, start + N)
        return prepared

    def matmul(self, layer, x: Tensor, prepared: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        if x.dtype not in _KERNEL_DTYPES or "int4" not in prepared and "int8" not in prepared:
            weight = dequantize_exact(layer, x.dtype, prepared.get("codes"))  # [N, K]
            return F.linear(x, weight, bias)  # [M, N]
        out = _kernel_matmul(x, prepared)[:, : layer.out_features]  # [M, N16] -> [M, N]
        return out if bias is None else out + bias

    def matmul_group(self, layers: list, x: Tensor, prepared: dict[str, Any]) -> list[Tensor]:
        if x.dtype not in _KERNEL_DTYPES:
            return None  # the exact path, layer by layer
        out = _kernel_matmul(x, prepared)  # [M, Σ N16]
        outs = []
        for layer, (start, n) in zip(layers, prepared["columns"], strict=True):
            part = out[:, start : start + n]  # [M, N_i]
            outs.append(part if layer.bias is None else part + layer.bias.to(x.dtype))
        return outs


def _int8_parts(layer, codes: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes ``c - 128`` ``[N, K]`` and the fp32 scale per row ``[N]``."""
    return (codes.to(torch.int16) - 128).to(torch.int8), layer.scale.float()[:, 0]


def _int4_parts(layer, codes: Tensor) -> tuple[Tensor, Tensor]:
    """Codes ``c'`` ``[N16, K]`` int32 and ``(s, z)`` ``[N16, K / g, 2]`` fp32 of the int4
    kernel (module docstring), ``N`` padded to a multiple of 16 with rows that decode to 0."""
    n, k = layer.out_features, layer.in_features
    g = _int4_kernel_group(layer)
    repeat = (layer.group_size or k) // g
    scale = layer.scale.float().repeat_interleave(repeat, dim=1)  # [N, K / g]
    half = 2 ** (layer.bits - 1)
    codes = codes.to(torch.int32) + (8 - half)  # c' = c + 8 - 2**(b-1): (c - half) s = (c' - 8) s
    if layer.zero is None:
        shift = torch.zeros_like(scale)
    else:  # (c - zero) * s = (c' - 8) * s + (half - zero) * s; exact: small integer x fp16
        shift = (half - layer.zero.float()).repeat_interleave(repeat, dim=1) * scale
    n_pad = -n % 16  # the kernel packs N in blocks of 16
    codes = F.pad(codes, (0, 0, 0, n_pad), value=8)  # [N16, K]
    scale_zero = F.pad(torch.stack((scale, shift), dim=-1), (0, 0, 0, 0, 0, n_pad))
    return codes, scale_zero  # [N16, K], [N16, K / g, 2]


def _int4_layout(codes: Tensor, scale_zero: Tensor, group: int) -> dict[str, Any]:
    return {
        "int4": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2),
        "scale_zero": scale_zero.transpose(0, 1).contiguous(),  # [K / g, N16, 2] fp32
        "group": group,
    }


def _kernel_matmul(x: Tensor, prepared: dict[str, Any]) -> Tensor:
    """``x [M, K]`` (bf16/fp16) times a prepared int4 or int8 layout: ``[M, N]`` (N16 int4)."""
    x = x.contiguous()
    if "int8" in prepared:
        scale = _in_dtype(prepared, "scale", x.dtype)  # [N]
        return torch.ops.aten._weight_int8pack_mm(x, prepared["int8"], scale)
    scale_zero = _in_dtype(prepared, "scale_zero", x.dtype)  # [K / g, N16, 2]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, prepared["int4"], prepared["group"], scale_zero
    )


register_backend(TorchCPUBackend())
