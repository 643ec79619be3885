"""Layer-by-layer calibration: capture the first block's inputs, then walk the blocks.

For each decoder block in turn: collect the input Hessians of its linears over the calibration
samples (hooks), let a callback quantize the block (it replaces linears in place), then run the
block again, now quantized, to produce the next block's inputs (the sequential choice: later
blocks calibrate on what the quantized earlier blocks really produce).

Only one block and the captured activations are on the compute device at a time: the hidden
states of all samples live on ``offload_device`` (CPU by default) and move one sample at a
time; the block moves to ``device`` while it is calibrated and back afterwards. Nothing here
knows layer names; the adapter says where the blocks and their linears are.

All samples have the same length and no padding, so the keyword arguments the blocks take
(position embeddings, causal mask, position ids) are the same for every sample and are kept
once, from the first sample.

Where the blocks' weights come from is a :class:`BlockHooks`' business: the default does nothing
(the model is in memory); the streamed quantizer's (:mod:`lowbit.io.stream`) reads each block
when its turn comes and writes and releases it when it is done, so the in-memory and the
streamed paths take the same walk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from lowbit.calibrate.hessian import AllInputsSeen, HessianAccumulator, HessianCollector
from lowbit.errors import LowbitError

__all__ = [
    "BlockHooks",
    "BlockInputs",
    "capture_first_block_inputs",
    "run_block",
    "block_linears",
    "calibrate_layer_by_layer",
]


@dataclass
class BlockInputs:
    """What a decoder block is called with, for every calibration sample.

    Attributes:
        hidden: [N, S, hidden] hidden states, on the offload device.
        kwargs: the other keyword arguments of a block call (shared by all samples), on the
            compute device.
    """

    hidden: Tensor
    kwargs: dict[str, Any]


class BlockHooks:
    """What the walk calls around the model's parts; every hook does nothing by default (the
    model is in memory). Blocks are visited in order, each exactly once: ``load(i)`` before
    block ``i`` is used, ``finish(i)`` once it is processed and has run forward for the last
    time (then nothing touches it again)."""

    def capture_begin(self, device: torch.device) -> None:
        """Before the first block's inputs are captured: what runs before block 0 (embeddings,
        rotary) must be usable on ``device``."""

    def capture_end(self) -> None:
        """After the capture: those parts are needed no more."""

    def load(self, index: int) -> None:
        """Make block ``index``'s weights available."""

    def finish(self, index: int) -> None:
        """Block ``index`` is done."""

    def weights_digest(self) -> str | None:
        """A digest of the float weights for a resume directory's fingerprint, when the model is
        not in memory to be hashed (None: it is)."""
        return None


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass at the first block."""


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def _move_outside_blocks(model: nn.Module, blocks: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer that is not inside ``blocks`` to ``device``."""
    inside = set(blocks.modules())
    for module in model.modules():
        if module in inside:
            continue
        for param in module.parameters(recurse=False):
            param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


def _model_device(blocks: nn.Module) -> torch.device:
    return next(blocks.parameters()).device


def capture_first_block_inputs(
    model: nn.Module,
    adapter,
    tokens: Tensor,
    *,
    offload_device: torch.device | str = "cpu",
    device: torch.device | str | None = None,
) -> BlockInputs:
    """Run the model up to its first block for every sample and keep that block's inputs.

    Args:
        model: the causal LM; its non-block parts (embeddings, rotary) run on ``device``.
        adapter: the model's adapter.
        tokens: [N, S] token ids.
        offload_device: where the [N, S, hidden] hidden states are kept.
        device: compute device (default: where the first block's parameters are).

    Returns:
        :class:`BlockInputs`.
    """
    if tokens.ndim != 2 or tokens.dtype != torch.long or tokens.shape[0] == 0:
        raise LowbitError("calibration tokens must be a non-empty [n_samples, seqlen] long tensor")
    blocks = adapter.blocks_module
    home = adapter.embed_tokens.weight.device  # where what runs before block 0 lives
    device = torch.device(device) if device is not None else home
    offload_device = torch.device(offload_device)
    dtype = next(blocks[0].parameters()).dtype
    hidden = torch.empty(
        tokens.shape[0], tokens.shape[1], adapter.hidden_size, device=offload_device, dtype=dtype
    )  # [N, S, hidden]
    kwargs: dict[str, Any] = {}
    index = 0

    def catch(_module, args, block_kwargs):
        x = args[0] if args else block_kwargs["hidden_states"]
        hidden[index] = x[0].to(offload_device, hidden.dtype)
        if not kwargs:
            kept = {k: v for k, v in block_kwargs.items() if k != "hidden_states"}
            # no KV cache, under this transformers' name for it (5.24: cache, earlier:
            # past_key_values); adding the other name would warn
            kept.update({k: None for k in ("cache", "past_key_values") if k in kept})
            kept["use_cache"] = False
            kwargs.update(_to(kept, device))
        raise _Captured

    if device != home:
        _move_outside_blocks(model, blocks, device)
    handle = blocks[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for index in range(tokens.shape[0]):
                try:
                    model(input_ids=tokens[index : index + 1].to(device), use_cache=False)
                except _Captured:
                    continue
                raise LowbitError("the model never called its first block")
    finally:
        handle.remove()
        if device != home:
            _move_outside_blocks(model, blocks, home)
    return BlockInputs(hidden, kwargs)


def run_block(
    block: nn.Module,
    inputs: BlockInputs,
    *,
    device: torch.device | str,
    samples: range | None = None,
    out: Tensor | None = None,
    before_sample: Callable[[int], None] | None = None,
) -> Tensor | None:
    """Call ``block`` on every sample, one at a time.

    Args:
        block: a decoder block (already on ``device``).
        inputs: the block's inputs.
        device: compute device.
        samples: which samples (default: all).
        out: [N, S, hidden] buffer on the offload device for the outputs, or None to discard.
        before_sample: called with the sample index before each call (e.g. to route Hessians).

    A call cut short by :class:`~lowbit.calibrate.hessian.AllInputsSeen` (a collector that has
    all it needs) moves on to the next sample; it must not happen when ``out`` is wanted.

    Returns:
        ``out``.
    """
    samples = range(inputs.hidden.shape[0]) if samples is None else samples
    with torch.no_grad():
        for i in samples:
            if before_sample is not None:
                before_sample(i)
            x = inputs.hidden[i : i + 1].to(device)  # [1, S, hidden]
            try:
                y = block(x, **inputs.kwargs)
            except AllInputsSeen:
                if out is not None:
                    raise
                continue
            if isinstance(y, tuple):  # older transformers return (hidden, ...)
                y = y[0]
            if out is not None:
                out[i : i + 1] = y.to(out.device)
    return out


def block_linears(model: nn.Module, adapter, index: int) -> dict[str, nn.Module]:
    """``{fully qualified name: module}`` of the linears of block ``index``, in order."""
    prefix = adapter.block_prefix(index) + "."
    return {n: model.get_submodule(n) for n in adapter.linear_names() if n.startswith(prefix)}


def calibrate_layer_by_layer(
    model: nn.Module,
    adapter,
    tokens: Tensor,
    process_block: Callable[[int, HessianCollector | None], None],
    *,
    linears_of: Callable[[int], dict[str, nn.Module]] | None = None,
    heldout: int = 0,
    offload_device: torch.device | str = "cpu",
    device: torch.device | str | None = None,
    sequential: bool = True,
    propagate_last: bool = False,
    progress: bool = True,
    skip: Callable[[int], bool] | None = None,
    hooks: BlockHooks | None = None,
    group=None,
) -> BlockInputs | None:
    """Walk the blocks: collect Hessians, call ``process_block``, propagate.

    Args:
        model, adapter: the model and its adapter.
        tokens: [N, S] calibration token ids.
        process_block: ``process_block(index, collector)``; reads ``collector.accumulators``
            (``.hessian("train")``, and ``.hessian("heldout")`` when ``heldout > 0``) and may
            replace the linears of block ``index`` (through the model, by name). For a skipped
            block it gets ``collector=None`` at the same point of the walk.
        linears_of: ``linears_of(index) -> {fqn: module}``: whose Hessians to collect (default:
            every linear of the block). Blocks with none are only propagated.
        heldout: the last ``heldout`` samples go to the "heldout" split, the rest to "train".
        offload_device: where the captured hidden states live.
        device: compute device (default: where the blocks' parameters are).
        sequential: propagate each block's outputs after ``process_block`` (a second pass, on
            the quantized block); False keeps the outputs of the Hessian pass (the float
            block), which halves the block passes.
        propagate_last: also run the last block, and return its outputs (else return None;
            blocks after the last one with linears to calibrate are then not run at all).
        progress: show a progress bar.
        skip: ``skip(index)`` -> True when block ``index`` (one with linears to calibrate) needs
            no Hessians, e.g. its result is restored from a checkpoint: ``process_block(index,
            None)`` puts it in place, and the block propagates as a calibrated one would
            (sequential: its processed outputs; else its float outputs, computed before
            ``process_block``). Skipped blocks after the last calibrated one are processed
            without running any block.
        hooks: where block weights come from and go (:class:`BlockHooks`; default: in memory).
            Every block gets ``load`` and ``finish``, also those the walk does not run.
        group: a :class:`~lowbit.calibrate.distributed.Group` sharing the samples and the
            Hessians between processes (the collector's accumulators are then
            :class:`~lowbit.calibrate.distributed.GatheredAccumulator`, each held by its owner
            rank); None: one process. Not with ``skip`` or ``propagate_last``.

    Returns:
        the last block's outputs as :class:`BlockInputs` if ``propagate_last``, else None.
    """
    n_samples = tokens.shape[0]
    if not 0 <= heldout < n_samples:
        raise LowbitError(
            f"{heldout} held-out samples leave no calibration sample for the Hessians "
            f"(there are {n_samples})"
        )
    if group is not None:
        group.check_samples(n_samples)
        if skip is not None or propagate_last:
            raise LowbitError("distributed calibration cannot resume or return the last outputs")
    own = range(n_samples) if group is None else group.own_samples(n_samples)
    blocks = adapter.blocks_module
    hooks = hooks or BlockHooks()
    linears_of = linears_of or (lambda i: block_linears(model, adapter, i))
    device = torch.device(device) if device is not None else _model_device(blocks)
    hooks.capture_begin(device)
    inputs = capture_first_block_inputs(
        model, adapter, tokens, offload_device=offload_device, device=device
    )
    hooks.capture_end()
    spare = torch.empty_like(inputs.hidden)
    first_heldout = n_samples - heldout
    wanted = {index: linears_of(index) for index in range(adapter.num_layers)}
    skipped = {index for index, linears in wanted.items() if linears and skip and skip(index)}
    calibrated = [index for index, linears in wanted.items() if linears and index not in skipped]
    stop = adapter.num_layers if propagate_last else (calibrated[-1] if calibrated else -1)
    for index in tqdm(range(adapter.num_layers), desc="calibrate", disable=not progress):
        # taken out of ``wanted``: the modules a callback replaces (GPTQ's float linears, with
        # their weights) must not outlive their block's turn
        linears = wanted.pop(index)
        hooks.load(index)
        if index > stop:  # nothing after this block needs its inputs
            if index in skipped:
                process_block(index, None)
            hooks.finish(index)
            continue
        block = blocks[index]
        home = next(block.parameters()).device
        block.to(device)
        try:
            if index in skipped:
                if not sequential and index < stop:  # the float block's outputs propagate
                    run_block(block, inputs, device=device, out=spare)
                process_block(index, None)
            elif linears:
                factory = HessianAccumulator if group is None else group.accumulator_factory()
                with HessianCollector(
                    linears, device, stop_when_complete=sequential,
                    accumulator_factory=factory,
                ) as collector:  # fmt: skip

                    def route(i: int, collector=collector) -> None:
                        collector.new_sample()
                        collector.split = "heldout" if i >= first_heldout else "train"

                    float_out = None if sequential else spare
                    if group is None:
                        run_block(block, inputs, device=device, before_sample=route, out=float_out)
                    else:
                        _hessian_steps(
                            block, inputs, device, route, float_out, group, first_heldout
                        )
                process_block(index, collector)
                del collector, route  # the block's Hessians, gone before the next block loads
            if index < stop and (sequential or not linears):
                run_block(blocks[index], inputs, device=device, samples=own, out=spare)
            if index < stop:
                inputs.hidden, spare = spare, inputs.hidden
        finally:
            blocks[index].to(home)
        del linears
        hooks.finish(index)
    return inputs if propagate_last else None


def _hessian_steps(block, inputs, device, route, out, group, first_heldout: int) -> None:
    """The Hessian pass of a distributed walk: in step ``t`` rank ``r`` runs sample
    ``t·W + r`` (a rank past the last sample runs its own last one, whose inputs are not added),
    so every rank calls the collector's gathers the same number of times."""
    n_samples = inputs.hidden.shape[0]
    world = group.world_size
    last_own = group.own_samples(n_samples)[-1]
    for step in range(-(-n_samples // world)):
        first = step * world
        group.splits = [
            None if i >= n_samples else "heldout" if i >= first_heldout else "train"
            for i in range(first, first + world)
        ]
        i = first + group.rank
        real = i < n_samples
        sample = i if real else last_own
        run_block(
            block, inputs, device=device, samples=range(sample, sample + 1),
            before_sample=route, out=out if real else None,
        )  # fmt: skip
