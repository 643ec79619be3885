"""Streamed quantization: a model quantized block by block, never whole in memory.

The model's skeleton is built on the meta device from its config; its tensors stay in the
directory's safetensors files (:class:`~lowbit.models.float_weights.FloatWeights`, memory-mapped).
A weight recipe walks the blocks as it does in memory (:func:`lowbit.algorithms.weights.
quantize_linears`), through :class:`StreamedModel`, the walk's
:class:`~lowbit.calibrate.capture.BlockHooks`:

* ``capture_begin``: the embeddings are read (in the calibration dtype, on the compute device)
  and the rotary embedding is rebuilt there, so the first block's inputs are captured as in
  memory; ``capture_end`` puts them back on the meta device.
* ``load(i)``: block ``i``'s tensors are read by key, in the calibration dtype, on the CPU.
* ``finish(i)``: the block, quantized, is packed; its modules' specs are kept for the config and
  its checkpoint tensors go to the writer (:meth:`StreamedModel.add`); then it goes back to the
  meta device.

What is carried from block to block is the calibration activations, as in memory. The tensors
outside the blocks (embeddings, final norm, untied lm_head) are read and written one at a time at
the end. Everything the blocks run is what the in-memory path runs, in the same order and
dtype, so the packed tensors are the same bit for bit.

Memory: :func:`memory_estimate` says, from the files' headers alone, how many bytes the in-memory
path and the streamed path need; :func:`available_memory` what the machine has.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from lowbit.calibrate.capture import BlockHooks, block_linears
from lowbit.errors import LowbitError
from lowbit.io.checkpoint import checkpoint_tensors, module_specs, stored_form
from lowbit.models.adapter import adapter_for
from lowbit.models.float_weights import FloatWeights
from lowbit.nn.packed_linear import PackedLinearBase, pack_model

__all__ = [
    "StreamedModel",
    "MemoryEstimate",
    "memory_estimate",
    "available_memory",
    "open_streamed",
    "IN_MEMORY_BYTES_PER_PARAM",
]

#: peak bytes per parameter of the in-memory path (float32 calibration): the issue's 1B Llama
#: measured 11.4 GB for 1.03e9 parameters, the float32 model plus its quantized copies
IN_MEMORY_BYTES_PER_PARAM = 11.0
#: bytes torch, transformers and lowbit take before any tensor (measured: about 0.7 GB)
BASE_BYTES = 800 * 2**20


@dataclass
class MemoryEstimate:
    """Bytes a quantization run needs, from the weight files' headers.

    Attributes:
        parameters: the model's parameters.
        in_memory: the in-memory path's peak.
        streamed: the streamed path's peak (one block, the embeddings while capturing, the
            calibration activations, the largest Hessian).
    """

    parameters: int
    in_memory: int
    streamed: int


def available_memory() -> int:
    """Bytes this machine can give without swapping (``MemAvailable``; else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_estimate(
    weights: FloatWeights,
    adapter,
    *,
    dtype: torch.dtype = torch.float32,
    tokens: tuple[int, int] = (0, 0),
    gptq: bool = False,
) -> MemoryEstimate:
    """The bytes each path needs (see :class:`MemoryEstimate`).

    Args:
        weights: the model's weight files.
        adapter: the skeleton's adapter (block names and widths).
        dtype: the calibration dtype.
        tokens: ``(samples, seqlen)`` of the calibration.
        gptq: the weights are solved by GPTQ, whose float64 factorisation of the widest
            Hessian holds one [K, K] float64 matrix
            (:func:`lowbit.algorithms.gptq.inverse_hessian_factor`): 1.6 GB at K = 14336.
    """
    size = torch.empty(0, dtype=dtype).element_size()
    params = weights.numel()
    block = max(weights.numel(adapter.block_prefix(i) + ".") for i in range(adapter.num_layers))
    embed = adapter.vocab_size * adapter.hidden_size
    widths = max(adapter.hidden_size, adapter.intermediate_size)
    samples, seqlen = tokens
    activations = 2 * samples * seqlen * adapter.hidden_size * size  # inputs and outputs
    # one sample through a block: its MLP's intermediate tensors and the attention scores
    working = 4 * seqlen * (widths + adapter.num_heads * seqlen) * 4
    hessians = 3 * widths * widths * 4  # the shared q/k/v and gate/up sums, down_proj's
    if gptq:
        hessians += widths * widths * 8
    streamed = BASE_BYTES + 3 * block * size + embed * size + activations + working + hessians
    in_memory = int(IN_MEMORY_BYTES_PER_PARAM * params * size / 4)
    return MemoryEstimate(params, in_memory, int(streamed))


def skeleton_from_directory(directory: Path, dtype: torch.dtype) -> nn.Module:
    """The model ``directory``'s config describes, on the meta device, in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(directory)
    except Exception as err:  # a field of the wrong type, a value transformers rejects
        raise LowbitError(
            f"the config.json of {directory} is not one transformers can use: {err}"
        ) from err
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.name_or_path = str(directory)
    return model.eval()


@dataclass
class StreamedModel(BlockHooks):
    """A meta-device skeleton whose blocks are read from ``weights`` and written through ``add``.

    Attributes:
        model: the skeleton (after the walk: each block's lowbit modules, on the meta device).
        weights: its weight files.
        dtype: the calibration dtype every float tensor is read in.
        add: ``add({key: tensor})``: takes each block's checkpoint tensors, then the rest's.
        run: the dtype the saved model runs in; float parameters are written in their
            :func:`~lowbit.io.checkpoint.stored_form` for it, as in memory.
        specs: ``{fqn: spec}`` of the lowbit modules written so far.
        shapes: ``{key: shape}`` of the tensors written so far.
        weight_bits, weight_numel: storage bits and elements of the quantized block linears
            written (``bits_per_weight`` = their ratio).
        seconds: time per stage: ``load`` (reading), ``forward`` (capture, forward passes,
            Hessians), ``solve`` (RTN or GPTQ; set by :func:`quantize_blocks`), ``pack``,
            ``write`` (handing tensors to the writer, which writes a shard when one is full).
    """

    model: nn.Module
    weights: FloatWeights
    dtype: torch.dtype
    add: Callable[[dict[str, Tensor]], None] | None = None
    run: torch.dtype | None = None
    specs: dict[str, dict] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    weight_bits: int = 0
    weight_numel: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.adapter = adapter_for(self.model)
        self.blocks = self.adapter.blocks_module
        prefixes = tuple(self.adapter.block_prefix(i) + "." for i in range(self.adapter.num_layers))
        aliases: dict[int, list[str]] = {}  # tensor -> its keys (tied tensors have several)
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            aliases.setdefault(id(tensor), []).append(key)
        self._aliases = {key: keys for keys in aliases.values() for key in keys}
        # the keys outside the blocks, a tied tensor under its first key (as in memory)
        self.outside = [keys[0] for keys in aliases.values() if not keys[0].startswith(prefixes)]
        self._check_files()
        self._clock = time.perf_counter()

    def source_key(self, key: str) -> str:
        """The key the files hold ``key``'s tensor under (a tied tensor: any of its keys)."""
        for alias in self._aliases.get(key, [key]):
            if alias in self.weights:
                return alias
        raise LowbitError(
            f"the weights in {self.weights.directory} lack the tensor {key!r} of its config's model"
        )

    def _check_files(self) -> None:
        """The files must hold every tensor of the skeleton (a tied one under any of its keys)
        with its shape, and nothing else."""
        where = f"the weights in {self.weights.directory}"
        for key, tensor in self.model.state_dict().items():
            stored = self.source_key(key)
            if self.weights.shape(stored) != tuple(tensor.shape):
                raise LowbitError(
                    f"{where}: tensor {stored!r} has shape {list(self.weights.shape(stored))}, "
                    f"its config's model {list(tensor.shape)}"
                )
        extra = sorted(set(self.weights.keys()) - set(self._aliases))
        if extra:
            raise LowbitError(
                f"{where} hold {extra[0]!r}, which its config's model has no place for"
            )

    def _tick(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._clock
        self._clock = now

    # -- the walk's hooks -------------------------------------------------------------------------
    def capture_begin(self, device: torch.device) -> None:
        self._tick("forward")
        embed = self.adapter.embed_tokens
        key = self.source_key(_key_of(self.model, embed.weight))
        embed.weight = nn.Parameter(self.weights.get(key, dtype=self.dtype, device=device), False)
        rotary = self.adapter.decoder.rotary_emb
        with torch.device(device):
            self.adapter.decoder.rotary_emb = type(rotary)(config=self.model.config)
        self._rotary_meta = rotary
        self._tick("load")

    def capture_end(self) -> None:
        self.adapter.embed_tokens.to("meta")
        self.adapter.decoder.rotary_emb = self._rotary_meta

    def weights_digest(self) -> str:
        """SHA-256 over the weight files' names and SHA-256 sums (read once, in order)."""
        import hashlib

        from lowbit.checksum import file_sha256

        digest = hashlib.sha256()
        for path in self.weights.files():
            digest.update(f"{path.name}:{file_sha256(path)};".encode())
        return digest.hexdigest()

    def load(self, index: int) -> None:
        self._tick("forward")
        block = self.blocks[index]
        prefix = self.adapter.block_prefix(index) + "."
        state = {
            key: self.weights.get(self.source_key(prefix + key), dtype=self.dtype)
            for key in block.state_dict()
        }  # each [out, in] / [width], float, CPU
        block.load_state_dict(state, assign=True, strict=True)
        for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
            if tensor.device.type == "meta":  # a buffer no file holds, never computed
                raise LowbitError(f"lowbit cannot stream {prefix}{name}: no file holds it")
        self._tick("load")

    def finish(self, index: int) -> None:
        self._tick("forward")
        block = self.blocks[index]
        prefix = self.adapter.block_prefix(index)
        pack_model(block)
        for module in block_linears(self.model, self.adapter, index).values():
            if isinstance(module, PackedLinearBase):  # bits per weight as lowbit.eval.memory
                self.weight_bits += module.storage_bits() - _bias_bits(module)
                self.weight_numel += module.weight_numel
            else:  # kept in float
                self.weight_bits += module.weight.numel() * module.weight.element_size() * 8
                self.weight_numel += module.weight.numel()
        self.specs.update(module_specs(block, prefix))
        tensors = checkpoint_tensors(block, prefix, self.run)
        self._tick("pack")
        self._write(tensors)
        block.to("meta")
        _return_freed_memory()

    # -- writing ----------------------------------------------------------------------------------
    def _write(self, tensors: dict[str, Tensor]) -> None:
        if self.add is None:
            raise LowbitError("a streamed model needs a writer before its blocks are done")
        self.shapes.update({k: tuple(t.shape) for k, t in tensors.items()})
        self.add(tensors)
        self._tick("write")

    def write_outside(self) -> None:
        """Write the tensors outside the blocks, one at a time, as the in-memory path stores
        them: read in the calibration dtype, in their stored form for the run dtype. One stored
        in the run dtype is read as it is (the same numbers, without a float32 copy)."""
        self._tick("forward")
        for key in self.outside:
            source = self.source_key(key)
            as_stored = self.weights.dtype(source) == self.run and self.dtype == torch.float32
            tensor = self.weights.get(source, dtype=None if as_stored else self.dtype)
            self._tick("load")
            self._write({key: stored_form(tensor, self.run)})
            del tensor


def _return_freed_memory() -> None:
    """Give the memory freed with a block back to the system (glibc keeps freed chunks below
    its mmap threshold, up to 32 MB each, in its heap: the resident set would creep up from
    block to block). Elsewhere a no-op."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _bias_bits(module: nn.Module) -> int:
    bias = getattr(module, "bias", None)
    return 0 if bias is None else bias.numel() * bias.element_size() * 8


def _key_of(model: nn.Module, tensor: Tensor) -> str:
    """The state-dict key of ``tensor`` in ``model`` (the first, for a tied one)."""
    for key, value in model.state_dict(keep_vars=True).items():
        if value is tensor:
            return key
    raise LowbitError("the embeddings are not a tensor of the model")  # pragma: no cover


def open_streamed(directory: str | os.PathLike, dtype: torch.dtype) -> StreamedModel:
    """The model in ``directory`` as a :class:`StreamedModel` (nothing read but headers)."""
    from lowbit.models.loader import check_model_directory

    path = Path(directory).expanduser()
    if not path.is_dir():
        raise LowbitError(f"streamed quantization reads a model directory; {path} is not one")
    check_model_directory(path)
    weights = FloatWeights(path)
    return StreamedModel(skeleton_from_directory(path, dtype), weights, dtype)


def quantize_blocks(
    streamed: StreamedModel, recipe, context, add, run: torch.dtype | None = None
) -> None:
    """Apply ``recipe`` (one that :attr:`~lowbit.recipes.base.Recipe.streams`) to the streamed
    model with ``context``, handing every checkpoint tensor to ``add`` as it is ready: each
    block's when it is done, then those outside the blocks; ``run``: the dtype the saved model
    runs in (see :attr:`StreamedModel.run`)."""
    import dataclasses

    if not recipe.streams:
        raise LowbitError(f"recipe {recipe.method!r} cannot quantize block by block")
    streamed.add, streamed.run = add, run
    device = context.device if context.device is not None else torch.device("cpu")
    context = dataclasses.replace(context, blocks=streamed, device=device)
    streamed._tick("forward")
    with torch.no_grad():
        recipe.apply(streamed.model, context)
    streamed.write_outside()
    report = getattr(streamed.model, "lowbit_weight_report", None)
    if report is not None:  # the weight algorithm's share of the blocks' time
        streamed.seconds["solve"] = report.solve_seconds
        streamed.seconds["forward"] -= report.solve_seconds
    streamed.model.lowbit_recipe = recipe
