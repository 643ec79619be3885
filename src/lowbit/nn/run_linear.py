"""Packed layers in the form a run computes them from, in place of their packed buffers.

A packed layer holds the buffers its checkpoint stores; a backend computes from another form of
the same weight, and kept side by side the two cost more than they should (a W8 layer held its
codes twice on the CPU: 2 bytes per weight; a W4 layer on a GPU its bit stream beside the
Triton kernels' tiled words). For a bf16 or fp16 run (:func:`lowbit.models.run.prepare_run`)
each packed layer is swapped for its run form, with the packed buffers released:

* :class:`DecodedLinear`, for SpQR and 2/4/16 on the CPU (their groups of 16 columns fit none
  of torch's packed CPU kernels): the weight decoded once in the run's dtype;
* :class:`KernelLinear`, for the formats torch's int4/int8 CPU kernels run on the CPU and the
  ``triton`` backend's integer kernels on a GPU: the kernel's layout alone. The projections of
  one input (q/k/v, gate/up) share one stacked layout: the first one called computes every
  member's output in one kernel call (a :class:`KernelLayout`), which at batch 1 saves most of a
  call's fixed cost. Under ``torch.compile`` each member is one opaque op
  (``lowbit::layout_matmul``) that shares the product the same way at run time.

Outputs equal the packed layers' on the same backend bit for bit on the CPU; the Triton
kernels' stacked product may split its fp32 sums differently along K (a launch tuned for the
stacked N). A run form counts the bits its
format stores (``storage_bits``) and the weights it stands for (``weight_numel``); it cannot be
saved, exported or moved to another device (its packed form is gone): load the checkpoint again.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowbit.errors import LowbitError
from lowbit.kernels.dispatch import WeightBackend, choose, get_backend
from lowbit.mapped import release_pages
from lowbit.nn.packed_linear import PackedLinearBase
from lowbit.nn.quant_linear import replace_module

__all__ = [
    "RunLinear",
    "DecodedLinear",
    "KernelLinear",
    "KernelLayout",
    "decode_for_run",
    "kernel_form",
    "decodes_on_the_cpu",
    "check_not_run_form",
]

_RUN_DTYPES = (torch.bfloat16, torch.float16)
#: the backend settings a packed layer may have for a kernel run form on each device type (on
#: the CPU, ``triton`` runs in Triton's interpreter: the tests' path)
_KERNEL_BACKENDS = {"cpu": ("auto", "torch-cpu", "triton"), "cuda": ("auto", "triton")}
#: live kernel layouts by handle, for the compiled path's custom op
_LAYOUTS: weakref.WeakValueDictionary[int, KernelLayout] = weakref.WeakValueDictionary()


class RunLinear(nn.Module):
    """What every run form keeps of the packed layer it replaces: its bias, input transform,
    activation quantizer and accounting; no packed buffers."""

    def __init__(self, packed: PackedLinearBase):
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bias = packed.bias
        self.input_transform = packed.input_transform
        self.act_quantizer = packed.act_quantizer
        self.packed_storage_bits = packed.storage_bits()  # what its checkpoint stores
        self.packed_format = packed.weight_format()

    def _input(self, x: Tensor) -> Tensor:
        if self.input_transform is not None:
            x = self.input_transform(x)
        if self.act_quantizer is not None:
            x = self.act_quantizer(x)
        return x

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features

    def storage_bits(self) -> int:
        """The bits the packed layer stores (weight with statistics, plus bias)."""
        return self.packed_storage_bits

    def run_tensors(self) -> list[Tensor]:
        """The tensors it computes from that are not its parameters (memory accounting)."""
        return []

    def spec(self) -> dict[str, Any]:
        raise LowbitError(
            f"a layer prepared for the run ({self.packed_format}) has released its packed "
            "weight; load the checkpoint again to save or export it"
        )


class DecodedLinear(RunLinear):
    """y = act_quantizer(input_transform(x)) @ Wᵀ + b, W a packed layer's weight decoded once
    in ``dtype`` (bf16 or fp16: one rounding from fp32, as the reference backend rounds it)."""

    def __init__(self, packed: PackedLinearBase, dtype: torch.dtype):
        super().__init__(packed)
        self.weight = nn.Parameter(packed.dequantize_weight(dtype), requires_grad=False)  # [N, K]

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        x = self._input(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, weight={self.packed_format} "
            f"decoded to {str(self.weight.dtype).removeprefix('torch.')}"
        )


class KernelLayout:
    """One backend layout of the weights of one or more layers that read the same input.

    ``prepared`` comes from :meth:`~lowbit.kernels.dispatch.WeightBackend.prepare_group`, its
    ``"columns"`` the ``(start, n)`` of each member in the product. One call computes every
    member's output; the others' are kept until they are asked for, for the same input tensor
    unchanged (identity and ``_version``): any other input is computed afresh.
    """

    def __init__(self, backend: WeightBackend, prepared: dict[str, Any]):
        self.backend, self.prepared = backend, prepared
        self.columns: list[tuple[int, int]] = prepared["columns"]
        self.device = self.tensors()[0].device
        self._forget()
        _LAYOUTS[id(self)] = self  # what the compiled path's op finds by handle

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy: a handle of its own
        self.__dict__.update(state)
        _LAYOUTS[id(self)] = self

    def _forget(self) -> None:
        self._input: Tensor | None = None  # held, so that its id cannot be reused meanwhile
        self._version = -1
        self._outputs: list[Tensor] = []
        self._pending: set[int] = set()

    def __call__(self, index: int, x: Tensor) -> Tensor:  # [..., K] -> [..., N_index]
        if torch.compiler.is_compiling():  # one opaque node per member, on the input as given
            return torch.ops.lowbit.layout_matmul(x, id(self), index, self.columns[index][1])
        return self.member(index, x)

    def member(self, index: int, x: Tensor) -> Tensor:  # [..., K] -> [..., N_index]
        """Member ``index``'s output: one product for every member of the same input."""
        if len(self.columns) == 1:
            return self._compute(x)[index]
        fresh = x is self._input and x._version == self._version and index in self._pending
        if not fresh:
            self._input, self._version = x, x._version
            self._outputs, self._pending = self._compute(x), set(range(len(self.columns)))
        output = self._outputs[index]
        self._pending.discard(index)
        if not self._pending:
            self._forget()
        return output

    def _compute(self, x: Tensor) -> list[Tensor]:
        lead = x.shape[:-1]
        out = self.backend.matmul_layout(x.reshape(-1, x.shape[-1]), self.prepared)  # [M, ΣN']
        if self.columns == [(0, out.shape[1])]:  # one member, no padding: the product itself
            return [out.reshape(*lead, out.shape[1])]
        return [out[:, start : start + n].reshape(*lead, n) for start, n in self.columns]

    def tensors(self) -> list[Tensor]:
        return [t for t in self.prepared.values() if isinstance(t, Tensor)]


class KernelLinear(RunLinear):
    """y = act_quantizer(input_transform(x)) @ Wᵀ + b from a kernel's layout of W alone (member
    ``index`` of a :class:`KernelLayout`). bf16/fp16 inputs as the packed layer computed them;
    fp32 inputs through the same kernel's fp32 path (the packed layer's exact fp32 path needs the
    codes this form released)."""

    def __init__(self, packed: PackedLinearBase, layout: KernelLayout, index: int):
        super().__init__(packed)
        self.layout, self.index = layout, index

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        out = self.layout(self.index, self._input(x))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def run_tensors(self) -> list[Tensor]:
        return self.layout.tensors()

    def _apply(self, fn, recurse: bool = True):
        if fn(torch.empty(0, device=self.layout.device)).device != self.layout.device:
            raise LowbitError(
                f"a model prepared for a run on {self.layout.device} holds its kernels' layouts "
                "only; load the checkpoint again on the other device"
            )
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        shared = len(self.layout.columns)
        with_others = f", one call with {shared - 1} others" if shared > 1 else ""
        return (
            f"in={self.in_features}, out={self.out_features}, weight={self.packed_format} "
            f"in {self.layout.backend.name}'s layout{with_others}"
        )


@torch.library.custom_op("lowbit::layout_matmul", mutates_args=())
def _layout_matmul_op(x: Tensor, layout_handle: int, index: int, n: int) -> Tensor:
    """``x [..., K]`` times member ``index`` of the registered :class:`KernelLayout`,
    ``[..., n]``, opaque to ``torch.compile``: the first member called with an input tensor
    computes every member's product in one kernel call, as eagerly (the compiler would not merge
    the members' calls; they take the same input tensor, except where inductor computes that
    input once per member, as it did for the first block's q/k/v of a tiny Llama: each is then
    a product of its own, correct but not shared). A shared product's member gets a copy of its
    columns (an op's output owns its memory and has the strides the compiler was told); a
    layer alone gets the product itself."""
    layout = _LAYOUTS[layout_handle]
    out = layout.member(index, x)
    alone = len(layout.columns) == 1 and out.untyped_storage().nbytes() == out.nbytes
    return out if alone and out.is_contiguous() else out.clone()  # (alone: not a padded slice)


@_layout_matmul_op.register_fake
def _(x: Tensor, layout_handle: int, index: int, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)


def _kernel_device(module: nn.Module) -> torch.device | None:
    """The device of a packed layer whose backend setting allows a kernel run form there."""
    if not isinstance(module, PackedLinearBase):
        return None
    devices = {buffer.device for buffer in module.buffers()}
    if len(devices) != 1:
        return None
    device = devices.pop()
    return device if module.backend in _KERNEL_BACKENDS.get(device.type, ()) else None


def _runs_on_cpu(module: nn.Module) -> bool:
    return (
        isinstance(module, PackedLinearBase)
        and module.backend in ("auto", "torch-cpu")
        and all(b.device.type == "cpu" for b in module.buffers())
    )


def decodes_on_the_cpu(layer: PackedLinearBase) -> bool:
    """Whether ``torch-cpu`` multiplies this layer's format by its whole decoded weight."""
    try:
        backend = get_backend("torch-cpu", layer.format_kind)
    except LowbitError:
        return False
    return getattr(backend, "decodes_whole_weight", False)


def decode_for_run(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Swap every packed layer that the CPU runs from its decoded weight (SpQR, 2/4/16) for a
    :class:`DecodedLinear` in ``dtype`` (None: the model's), releasing its packed buffers.

    Only for bf16 and fp16 runs on the CPU with the ``auto`` or ``torch-cpu`` backend (an fp32
    run decodes per call and keeps no copy). Returns the number of layers swapped.
    """
    dtype = dtype or model.dtype
    if dtype not in _RUN_DTYPES:
        return 0
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if _runs_on_cpu(module) and decodes_on_the_cpu(module)
    ]
    for name, module in targets:
        decoded = DecodedLinear(module, dtype)
        replace_module(model, name, decoded)
        _release_packed([module], kept=[decoded.weight, decoded.bias])
    return len(targets)


def _release_packed(layers: list[PackedLinearBase], kept: list[Tensor | None]) -> None:
    """Give back the resident pages of swapped packed layers' own buffers where they are views
    of a memory-mapped checkpoint (:func:`lowbit.mapped.release_pages`): the mapping lives on
    for the layers not swapped yet, so without this a loaded model held its packed bits and
    their run form side by side until the last layer was swapped."""
    buffers = [b for layer in layers for b in layer.buffers(recurse=False)]
    release_pages(buffers, keep=[t for t in kept if t is not None])


def _layout(layers: list[PackedLinearBase], dtype: torch.dtype) -> KernelLayout | None:
    """One kernel layout of ``layers`` (one input's projections, or one layer), or None."""
    devices = {_kernel_device(layer) for layer in layers}
    if len(devices) != 1 or None in devices:
        return None
    device = devices.pop()
    if len(layers) > 1 and (
        len({layer.in_features for layer in layers}) != 1
        or any(layer.input_transform is not None or layer.act_quantizer is not None
               for layer in layers)
    ):  # fmt: skip
        return None  # each member would change the shared input on its own
    probes = [torch.empty(1, layer.in_features, dtype=dtype, device=device) for layer in layers]
    try:
        backends = {choose(layer, x) for layer, x in zip(layers, probes, strict=True)}
    except LowbitError:  # a backend set explicitly that cannot run here: the layer stays packed
        return None
    if len(backends) != 1:
        return None
    backend = backends.pop()
    prepared = backend.prepare_group(layers)
    return None if prepared is None else KernelLayout(backend, prepared)


def kernel_form(
    model: nn.Module, groups: list[list[PackedLinearBase]], dtype: torch.dtype | None = None
) -> tuple[int, int]:
    """Swap the packed layers of ``groups`` (each the projections of one input, or one layer)
    that a kernel with a layout of its own runs in ``dtype`` (None: the model's) where they are
    (torch's int4/int8 kernels on the CPU, the triton backend's integer kernels on a GPU) for
    :class:`KernelLinear` s,
    releasing their packed buffers. A group that cannot share one layout is tried layer by
    layer. Only for bf16 and fp16 runs. Returns (layers swapped, shared layouts)."""
    dtype = dtype or model.dtype
    if dtype not in _RUN_DTYPES:
        return 0, 0
    names = {id(module): name for name, module in model.named_modules()}
    swapped = shared = 0
    for group in groups:
        layout = _layout(group, dtype)
        if layout is None and len(group) > 1:
            swapped += kernel_form(model, [[layer] for layer in group], dtype)[0]
            continue
        if layout is None:
            continue
        for index, layer in enumerate(group):
            replace_module(model, names[id(layer)], KernelLinear(layer, layout, index))
        _release_packed(group, kept=[*layout.tensors(), *(layer.bias for layer in group)])
        swapped += len(group)
        shared += len(group) > 1
    return swapped, shared


def check_not_run_form(model: nn.Module, verb: str) -> None:
    """Refuse, with one sentence, to ``verb`` a model that holds layers prepared for a run."""
    for name, module in model.named_modules():
        if isinstance(module, RunLinear):
            raise LowbitError(
                f"cannot {verb} this model: {name} ({module.packed_format}) was prepared for "
                "the run and its packed weight released; load the checkpoint again"
            )
