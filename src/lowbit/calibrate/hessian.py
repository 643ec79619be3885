"""Hessians ``H = 2/N Σ x xᵀ`` of the inputs of linear layers, accumulated with hooks.

The Hessian belongs to what the weight multiplies: for a
:class:`~lowbit.nn.quant_linear.FakeQuantLinear` with an ``input_transform`` (an online
Hadamard, say) it is taken after the transform; an activation quantizer, if any, is not applied
(calibration sees float activations). Linears that read the same input tensor through the same
transform (q/k/v, gate/up) share one accumulator, found from the first forward pass.

When only the Hessians are wanted (not the block's output), a collector built with
``stop_when_complete=True`` raises :class:`AllInputsSeen` as soon as every linear has seen its
input for the current sample, so the rest of the forward pass (down_proj's product, the
residual) is not computed; :func:`lowbit.calibrate.capture.run_block` catches it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lowbit.errors import LowbitError

__all__ = ["AllInputsSeen", "HessianAccumulator", "HessianCollector"]


class AllInputsSeen(Exception):
    """Raised by a collector's hook once every linear has seen the current sample's input."""


class HessianAccumulator:
    """Running ``Σ x xᵀ`` and token count, kept apart per split ("train", "heldout").

    The held-out split is only ever used for output errors (:meth:`output_error`), so it keeps
    its input rows [T, width] while they are smaller than a width² sum (T < width) and turns
    them into the sum after that: one 512-token sample of a 14336-wide down_proj is 29 MB of
    rows where its sum would be 822 MB.

    Args:
        width: input features.
        device: where the sums live (the compute device).
    """

    ROW_SPLITS = ("heldout",)

    def __init__(self, width: int, device: torch.device | str = "cpu"):
        self.width = width
        self.device = torch.device(device)
        self._sums: dict[str, Tensor] = {}
        self._rows: dict[str, list[Tensor]] = {}  # row splits, while T < width: [T_i, width] each
        self._tokens: dict[str, int] = {}
        self._scaled: set[str] = set()  # splits whose sum is now the Hessian (see hessian)

    def add(self, x: Tensor, split: str = "train") -> None:
        """Add the tokens of ``x`` [..., width]."""
        if split in self._scaled:
            raise LowbitError(f"the {split!r} Hessian was taken already; no tokens can be added")
        rows = x.reshape(-1, self.width).float()  # [T, width]
        tokens = self._tokens.get(split, 0) + rows.shape[0]
        self._tokens[split] = tokens
        if split in self.ROW_SPLITS and split not in self._sums and tokens < self.width:
            self._rows.setdefault(split, []).append(rows.to(self.device, copy=True))
            return
        total = self._sums.get(split)
        if total is None:
            total = self._sums[split] = self._sum_of_rows(split)
        total.addmm_(rows.T, rows)  # [width, width]

    def tokens(self, split: str = "train") -> int:
        return self._tokens.get(split, 0)

    def hessian(self, split: str = "train") -> Tensor:
        """``2/N Σ x xᵀ`` over the ``N`` tokens of ``split``: [width, width] fp32, not to be
        modified. The sum is scaled in place the first time (the same numbers as a scaled copy)
        and returned as it is after that: the sum and a copy side by side would hold two
        ``width²`` matrices (822 MB each for a 14336-wide down_proj), and no more tokens are
        taken for that split."""
        self._check_tokens(split)
        if split in self._rows:
            self._sums[split] = self._sum_of_rows(split)
        if split not in self._scaled:
            self._sums[split].mul_(2.0 / self._tokens[split])
            self._scaled.add(split)
        return self._sums[split]

    def output_error(self, delta: Tensor, split: str = "heldout") -> float:
        """Mean over the split's tokens of ``‖ΔW x‖²`` for ``delta`` = ΔW [out, in]: from the
        rows where the split holds them, else ``tr(ΔW H ΔWᵀ) / 2`` (H = 2/N Σ x xᵀ)."""
        self._check_tokens(split)
        rows = self._rows.get(split)
        if rows is None:
            hessian = self.hessian(split)
            return 0.5 * float(((delta @ hessian) * delta).sum())  # [out, in] · [in, in]
        total = sum(float(torch.mm(held, delta.T).square().sum()) for held in rows)  # [T_i, out]
        return total / self._tokens[split]

    def _check_tokens(self, split: str) -> None:
        if not self._tokens.get(split):
            raise LowbitError(f"no calibration tokens were seen for the {split!r} split")

    def _sum_of_rows(self, split: str) -> Tensor:
        """``Σ x xᵀ`` [width, width] over the rows the split held (none: zeros); they are let go."""
        total = torch.zeros(self.width, self.width, device=self.device, dtype=torch.float32)
        for held in self._rows.pop(split, []):
            total.addmm_(held.T, held)
        return total


class HessianCollector:
    """Hooks that accumulate the input Hessians of some linear layers while a block runs.

    Use as a context manager (hooks are removed on exit, also after an exception). Call
    :meth:`new_sample` before each forward pass; set :attr:`split` to route the tokens.

    Args:
        linears: ``{name: module}``; modules are ``nn.Linear`` or anything with a ``weight``
            [out, in] and an optional ``input_transform`` module.
        device: where the sums live (default: each module's weight device).
        stop_when_complete: raise :class:`AllInputsSeen` once every linear has seen the
            current sample's input (for passes whose output is not needed).
        accumulator_factory: ``factory(width, device)`` -> a new accumulator (default:
            :class:`HessianAccumulator`; distributed calibration gathers inputs to an owner
            rank, :mod:`lowbit.calibrate.distributed`).
    """

    def __init__(
        self,
        linears: dict[str, nn.Module],
        device: torch.device | str | None = None,
        *,
        stop_when_complete: bool = False,
        accumulator_factory=HessianAccumulator,
    ):
        self.linears = dict(linears)
        self.device = device
        self.stop_when_complete = stop_when_complete
        self.accumulator_factory = accumulator_factory
        self.split = "train"
        self.accumulators: dict[str, HessianAccumulator] = {}
        self._seen: dict[tuple[int, int], tuple[Tensor, HessianAccumulator]] = {}
        self._recorded: set[str] = set()  # linears that saw the current sample
        self._handles: list = []

    def new_sample(self) -> None:
        """Forget which inputs were seen (call before each forward pass)."""
        self._seen.clear()
        self._recorded.clear()

    def _record(self, name: str, source: Tensor, key_module: nn.Module | None, x: Tensor) -> None:
        key = (id(source), id(key_module))
        seen = self._seen.get(key)
        if seen is not None and seen[0] is source:  # same tensor object: a shared input
            self.accumulators.setdefault(name, seen[1])
        else:
            accumulator = self.accumulators.get(name)
            if accumulator is None:
                device = self.device or self.linears[name].weight.device
                accumulator = self.accumulators[name] = self.accumulator_factory(
                    x.shape[-1], torch.device(device)
                )
            accumulator.add(x.detach(), self.split)
            self._seen[key] = (source, accumulator)  # holds ``source`` so its id is not reused
        self._recorded.add(name)
        if self.stop_when_complete and len(self._recorded) == len(self.linears):
            raise AllInputsSeen

    def __enter__(self) -> HessianCollector:
        try:
            for name, module in self.linears.items():
                transform = getattr(module, "input_transform", None)
                if transform is not None:

                    def after_transform(_mod, args, output, name=name, transform=transform):
                        self._record(name, args[0], transform, output)

                    self._handles.append(transform.register_forward_hook(after_transform))
                else:

                    def before_linear(_mod, args, name=name):
                        self._record(name, args[0], None, args[0])

                    self._handles.append(module.register_forward_pre_hook(before_linear))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()

    def groups(self) -> list[list[str]]:
        """Names of the linears that share one accumulator, in hook order."""
        by_accumulator: dict[int, list[str]] = {}
        for name in self.linears:
            if name in self.accumulators:
                by_accumulator.setdefault(id(self.accumulators[name]), []).append(name)
        return list(by_accumulator.values())
