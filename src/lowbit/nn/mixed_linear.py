"""The packed face of a mixed 2/4-bit weight (Li et al., 2024): :class:`MixedLinear`.

Its buffers are the stored tensors of :class:`~lowbit.formats.mixed.MixedQuantized` (the
aligned layout the kernels read as it is, and what a checkpoint stores):

* ``primary`` int32 ``[N, 4 U]``: each row's 128-bit words of codes;
* ``secondary`` int32 ``[N, ua]``: the second halves of the words' 4-bit groups;
* ``stats2`` int16 ``[N, T3]``: per triplet of 2-bit groups, three 2-bit zeros and the scale
  codes (4, 3, 3 bits); ``stats4`` uint8 ``[N, P4]``: a 4-bit group's zero and scale code;
* ``second2`` / ``second4`` fp16 ``[R, P, 2]``: second-order scale and integer zero per ``g2``
  rows of each slot;
* ``order`` int16 ``[P2 + P4]``: each slot's column group (-1: padding);
* ``row_ptr`` int32 ``[N + 1]``, ``col_val`` int32 ``[nnz]``: the fp16 outliers in CSR.

``backend="reference"`` decodes the whole weight in fp32 and calls ``F.linear`` (the oracle);
``"torch-cpu"`` keeps that decoded weight per bf16/fp16 input dtype
(:mod:`lowbit.kernels.torch_cpu_decoded`, the CPU path); ``"triton"`` runs
:mod:`lowbit.kernels.mixed_gemv` for up to 16 rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.formats.mixed import GROUP, MixedQuantized, segments
from lowbit.formats.sparse import CSRMatrix
from lowbit.nn.packed_linear import PackedLinearBase
from lowbit.nn.spec import register_module
from lowbit.settings import Count

__all__ = ["MixedLinear"]


@register_module
class MixedLinear(PackedLinearBase):
    """y = act_quantizer(input_transform(x)) @ Wᵀ + b with ``W`` mixed 2/4-bit.

    Args:
        in_features, out_features: the weight is ``[out_features, in_features]``.
        n4: how many of the ``ceil(in_features / 16)`` column groups are 4-bit.
        g2: rows per second-order scale group.
        nnz: stored outliers.
        weight_dtype, bias, input_transform, act_quantizer, backend: as for every packed
            linear (:class:`~lowbit.nn.packed_linear.PackedLinearBase`).

    Buffers are allocated empty; :meth:`from_quantized` or ``load_state_dict`` fill them.
    """

    format_kind = "mixed"
    container_type = MixedQuantized
    format_fields = {"n4": Count, "g2": int, "nnz": Count}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        n4: int,
        g2: int = 16,
        nnz: int = 0,
        weight_dtype: torch.dtype = torch.float32,
        bias: bool = False,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        groups = math.ceil(in_features / GROUP)
        if not 0 <= n4 <= groups:
            raise LowbitError(f"n4 must be between 0 and {groups} column groups, not {n4}")
        if in_features > 65536:
            raise LowbitError(f"a mixed linear is at most 65536 wide, not {in_features}")
        self._init_linear(
            in_features, out_features, weight_dtype=weight_dtype, bias=bias,
            input_transform=input_transform, act_quantizer=act_quantizer, backend=backend,
            device=device,
        )  # fmt: skip
        self.n4, self.g2 = n4, g2
        seg = segments(groups - n4, n4)
        n, r = out_features, math.ceil(out_features / g2)

        def buffer(name, shape, dtype):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))

        buffer("primary", (n, 4 * seg.words), torch.int32)
        buffer("secondary", (n, seg.ua), torch.int32)
        buffer("stats2", (n, seg.triplets), torch.int16)
        buffer("stats4", (n, seg.slots4), torch.uint8)
        buffer("second2", (r, seg.slots2, 2), torch.float16)
        buffer("second4", (r, seg.slots4, 2), torch.float16)
        buffer("order", (seg.slots2 + seg.slots4,), torch.int16)
        buffer("row_ptr", (n + 1,), torch.int32)
        buffer("col_val", (nnz,), torch.int32)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_quantized(
        cls,
        weight: MixedQuantized,
        bias: Tensor | None = None,
        *,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        weight_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ) -> MixedLinear:
        """The packed layer of a mixed weight container (its tensors copied)."""
        out_features, in_features = weight.shape
        layer = cls(
            in_features, out_features, n4=weight.n4, g2=weight.g2,
            nnz=weight.outliers.nnz, weight_dtype=weight_dtype or weight.dtype,
            bias=bias is not None, input_transform=input_transform,
            act_quantizer=act_quantizer, backend=backend, device=weight.primary.device,
        )  # fmt: skip
        for name, tensor in weight.stored_tensors().items():
            setattr(layer, name, tensor.clone())
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @property
    def quantized_weight(self) -> MixedQuantized:
        """The weight as a :class:`MixedQuantized` container (views of the buffers)."""
        shape = torch.Size((self.out_features, self.in_features))
        return MixedQuantized(
            primary=self.primary,
            secondary=self.secondary,
            stats2=self.stats2,
            stats4=self.stats4,
            second2=self.second2,
            second4=self.second4,
            order=self.order,
            outliers=CSRMatrix(self.row_ptr, self.col_val, tuple(shape)),
            shape=shape,
            dtype=self.weight_dtype,
            g2=self.g2,
            n4=self.n4,
        )

    def format_spec(self) -> dict[str, Any]:
        return {"n4": self.n4, "g2": self.g2, "nnz": self.col_val.numel()}

    def weight_format(self) -> str:
        groups = math.ceil(self.in_features / GROUP)
        return (
            f"mixed 2/4-bit ({self.n4}/{groups} 4-bit groups, {self.col_val.numel()} fp16 "
            f"outliers, g2 {self.g2})"
        )
