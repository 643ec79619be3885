"""The packed face of an SpQR weight: words, outliers and input permutation as buffers of a
linear layer, in the layout of Crnčević's SpQR inference kernel (master's thesis, 2025).

Buffers (what a checkpoint stores, :mod:`lowbit.formats.spqr`):

* ``words``: int64 ``[ceil(out / 16), ceil(in / 16) * 16]``, one 64-bit word per tile row;
* ``sparse_ptr``: int32 row offsets ``[out + 1]`` (CSR) or tile-row offsets ``[ceil(out / 16)
  + 1]`` (PTCSR);
* ``col_vals``: int32 ``[nnz]`` words, fp16 value high, column low (PTCSR: with padding);
* ``perm``: int16 ``[in]`` input permutation (act-order), absent without one.

The product runs on the module's backend (:mod:`lowbit.kernels.dispatch`, format kind
``"spqr"``): ``reference`` decodes the whole weight (the simulated face, bit for bit),
``triton`` runs the fused kernels (:mod:`lowbit.kernels.triton_spqr`), ``torch-cpu`` keeps a
decoded weight per input dtype (:mod:`lowbit.kernels.torch_cpu_decoded`). ``sparse_format`` says
which outlier layout the triton backend multiplies with: ``"auto"`` (profile both once per
layer and keep the faster, Crnčević's thesis, §3.4.4), ``"csr"`` or ``"ptcsr"``; the stored
layout is converted once when it differs.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.formats.sparse import CSRMatrix, PTCSRMatrix
from lowbit.formats.spqr import TILE, SpQRQuantized
from lowbit.nn.packed_linear import PackedLinearBase
from lowbit.nn.spec import register_module
from lowbit.settings import Count

__all__ = ["SpQRLinear", "SPARSE_CHOICES"]

#: what ``SpQRLinear.sparse_format`` may be
SPARSE_CHOICES = ("auto", "csr", "ptcsr")


@register_module
class SpQRLinear(PackedLinearBase):
    """y = act_quantizer(input_transform(x)) @ (D' + S')ᵀ[:, perm⁻¹] + b, held packed.

    Args:
        in_features, out_features: the weight is ``[out_features, in_features]``.
        nnz: col_val words stored (PTCSR: padding included).
        stored_sparse: ``"csr"`` or ``"ptcsr"``, the stored outlier layout.
        permuted: whether an input permutation is stored.
        weight_dtype, bias, input_transform, act_quantizer, backend: as ``PackedLinear``.
    """

    format_kind = "spqr"
    container_type = SpQRQuantized
    format_fields = {"nnz": Count, "stored_sparse": Literal["csr", "ptcsr"], "permuted": bool}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        nnz: int = 0,
        stored_sparse: str = "csr",
        permuted: bool = True,
        weight_dtype: torch.dtype = torch.float32,
        bias: bool = False,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if stored_sparse not in ("csr", "ptcsr"):
            raise LowbitError(
                f"SpQR outliers are stored as 'csr' or 'ptcsr', not {stored_sparse!r}"
            )
        if in_features > 1 << 16:
            raise LowbitError(
                f"SpQR stores 16-bit column indices, so a layer may have at most 65536 input "
                f"columns, not {in_features}"
            )
        self._init_linear(
            in_features, out_features, weight_dtype=weight_dtype, bias=bias,
            input_transform=input_transform, act_quantizer=act_quantizer, backend=backend,
            device=device,
        )  # fmt: skip
        self.stored_sparse = stored_sparse
        self.sparse_format = "auto"
        tiles, groups = math.ceil(out_features / TILE), math.ceil(in_features / TILE)
        n_ptr = out_features + 1 if stored_sparse == "csr" else tiles + 1
        self.register_buffer(
            "words", torch.zeros(tiles, groups * TILE, dtype=torch.int64, device=device)
        )
        self.register_buffer("sparse_ptr", torch.zeros(n_ptr, dtype=torch.int32, device=device))
        self.register_buffer("col_vals", torch.zeros(nnz, dtype=torch.int32, device=device))
        perm = torch.arange(in_features, device=device).to(torch.int16) if permuted else None
        self.register_buffer("perm", perm)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_quantized(
        cls,
        weight: SpQRQuantized,
        bias: Tensor | None = None,
        *,
        input_transform: nn.Module | None = None,
        act_quantizer: nn.Module | None = None,
        weight_dtype: torch.dtype | None = None,
        backend: str = "auto",
    ) -> SpQRLinear:
        """The packed layer of an SpQR weight (3-bit codes and statistics, 16 x 16 tiles)."""
        words = weight.words()  # refuses formats the packed layout cannot hold
        out_features, in_features = weight.shape
        sparse = weight.outliers
        layer = cls(
            in_features,
            out_features,
            nnz=sparse.col_val.numel(),
            stored_sparse=weight.sparse_format,
            permuted=weight.perm is not None,
            weight_dtype=weight_dtype or weight.dtype,
            bias=bias is not None,
            input_transform=input_transform,
            act_quantizer=act_quantizer,
            backend=backend,
            device=words.device,
        )
        layer.words = words
        ptr = sparse.row_ptr if isinstance(sparse, CSRMatrix) else sparse.tile_ptr
        layer.sparse_ptr = ptr.to(torch.int32).clone()
        layer.col_vals = sparse.col_val.to(torch.int32).clone()
        if weight.perm is not None:
            layer.perm = weight.perm.clone()
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def outliers(self) -> CSRMatrix | PTCSRMatrix:
        """The stored outlier container (views of the buffers)."""
        shape = (self.out_features, self.in_features)
        if self.stored_sparse == "csr":
            return CSRMatrix(self.sparse_ptr, self.col_vals, shape, value_high=True)
        return PTCSRMatrix(self.sparse_ptr, self.col_vals, shape, value_high=True)

    @property
    def quantized_weight(self) -> SpQRQuantized:
        """The weight as an :class:`SpQRQuantized` (codes unpacked from the words)."""
        return SpQRQuantized.from_words(
            self.words,
            (self.out_features, self.in_features),
            self.outliers(),
            self.perm,
            self.weight_dtype,
        )

    def format_spec(self) -> dict[str, Any]:
        return {
            "nnz": self.col_vals.numel(),
            "stored_sparse": self.stored_sparse,
            "permuted": self.perm is not None,
        }

    def weight_format(self) -> str:
        fraction = 100 * int((self.col_vals != 0).sum()) / self.weight_numel
        order = ", act-order" if self.perm is not None else ""
        return f"spqr w3 16x16, {fraction:.2f}% outliers {self.stored_sparse}{order}"

    def set_sparse_format(self, choice: str) -> None:
        """Which outlier layout the triton backend multiplies with (``"auto"`` profiles)."""
        if choice not in SPARSE_CHOICES:
            raise LowbitError(f"sparse_format must be one of {SPARSE_CHOICES}, not {choice!r}")
        self.sparse_format = choice
        self.__dict__.pop("_prepared", None)
