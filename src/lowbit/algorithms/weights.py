"""Quantize the weights of a model's block linears with RTN or GPTQ: the driver recipes call.

``quantize_linears`` replaces each selected linear (an ``nn.Linear`` or a ``FakeQuantLinear``,
whose ``input_transform`` is kept) by a ``FakeQuantLinear`` holding the dequantized weight and
the exact storage of its packed form. With ``algo="gptq"`` it walks the model layer by layer
(:mod:`lowbit.calibrate.capture`).

The driver knows no format: each layer's :class:`WeightSpec` (integers:
:class:`~lowbit.algorithms.int_spec.IntWeightSpec`; SpQR and 2/4/16 bring theirs) quantizes a
weight by RTN or, given the layer's Hessian, by its GPTQ variant, and returns a weight container
(``dequantize``, ``storage_bits``, ``to``) that :mod:`lowbit.nn.packed_linear` can pack.

Choices:

* Calibration runs with float activations, as QuaRot's code does: activation quantizers
  (``act_quantizer_for``) are attached only after every block is quantized, and those already
  on selected layers are dropped while calibrating. The Hessians are of what the weight
  multiplies, after any ``input_transform``.
* Sequential (:class:`~lowbit.algorithms.gptq.GPTQSettings` ``sequential``, the default):
  block ``i + 1`` is calibrated on the outputs of the already quantized block ``i`` (two
  passes per block); within a block all linears are calibrated on the float block (one Hessian
  pass per block). ``sequential=False`` propagates the float block's outputs from the Hessian
  pass instead (one pass per block).
* Guard (``GPTQSettings.guard``): the last ``heldout_fraction`` of the calibration samples (at
  least one) are kept out of the Hessians; per layer, GPTQ's and the spec's
  ``guard_candidate``'s (RTN's, for integers) output errors ``‖X Wᵀ − X Ŵᵀ‖²`` on those
  samples (:meth:`~lowbit.calibrate.hessian.HessianAccumulator.output_error`) are compared
  and the smaller one's weight is kept.
* Resuming (GPTQ, ``resume_dir``): each finished block's packed weights and choices are written
  to a :class:`~lowbit.calibrate.resume.BlockCheckpoints` directory. A run started again with
  the same inputs restores the finished blocks instead of calibrating them; the walk still runs
  them forward (the same code path), so later blocks see bit for bit the inputs of an
  uninterrupted run and the result is identical to it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from lowbit.algorithms.gptq import GPTQSettings
from lowbit.calibrate.capture import BlockHooks, block_linears, calibrate_layer_by_layer
from lowbit.calibrate.hessian import HessianCollector
from lowbit.calibrate.resume import BlockCheckpoints, run_fingerprint
from lowbit.errors import LowbitError
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module

__all__ = [
    "WeightSpec",
    "LayerChoice",
    "WeightQuantReport",
    "quantize_linears",
    "selected_linears",
]


class WeightSpec(Protocol):
    """A layer's weight format, as :func:`quantize_linears` uses it. Containers it returns have
    ``dequantize(dtype=None)``, ``storage_bits()``, ``to(device)`` and a packed module
    (``@register_module``, :mod:`lowbit.nn.spec`)."""

    def check(self, weight: Tensor, name: str) -> None:
        """Raise LowbitError (one sentence) when ``weight`` cannot take this format."""

    def describe(self) -> str:
        """Short description, for reports."""

    def rtn(self, weight: Tensor) -> Any:
        """The container of ``weight`` [out, in] fp32 without calibration."""

    def gptq(
        self, weight: Tensor, hessian: Tensor, settings: GPTQSettings
    ) -> tuple[Any, Tensor, float]:
        """Calibrated on ``hessian`` [in, in] with the loop's ``settings`` (act-order, block
        size, dampening): ``(container, its dequantized fp32 weight (equal
        to ``container.dequantize()`` bit for bit), relative dampening used)``."""

    def guard_candidate(self, weight: Tensor) -> Any | None:
        """The uncalibrated container the held-out guard compares GPTQ's with, or None."""

    def matches(self, weight: Any) -> bool:
        """Whether a stored container is in this format (for resumed blocks)."""


@dataclass
class LayerChoice:
    """What happened to one linear.

    Attributes:
        name: fully qualified name.
        algo: "gptq", "rtn" or "float" (weight left unquantized).
        gptq_error, rtn_error: held-out output errors ``‖X ΔWᵀ‖² / tokens`` compared by the
            guard (None without it).
        damp: GPTQ's final relative dampening (None without GPTQ).
    """

    name: str
    algo: str
    gptq_error: float | None = None
    rtn_error: float | None = None
    damp: float | None = None

    @property
    def kind(self) -> str:
        """The layer's short name (q_proj, down_proj, ...)."""
        return self.name.rsplit(".", 1)[-1]


@dataclass
class WeightQuantReport:
    """Per-layer choices and totals of :func:`quantize_linears`."""

    algo: str
    layers: list[LayerChoice] = field(default_factory=list)
    seconds: float = 0.0
    solve_seconds: float = 0.0  # of ``seconds``, in the weight algorithm itself (RTN, GPTQ)
    calibration_samples: int = 0
    heldout_samples: int = 0

    def wins(self) -> dict[str, int]:
        """Layers per algorithm kept, e.g. ``{"gptq": 190, "rtn": 20}``."""
        return dict(Counter(layer.algo for layer in self.layers))

    def wins_by_kind(self) -> dict[str, dict[str, int]]:
        """``{short layer name: {algorithm: count}}``."""
        table: dict[str, Counter] = {}
        for layer in self.layers:
            table.setdefault(layer.kind, Counter())[layer.algo] += 1
        return {kind: dict(counts) for kind, counts in table.items()}

    def summary(self) -> str:
        kinds = ", ".join(
            f"{kind} " + "/".join(f"{a}:{n}" for a, n in sorted(c.items()))
            for kind, c in self.wins_by_kind().items()
        )
        return f"{self.algo}: {self.wins()} in {self.seconds:.1f} s ({kinds})"


def _replacement(linear: nn.Module, weight: Tensor, packed: Any, fmt: str) -> FakeQuantLinear:
    return FakeQuantLinear(
        weight.to(linear.weight.dtype),
        linear.bias,
        quantized_weight=packed,
        input_transform=getattr(linear, "input_transform", None),
        weight_format=fmt,
    )


def quantize_linears(
    model: nn.Module,
    adapter,
    *,
    spec_for: Callable[[str], WeightSpec | None],
    algo: Literal["rtn", "gptq"] = "gptq",
    calibration: Tensor | None = None,
    act_quantizer_for: Callable[[str], nn.Module | None] = lambda fqn: None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    gptq: GPTQSettings | None = None,
    progress: bool = True,
    device: torch.device | str | None = None,
    offload_device: torch.device | str = "cpu",
    resume_dir: str | Path | None = None,
    recipe: dict[str, Any] | None = None,
    hooks: BlockHooks | None = None,
    group=None,
) -> WeightQuantReport:
    """Quantize the weights of the selected block linears in place, block by block.

    Args:
        model, adapter: the model and its adapter.
        spec_for: ``spec_for(fqn)`` -> the layer's :class:`WeightSpec`, or None to keep it in
            float.
        algo: "rtn" (no calibration) or "gptq" (layer by layer on ``calibration``).
        calibration: [N, S] token ids (GPTQ).
        act_quantizer_for: ``act_quantizer_for(fqn)`` -> the module quantizing the layer's
            input at run time, or None; attached after calibration.
        filter_fn: ``filter_fn(module, fqn)`` -> whether the linear is touched (None = all),
            as :func:`lowbit.quantize` takes it.
        gptq: how GPTQ runs (ignored by RTN): the loop's settings, the RTN guard and its
            held-out share, sequential calibration; None = :class:`GPTQSettings`' defaults.
        progress: show progress bars.
        device: compute device for calibration (default: where the blocks are).
        offload_device: where captured activations live during calibration.
        resume_dir: GPTQ only: directory of block checkpoints (:mod:`lowbit.calibrate.resume`);
            finished blocks found there are restored instead of calibrated, the others are
            written as they finish. A directory from a different run is a LowbitError.
        recipe: the calling recipe's ``to_dict()`` (and overrides), part of the resume
            directory's fingerprint.
        hooks: where the blocks' weights come from and go (:class:`~lowbit.calibrate.capture.
            BlockHooks`; None: the model is in memory). ``finish(i)`` sees block ``i`` in its
            final form: every selected linear replaced, activation quantizers attached.
        group: GPTQ only: a :class:`~lowbit.calibrate.distributed.Group` whose processes
            share the samples, Hessians and solves (:mod:`lowbit.calibrate.distributed`); the
            result equals one process's bit for bit. None: this process alone.

    Returns:
        :class:`WeightQuantReport`.
    """
    if algo not in ("rtn", "gptq"):
        raise LowbitError(f"weight algorithm must be 'rtn' or 'gptq', not {algo!r}")
    start = time.perf_counter()
    names = selected_linears(model, adapter, filter_fn)
    specs = {n: spec_for(n) for n in names}
    for name, spec in specs.items():
        if spec is not None:
            spec.check(model.get_submodule(name).weight, name)
    report = WeightQuantReport(algo)
    hooks = _DriverHooks(model, adapter, set(names), report, act_quantizer_for, hooks)
    if algo == "rtn":
        for index in tqdm(range(adapter.num_layers), desc="rtn", disable=not progress):
            hooks.load(index)
            for name in block_linears(model, adapter, index):
                if name in hooks.selected:
                    solve = time.perf_counter()
                    report.layers.append(_quantize_rtn(model, name, specs[name]))
                    report.solve_seconds += time.perf_counter() - solve
            hooks.finish(index)
    else:
        _quantize_gptq(
            model, adapter, names, specs, calibration, gptq or GPTQSettings(), report, progress,
            device, offload_device, resume_dir, recipe, hooks, group,
        )  # fmt: skip
    report.seconds = time.perf_counter() - start
    return report


class _DriverHooks(BlockHooks):
    """The caller's hooks with the driver's own steps around them: on ``load`` it notes where
    the block lives (packed containers go there); before ``finish`` it keeps in float the
    selected linears no spec quantized and attaches every selected linear's activation
    quantizer (calibration ran with float activations: nothing runs this block again)."""

    def __init__(self, model, adapter, selected, report, act_quantizer_for, inner):
        self.model, self.adapter, self.selected, self.report = model, adapter, selected, report
        self.act_quantizer_for = act_quantizer_for
        self.inner = inner or BlockHooks()
        self.homes: dict[int, torch.device] = {}

    def capture_begin(self, device: torch.device) -> None:
        self.inner.capture_begin(device)

    def capture_end(self) -> None:
        self.inner.capture_end()

    def load(self, index: int) -> None:
        self.inner.load(index)
        self.homes[index] = next(self.adapter.blocks_module[index].parameters()).device

    def finish(self, index: int) -> None:
        done = {layer.name for layer in self.report.layers}
        for name, module in block_linears(self.model, self.adapter, index).items():
            if name not in self.selected:
                continue
            if name not in done:  # a block whose selected linears all stay float is not walked
                module = _replacement(module, module.weight, None, "float")
                replace_module(self.model, name, module)
                self.report.layers.append(LayerChoice(name, "float"))
            module.act_quantizer = self.act_quantizer_for(name)
        self.inner.finish(index)


def selected_linears(
    model: nn.Module, adapter, filter_fn: Callable[[nn.Module, str], bool] | None
) -> list[str]:
    """The adapter's block linears (fully qualified names, in order) for which
    ``filter_fn(module, fqn)`` is true; all of them when it is None."""
    return [
        name
        for name in adapter.linear_names()
        if filter_fn is None or filter_fn(model.get_submodule(name), name)
    ]


def _quantize_rtn(model: nn.Module, name: str, spec: WeightSpec | None) -> LayerChoice:
    linear = model.get_submodule(name)
    weight = linear.weight.detach()
    if spec is None:
        replace_module(model, name, _replacement(linear, weight, None, "float"))
        return LayerChoice(name, "float")
    packed = spec.rtn(weight.float())
    replace_module(model, name, _replacement(linear, packed.dequantize(), packed, spec.describe()))
    return LayerChoice(name, "rtn")


def _quantize_gptq(
    model, adapter, names, specs, calibration, settings: GPTQSettings, report, progress, device,
    offload_device, resume_dir, recipe, hooks: _DriverHooks, group=None,
) -> None:  # fmt: skip
    if calibration is None:
        raise LowbitError("GPTQ needs calibration data (calibration=[n_samples, seqlen] ids)")
    n_samples = calibration.shape[0]
    heldout = 0
    guard = settings.guard
    if guard:
        if n_samples < 2:
            raise LowbitError("the GPTQ guard needs at least 2 calibration samples (one held out)")
        heldout = min(n_samples - 1, max(1, round(n_samples * settings.heldout_fraction)))
    report.calibration_samples, report.heldout_samples = n_samples - heldout, heldout
    selected = set(names)
    store = None
    if resume_dir is not None:  # fingerprint the model before anything in it changes
        store = _open_checkpoints(
            resume_dir, model, adapter, calibration, specs, recipe, device,
            _resume_options(settings), hooks.inner.weights_digest(),
        )  # fmt: skip
    for name in names:  # calibrate with float activations
        module = model.get_submodule(name)
        if getattr(module, "act_quantizer", None) is not None:
            module.act_quantizer = None

    # the walk moves each block to the compute device and back; the packed containers it makes
    # are not module tensors, so they are put where their block lives (homes[index])
    homes = hooks.homes

    def calibrated_linears(index: int) -> dict[str, nn.Module]:
        return {
            n: m
            for n, m in block_linears(model, adapter, index).items()
            if n in selected and specs[n] is not None
        }

    def quantize_block(index: int, collector: HessianCollector | None) -> None:
        if collector is None:  # finished in an earlier run
            report.layers.extend(
                _restore_block(model, adapter, index, selected, specs, store, homes[index])
            )
            return
        finished: list[tuple[LayerChoice, Any]] = []
        linears = {n: m for n, m in block_linears(model, adapter, index).items() if n in selected}
        owners = {
            name: getattr(collector.accumulators[name], "owner", 0)
            for name in linears
            if specs[name] is not None
        }
        solved = {}  # name -> (choice, packed container, dequantized weight)
        for name in owners:
            if group is None or owners[name] == group.rank:
                solve = time.perf_counter()
                solved[name] = _solve(
                    linears[name], specs[name], collector.accumulators[name], settings, guard, name
                )
                report.solve_seconds += time.perf_counter() - solve
        if group is not None:
            solved = group.share(solved, owners)
        for name, module in linears.items():
            spec = specs[name]
            if spec is None:
                replace_module(model, name, _replacement(module, module.weight, None, "float"))
                report.layers.append(LayerChoice(name, "float"))
                finished.append((report.layers[-1], None))
                continue
            choice, packed, dequantized = solved[name]
            fmt = f"{spec.describe()}, {choice.algo}"
            packed = packed.to(homes[index])
            dequantized = dequantized.to(module.weight.device)
            replace_module(model, name, _replacement(module, dequantized, packed, fmt))
            report.layers.append(choice)
            finished.append((choice, packed))
        if store is not None:
            store.save(
                index,
                [dataclasses.asdict(choice) for choice, _ in finished],
                {choice.name: packed for choice, packed in finished if packed is not None},
            )

    calibrate_layer_by_layer(
        model,
        adapter,
        calibration,
        quantize_block,
        linears_of=calibrated_linears,
        heldout=heldout,
        sequential=settings.sequential,
        offload_device=offload_device,
        device=device,
        progress=progress,
        skip=None if store is None else store.done,
        hooks=hooks,
        group=group,
    )


def _solve(module, spec, accumulator, settings: GPTQSettings, guard: bool, name: str):
    """GPTQ on one linear (and the guard's comparison with RTN on the held-out samples):
    ``(choice, packed container, dequantized fp32 weight [out, in])``."""
    weight = module.weight.detach().float()  # [out, in]
    packed, dequantized, damp = spec.gptq(weight, accumulator.hessian("train"), settings)
    choice = LayerChoice(name, "gptq", damp=damp)
    rtn = spec.guard_candidate(weight) if guard else None
    if rtn is not None:
        rtn_weight = rtn.dequantize()
        choice.gptq_error = accumulator.output_error(weight - dequantized, "heldout")
        choice.rtn_error = accumulator.output_error(weight - rtn_weight, "heldout")
        if choice.rtn_error <= choice.gptq_error:
            choice.algo, packed, dequantized = "rtn", rtn, rtn_weight
    return choice, packed, dequantized


def _resume_options(settings: GPTQSettings) -> dict[str, Any]:
    """The GPTQ settings as a resume directory's fingerprint records them (the layout of the
    directories written before :class:`GPTQSettings` existed, so they still resume)."""
    return {
        "algo": "gptq",
        "guard": settings.guard,
        "heldout_fraction": settings.heldout_fraction,
        "sequential": settings.sequential,
        "gptq": {
            "block_size": settings.block_size,
            "act_order": settings.act_order,
            "damp": settings.damp,
            "static_groups": settings.static_groups,
        },
    }


def _open_checkpoints(
    resume_dir, model, adapter, calibration, specs, recipe, device, options, digest
) -> BlockCheckpoints:
    device = device if device is not None else next(adapter.blocks_module.parameters()).device
    fingerprint = run_fingerprint(
        model,
        calibration,
        layers={n: None if s is None else dataclasses.asdict(s) for n, s in specs.items()},
        options=options,
        recipe=recipe,
        device=device,
        weights_digest=digest,
    )
    store = BlockCheckpoints(resume_dir, fingerprint)
    restored = sum(store.done(index) for index in range(adapter.num_layers))
    if restored:  # say so: a resumed run is quicker and its progress bar starts part-way
        print(
            f"lowbit: resuming from {resume_dir}: {restored} of {adapter.num_layers} blocks "
            "were calibrated by an earlier run and are restored",
            file=sys.stderr,
        )
    return store


def _restore_block(model, adapter, index, selected, specs, store, home) -> list[LayerChoice]:
    """Put block ``index``'s checkpointed linears in place (packed containers on ``home``, the
    block's own device); returns their choices."""
    layers, quantized = store.load(index)
    linears = {n: m for n, m in block_linears(model, adapter, index).items() if n in selected}
    mismatch = LowbitError(
        f"block {index} of resume directory {store.directory} does not hold what this run "
        "quantizes; delete the directory or pass another --resume-dir"
    )
    if [layer["name"] for layer in layers] != list(linears):
        raise mismatch
    choices = []
    fields = [f.name for f in dataclasses.fields(LayerChoice)]
    for layer, (name, module) in zip(layers, linears.items(), strict=True):
        choice = LayerChoice(**{key: layer.get(key) for key in fields})
        spec, saved = specs[name], quantized.get(name)
        if (spec is None) != (choice.algo == "float") or (spec is None) != (saved is None):
            raise mismatch
        if spec is None:
            replace_module(model, name, _replacement(module, module.weight, None, "float"))
        else:
            if not spec.matches(saved):
                raise mismatch
            packed = saved.to(module.weight.device)  # the codes and statistics GPTQ returned
            fmt = f"{spec.describe()}, {choice.algo}"
            weight = packed.dequantize()  # [out, in] on the compute device
            replace_module(model, name, _replacement(module, weight, packed.to(home), fmt))
        choices.append(choice)
    return choices
