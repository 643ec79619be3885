"""Streamed evaluation: perplexity, KL and top-1 of a saved model against a float model that
does not fit in memory, computed layer-major.

Each model runs block by block over all windows at once ([N, S, hidden] hidden states), so only
one block's weights are in memory at a time:

* the float reference (a directory of safetensors) is a meta-device skeleton whose blocks are
  read when their turn comes and put back on the meta device after
  (:class:`~lowbit.io.stream.StreamedModel`); its final hidden states are kept (float32,
  ``N x S x hidden x 4`` bytes: 67 MB for 2 windows of 2048 tokens at width 4096);
* the quantized model (a lowbit checkpoint) is loaded memory-mapped (:func:`lowbit.io.checkpoint.
  load`); after each block has run, its kernel layouts are dropped and its file pages given back
  (:mod:`lowbit.mapped`), so its resident set is its embeddings, head and one block.

Then both heads (final norm, lm_head) run on the two sets of final hidden states a chunk of
tokens at a time: the [chunk, vocab] log-probabilities of both models are all that is ever held
of the distributions, never a window's logits.

Every block sees the inputs and keyword arguments the in-memory forward gives it (captured at
the first block as calibration does, :mod:`lowbit.calibrate.capture`), one window at a time, so
each model's final hidden states are those of ``lowbit eval`` in memory bit for bit; the head
runs on chunks of tokens instead of whole windows and the sums are taken in another order, so
the results agree with the in-memory ones to rounding (KL within 1e-4 relative in the tests).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from lowbit.calibrate.capture import BlockHooks, capture_first_block_inputs, run_block
from lowbit.errors import LowbitError
from lowbit.eval.evaluate import EvalResult, Totals
from lowbit.io.stream import BASE_BYTES, StreamedModel, _return_freed_memory, open_streamed
from lowbit.models.adapter import adapter_for
from lowbit.models.float_weights import FloatWeights

__all__ = ["EvalMemoryEstimate", "eval_memory_estimate", "evaluate_streamed", "check_streamable"]

#: tokens per chunk of the heads' log-probabilities
HEAD_CHUNK = 256


@dataclass
class EvalMemoryEstimate:
    """Bytes ``lowbit eval`` of a checkpoint against a float reference needs.

    Attributes:
        in_memory: both models whole (the float one in float32) and the reference's cached
            log-probabilities.
        streamed: one float block, the float head, the checkpoint's tensors outside its blocks
            and its largest block, the hidden states and the chunks' log-probabilities.
    """

    in_memory: int
    streamed: int


def _run_bytes(weights: FloatWeights, key: str, run: torch.dtype) -> int:
    """Bytes tensor ``key`` holds once loaded: a float tensor in ``run`` when that is
    narrower (an fp32 embedding run in bf16 is cast as it loads), any other as stored."""
    stored = weights.dtype(key)
    size = torch.empty(0, dtype=stored).itemsize
    if stored.is_floating_point:
        size = min(size, torch.empty(0, dtype=run).itemsize)
    return math.prod(weights.shape(key)) * size


def eval_memory_estimate(
    reference: str | os.PathLike, checkpoint: str | os.PathLike, windows: int, seqlen: int
) -> EvalMemoryEstimate:
    """The bytes each path needs, from the two directories' headers (nothing else is read)."""
    from lowbit.io.format import read_config

    streamed = open_streamed(reference, torch.float32)
    adapter = streamed.adapter
    prefixes = tuple(adapter.block_prefix(i) + "." for i in range(adapter.num_layers))
    float_block = max(streamed.weights.numel(p) for p in prefixes) * 4
    head = adapter.vocab_size * adapter.hidden_size * 4  # the float lm_head (or embedding)
    quantized = FloatWeights(checkpoint)
    run = getattr(torch, str(read_config(Path(checkpoint)).get("dtype", "bfloat16")), None)
    run = run if isinstance(run, torch.dtype) else torch.bfloat16
    blocks = dict.fromkeys(prefixes, 0)
    outside = 0
    for key in quantized.keys():
        size = _run_bytes(quantized, key, run)
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            outside += size
        else:
            blocks[prefix] += size
    hidden = 3 * windows * seqlen * adapter.hidden_size * 4  # inputs, outputs, the float result
    chunk = 6 * HEAD_CHUNK * adapter.vocab_size * 4  # logits and log-probs of both, the KL terms
    working = 4 * seqlen * (adapter.intermediate_size + adapter.num_heads * seqlen) * 4
    streamed_peak = (
        BASE_BYTES + outside + max(blocks.values()) + hidden
        + max(2 * float_block + working, head + chunk)
    )  # fmt: skip
    tokens = windows * (seqlen - 1)
    cached = min(tokens * adapter.vocab_size * 4, 4 << 30)  # FloatReference's cache
    logits = 3 * seqlen * adapter.vocab_size * 4
    in_memory = (
        BASE_BYTES + streamed.weights.numel() * 4 + int(1.2 * (outside + sum(blocks.values())))
        + cached + logits + working
    )  # fmt: skip
    return EvalMemoryEstimate(int(in_memory), int(streamed_peak))


def check_streamable(checkpoint: str | os.PathLike) -> None:
    """Refuse, in one sentence, a checkpoint whose evaluation cannot be streamed."""
    from lowbit.io.format import read_config

    qconfig = read_config(Path(checkpoint)).get("quantization_config") or {}
    if qconfig.get("kv"):
        raise LowbitError(
            "streamed evaluation runs each block over whole windows without a KV cache, so a "
            "model with a quantized KV cache is evaluated in memory (--no-stream)"
        )


class _FloatBlocks(BlockHooks):
    """The float reference's blocks read when their turn comes, put back on meta after."""

    def __init__(self, streamed: StreamedModel):
        self.streamed = streamed

    def capture_begin(self, device: torch.device) -> None:
        self.streamed.capture_begin(device)

    def capture_end(self) -> None:
        self.streamed.capture_end()
        _return_freed_memory()

    def load(self, index: int) -> None:
        self.streamed.load(index)

    def finish(self, index: int) -> None:
        self.streamed.blocks[index].to("meta")
        _return_freed_memory()


class _MappedBlocks(BlockHooks):
    """A memory-mapped checkpoint's blocks: after each has run, its kernel layouts are dropped
    and its file pages given back (read again from the file if ever needed)."""

    def __init__(self, model: nn.Module):
        self.adapter = adapter_for(model)

    def capture_end(self) -> None:
        from lowbit.mapped import release_pages

        release_pages([self.adapter.embed_tokens.weight])  # a tied head reads them again

    def finish(self, index: int) -> None:
        from lowbit.kernels.dispatch import forget_prepared
        from lowbit.mapped import release_pages
        from lowbit.nn.packed_linear import PackedLinearBase

        block = self.adapter.blocks_module[index]
        for module in block.modules():
            if isinstance(module, PackedLinearBase):
                forget_prepared(module)
        release_pages([*block.parameters(), *block.buffers()])
        _return_freed_memory()


def final_hidden_states(
    model: nn.Module, ids: Tensor, hooks: BlockHooks, *, progress: bool = True, desc: str = ""
) -> Tensor:
    """Run ``model``'s blocks layer-major over all windows: [N, S] ids -> [N, S, hidden] hidden
    states after the last block (before the final norm), in the blocks' dtype, on the CPU.

    ``hooks`` make block ``i`` available (``load``) and release it (``finish``), and make the
    embeddings usable for the capture of the first block's inputs."""
    cpu = torch.device("cpu")
    adapter = adapter_for(model)
    hooks.capture_begin(cpu)
    try:
        inputs = capture_first_block_inputs(model, adapter, ids, device=cpu)  # [N, S, hidden]
    finally:
        hooks.capture_end()
    # the capture's buffer takes the dtype of the block's first parameter (a float32 bias of a
    # bf16 model, say); the blocks run on what the embeddings gave, cast back losslessly
    inputs.hidden = inputs.hidden.to(adapter.embed_tokens.weight.dtype)
    out = torch.empty_like(inputs.hidden)  # [N, S, hidden]
    blocks = adapter.blocks_module
    for index in tqdm(range(len(blocks)), desc=desc, disable=not progress, leave=False):
        hooks.load(index)
        run_block(blocks[index], inputs, device=cpu, out=out)
        hooks.finish(index)
        inputs.hidden, out = out, inputs.hidden
    return inputs.hidden


def _load_module(streamed: StreamedModel, module: nn.Module) -> None:
    """Read ``module``'s tensors (a part of the float skeleton outside the blocks) from files."""
    prefix = next(name for name, m in streamed.model.named_modules() if m is module)
    state = {
        key: streamed.weights.get(streamed.source_key(f"{prefix}.{key}"), dtype=streamed.dtype)
        for key in module.state_dict()
    }
    module.load_state_dict(state, assign=True, strict=True)


def _head_logprobs(model: nn.Module, hidden: Tensor) -> Tensor:
    """Next-token log-probabilities from final hidden states: [C, hidden] -> [C, V] float32, the
    final norm and lm_head as the model's forward applies them."""
    adapter = adapter_for(model)
    logits = adapter.lm_head(adapter.final_norm(hidden[None]))[0].float()  # [C, V]
    return F.log_softmax(logits, dim=-1)


def evaluate_streamed(
    checkpoint: str | os.PathLike,
    reference: str | os.PathLike,
    ids: Tensor,
    *,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    chunk: int = HEAD_CHUNK,
    progress: bool = True,
) -> tuple[EvalResult, nn.Module]:
    """Perplexity of the lowbit ``checkpoint`` and its KL and top-1 against the float
    ``reference`` on ``ids``, layer-major: neither model is ever whole in memory.

    Args:
        checkpoint: a directory saved by lowbit (any number of shards).
        reference: the float model's directory of safetensors (run in float32, as in memory).
        ids: [N, S] token ids.
        dtype: the dtype the checkpoint runs in (None: the one it records).
        backend: how its packed linears multiply.
        chunk: tokens per chunk of the heads' log-probabilities.
        progress: show progress bars.

    Returns:
        The :class:`~lowbit.eval.evaluate.EvalResult` and the checkpoint's model as loaded
        (memory-mapped), for its memory report.
    """
    from lowbit.io.checkpoint import load
    from lowbit.nn.packed_linear import set_backend

    if chunk < 1:
        raise LowbitError(f"the heads' chunk must be at least 1 token, not {chunk}")
    check_streamable(checkpoint)
    start = time.perf_counter()
    streamed = open_streamed(reference, torch.float32)  # headers only
    with torch.no_grad():
        reference_hidden = final_hidden_states(
            streamed.model, ids, _FloatBlocks(streamed), progress=progress, desc="reference"
        )  # [N, S, hidden] float32
        model = load(checkpoint, dtype=dtype)  # memory-mapped
        if model.config.vocab_size != streamed.model.config.vocab_size:
            raise LowbitError(
                f"the reference {reference} has a vocabulary of "
                f"{streamed.model.config.vocab_size} tokens and {checkpoint} one of "
                f"{model.config.vocab_size}: they are not the same model"
            )
        set_backend(model, backend)  # loaded packed: as lowbit.eval.run.use_backend does
        hidden = final_hidden_states(
            model, ids, _MappedBlocks(model), progress=progress, desc="quantized"
        )  # [N, S, hidden]
        float_adapter = streamed.adapter
        _load_module(streamed, float_adapter.final_norm)
        _load_module(streamed, float_adapter.lm_head)
        totals = Totals()
        for window in range(ids.shape[0]):
            for begin in range(0, ids.shape[1] - 1, chunk):
                end = min(begin + chunk, ids.shape[1] - 1)
                ref = _head_logprobs(streamed.model, reference_hidden[window, begin:end])
                logprobs = _head_logprobs(model, hidden[window, begin:end])  # [C, V]
                targets = ids[window, begin + 1 : end + 1]  # [C]
                totals.add(logprobs, targets, ref)
    return totals.result(ids, start, with_reference=True), model
