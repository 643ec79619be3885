"""Export a model quantized onto llama.cpp's block grids as a GGUF file llama.cpp loads.

Every block linear the ``gguf`` recipe quantized holds a
:class:`~lowbit.formats.gguf_blocks.GGUFQuantized` weight: its blocks are written as they are
(raw tensors, ``gguf.GGUFWriter``), so the file holds exactly the weights lowbit evaluated. What
lowbit leaves in float is written as llama.cpp's own quantizer types it in a file of the
recipe's file type (:mod:`lowbit.formats.gguf_mix`): the output matrix (the embedding when tied:
Q6_K, or Q8_0 on rows 256 does not divide), an untied embedding, both rounded by lowbit's RTN; a
linear whose rows no block divides in F16; norms and biases in F32. Llama and Mistral take
llama.cpp's ``llama`` architecture (q and k rows permuted into its RoPE pairing, which moves
whole rows and so keeps every block), Qwen2 and Qwen3 their own.

The tokenizer comes from the GGUF file the model was read from (every ``tokenizer.*`` field,
pre-tokenizer and chat template included), or from a Hugging Face byte-level BPE tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lowbit.algorithms.gguf_spec import GGUFWeightSpec
from lowbit.atomic import atomic_file, check_target
from lowbit.errors import LowbitError
from lowbit.formats.gguf_blocks import GGUFQuantized
from lowbit.formats.gguf_mix import FILE_TYPES, file_type, tensor_type
from lowbit.mapped import release_pages
from lowbit.models.adapter import adapter_for
from lowbit.recipes.gguf import GGUF_LINEAR_NAMES

__all__ = ["GGUFTensor", "export_gguf", "check_gguf_recipe", "gguf_tensors", "gguf_settings_of"]

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def check_gguf_recipe(recipe: dict) -> None:
    """Refuse, before any model loads, a recipe that has no GGUF form (one sentence)."""
    parts = recipe.get("parts") if recipe.get("method") == "compose" else [recipe]
    methods = [part.get("method") for part in parts]
    for part in parts:
        method = part.get("method")
        if method == "gguf":
            continue
        rotation = method in ("rotate", "learn-rotate")
        if rotation and (part.get("settings") or {}).get("online") is False:
            continue
        if rotation:
            raise LowbitError(
                f"{method} adds online Hadamards that a GGUF file cannot hold; use {method} "
                "with --set online=false (the residual rotation alone) in front of gguf"
            )
        raise LowbitError(
            f"recipe {'+'.join(methods)} has no GGUF form: {method} is not one of llama.cpp's "
            "block grids; quantize with the gguf recipe (optionally rotate+gguf with "
            "online=false)"
        )
    if "gguf" not in methods:
        raise LowbitError(
            f"recipe {'+'.join(methods)} leaves the block linears in float; a GGUF export needs "
            "the gguf recipe (e.g. --recipe gguf --set gguf_type=Q4_0)"
        )


def gguf_settings_of(recipe: dict) -> tuple[str, bool] | None:
    """``(file type, pure)`` of the ``gguf`` part of a recipe's ``to_dict()``, or None."""
    parts = recipe.get("parts") if recipe.get("method") == "compose" else [recipe]
    for part in parts:
        if part.get("method") == "gguf":
            settings = part.get("settings") or {}
            return file_type(settings.get("gguf_type", "Q4_0")), bool(settings.get("pure", False))
    return None


def _linear_weight(module: nn.Module, name: str) -> GGUFQuantized:
    weight = getattr(module, "quantized_weight", None)
    if not isinstance(weight, GGUFQuantized):
        raise LowbitError(
            f"{name} is not on a llama.cpp block grid ({type(module).__name__}); quantize with "
            "the gguf recipe before exporting to GGUF"
        )
    if getattr(module, "input_transform", None) is not None:
        raise LowbitError(
            f"{name} has an online transform a GGUF file cannot hold; rotate with online=false"
        )
    if getattr(module, "act_quantizer", None) is not None:
        raise LowbitError(f"{name} quantizes its activations, which a GGUF file cannot hold")
    return weight


def _rope_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows [heads * head_dim, ...] from transformers' half-split RoPE pairing into llama.cpp's
    interleaved one (within each head, row ``i`` of the first half pairs with ``i`` of the
    second; llama.cpp wants them adjacent)."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _is_float(module: nn.Module) -> bool:
    return type(module) is nn.Linear


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, its data made only when it is written.

    Attributes:
        name: the GGUF tensor name.
        type_name: ``F32``, ``F16`` or a llama.cpp block type's name.
        shape: [rows, columns] (or [width]) in weights, as the model holds it.
        make: ``make()`` -> the file's data: float32 / float16 of ``shape``, or llama.cpp's
            bytes [rows, bytes per row] uint8 for a block type.
        sources: the model's tensors ``make`` reads; once written, their clean pages of a
            memory-mapped checkpoint are given back (:func:`lowbit.mapped.release_pages`), so
            exporting a saved model does not leave the whole checkpoint resident.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]
    sources: tuple[torch.Tensor | None, ...] = ()

    def add_info(self, writer) -> None:
        """Declare the tensor (name, type, shape, bytes) to a ``gguf.GGUFWriter``."""
        import gguf

        if self.type_name in ("F32", "F16"):
            dtype = np.dtype(np.float32 if self.type_name == "F32" else np.float16)
            writer.add_tensor_info(
                self.name, self.shape, dtype, math.prod(self.shape) * dtype.itemsize
            )
            return
        qtype = gguf.GGMLQuantizationType[self.type_name]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*self.shape[:-1], self.shape[-1] // block * type_size)
        writer.add_tensor_info(
            self.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype
        )

    def data(self) -> np.ndarray:
        """``make()`` as the file stores it: contiguous, in the declared dtype."""
        array = self.make()
        if self.type_name in ("F32", "F16"):
            return np.ascontiguousarray(
                array, dtype=np.float32 if self.type_name == "F32" else np.float16
            )
        return np.ascontiguousarray(array)


def gguf_tensors(model: nn.Module) -> tuple[str, list[GGUFTensor]]:
    """The file's tensors in file order: ``(file type name, [GGUFTensor])``, none of them
    made yet, so a writer holds one at a time. A model with no quantized linear (the float
    model, what llama.cpp's own quantizer reads) is written in F32."""
    adapter = adapter_for(model)
    as_float = all(_is_float(m) for b in adapter.blocks() for m in b.linears().values())
    recipe = getattr(model, "lowbit_recipe", None)
    settings = None if recipe is None else gguf_settings_of(recipe.to_dict())
    if as_float:
        settings = ("F32", False)
    elif settings is None:
        raise LowbitError("the model was not quantized by the gguf recipe; a GGUF file needs it")
    ftype, pure = settings
    permute = _ARCH[adapter.family] == "llama"
    tensors: list[GGUFTensor] = []

    def f32(name: str, t: torch.Tensor) -> GGUFTensor:
        return GGUFTensor(name, "F32", tuple(t.shape), lambda: _f32(t), (t,))

    for block in adapter.blocks():
        i = block.index
        tensors.append(f32(f"blk.{i}.attn_norm.weight", block.input_norm.weight))
        tensors.append(f32(f"blk.{i}.ffn_norm.weight", block.post_attention_norm.weight))
        for short, module in block.linears().items():
            heads = None
            if permute and short in ("q_proj", "k_proj"):
                heads = adapter.num_heads if short == "q_proj" else adapter.num_kv_heads
            name = f"blk.{i}.{GGUF_LINEAR_NAMES[short]}"
            if _is_float(module):  # the float model, or rows no block divides
                type_name = "F32" if as_float else "F16"
                shape, sources = tuple(module.weight.shape), (module.weight,)
                make = _permuted(lambda m=module: _f32(m.weight), heads)  # [out, in]
            else:
                weight = _linear_weight(module, f"{adapter.block_prefix(i)}.{short}")
                type_name, shape = weight.type_name, weight.shape
                sources = (
                    weight.codes,
                    weight.scale,
                    weight.minimum,
                    weight.sub_scale,
                    weight.sub_min,
                )
                make = _permuted(weight.to_blocks, heads)  # [out, bytes per row]
            tensors.append(GGUFTensor(f"{name}.weight", type_name, shape, make, sources))
            if module.bias is not None:
                bias = module.bias
                tensors.append(
                    GGUFTensor(
                        f"{name}.bias", "F32", tuple(bias.shape),
                        _permuted(lambda b=bias: _f32(b), heads), (bias,),
                    )
                )  # fmt: skip
        for norm, gguf_name in ((block.q_norm, "attn_q_norm"), (block.k_norm, "attn_k_norm")):
            if norm is not None:
                tensors.append(f32(f"blk.{i}.{gguf_name}.weight", norm.weight))
    # what lowbit left in float, typed as llama.cpp types it (module docstring), by RTN
    tied = adapter.tied_embeddings
    width = adapter.hidden_size
    embed_type = tensor_type(ftype, "token_embd", width=width, tied=tied, pure=pure)
    embed = adapter.embed_tokens.weight
    tensors.insert(
        0,
        GGUFTensor(
            "token_embd.weight",
            embed_type,
            tuple(embed.shape),
            lambda: _rows(embed, embed_type),
            (embed,),
        ),
    )
    tensors.append(f32("output_norm.weight", adapter.final_norm.weight))
    if not tied:
        out_type = tensor_type(ftype, "output", width=width, tied=tied, pure=pure)
        head = adapter.lm_head.weight
        tensors.append(
            GGUFTensor(
                "output.weight",
                out_type,
                tuple(head.shape),
                lambda: _rows(head, out_type),
                (head,),
            )
        )
    return ftype, tensors


def _permuted(make: Callable[[], np.ndarray], heads: int | None) -> Callable[[], np.ndarray]:
    """``make`` with its rows moved into llama.cpp's RoPE pairing when ``heads`` is given."""
    if heads is None:
        return make
    return lambda: _rope_permute(make(), heads)


# rows of a float matrix rounded onto a block grid at a time (the vocabulary-sized output
# matrix: its float32 copy and the grid search's temporaries stay a slab's, not the matrix's)
_RTN_ROWS = 4096


def _rows(weight: torch.Tensor, type_name: str) -> np.ndarray:
    """A float matrix as the file stores it: F32, F16, or lowbit's RTN onto ``type_name``,
    ``_RTN_ROWS`` rows at a time (each block's grid is its own, so the bytes are the same)."""
    if type_name in ("F32", "F16"):
        return _f32(weight)
    # 3 candidates per end, not 11: the output matrix has vocabulary-many rows (49152 x 576
    # for SmolLM2: 8 s instead of 59), and it is on 6 or 8 bits
    spec = GGUFWeightSpec(type_name)
    out = None  # [rows, bytes per row] uint8, filled a slab at a time
    for lo in range(0, weight.shape[0], _RTN_ROWS):
        slab = spec.rtn(weight[lo : lo + _RTN_ROWS].detach().float().cpu(), steps=3).to_blocks()
        if out is None:
            out = np.empty((weight.shape[0], slab.shape[1]), dtype=np.uint8)
        out[lo : lo + len(slab)] = slab
    return out


def _metadata(writer, model: nn.Module, ftype: str, name: str) -> None:
    adapter = adapter_for(model)
    config = model.config
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[ftype][0])
    writer.add_quantization_version(2)
    writer.add_context_length(adapter.max_context)
    writer.add_embedding_length(adapter.hidden_size)
    writer.add_block_count(adapter.num_layers)
    writer.add_feed_forward_length(adapter.intermediate_size)
    writer.add_head_count(adapter.num_heads)
    writer.add_head_count_kv(adapter.num_kv_heads)
    writer.add_layer_norm_rms_eps(adapter.rms_norm_eps)
    writer.add_key_length(adapter.head_dim)
    writer.add_value_length(adapter.head_dim)
    writer.add_rope_dimension_count(adapter.head_dim)
    writer.add_vocab_size(adapter.vocab_size)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    if rope.get("rope_type", "default") not in ("default", None):
        raise LowbitError(
            f"RoPE scaling {rope.get('rope_type')!r} is not written to GGUF by lowbit yet"
        )


def _copy_tokenizer_fields(writer, source: Path) -> None:
    """Every ``tokenizer.*`` field of the GGUF file the model came from."""
    import gguf

    reader = gguf.GGUFReader(source)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)


def _hf_tokenizer_fields(writer, tokenizer, pre: str, vocab_size: int) -> None:
    """A Hugging Face byte-level BPE tokenizer as llama.cpp's ``gpt2`` model, its token list
    padded with unused ``[PAD<id>]`` tokens to ``vocab_size``, the embedding's rows: llama.cpp
    takes the vocabulary's size from the list and refuses an embedding of another."""
    import json

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise LowbitError(
            f"lowbit writes byte-level BPE tokenizers to GGUF; this one is {model.get('type')!r}"
        )
    vocab = model["vocab"]
    size = max(len(tokenizer), max(vocab.values()) + 1, vocab_size)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # unused
    for token, index in vocab.items():
        tokens[index], types[index] = token, 1  # normal
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4  # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("pad_token_id", writer.add_pad_token_id),
    ):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(False)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        writer.add_chat_template(template)


def export_gguf(
    model: nn.Module,
    out: str | os.PathLike,
    *,
    tokenizer=None,
    source_gguf: str | os.PathLike | None = None,
    name: str = "lowbit",
    force: bool = False,
) -> str:
    """Write ``model`` (its block linears on a GGUF grid) as one GGUF file, atomically.

    Args:
        model: a Llama, Mistral, Qwen2 or Qwen3 causal LM quantized by the ``gguf`` recipe.
        out: the file to write.
        tokenizer: a Hugging Face tokenizer (byte-level BPE), used when ``source_gguf`` is None.
        source_gguf: the GGUF file the model was read from: its tokenizer fields are copied.
        name: ``general.name``.
        force: replace an existing regular file at ``out``; without it an existing file is
            refused (:func:`lowbit.atomic.check_target`), and what a link points to never is.

    Returns:
        The file type name (the recipe's ``gguf_type``; F32 for a float model).
    """
    import gguf

    check_target(out, "export to", kind="file", force=force)  # before the tensors are built
    ftype, tensors = gguf_tensors(model)
    arch = _ARCH[adapter_for(model).family]
    if source_gguf is None and tokenizer is None:
        raise LowbitError("a GGUF file needs a tokenizer: pass tokenizer= or source_gguf=")
    with atomic_file(out, verb="export to", force=force) as path:
        writer = gguf.GGUFWriter(path, arch)
        _metadata(writer, model, ftype, name)
        if source_gguf is not None:
            _copy_tokenizer_fields(writer, Path(source_gguf))
        else:
            _hf_tokenizer_fields(writer, tokenizer, "default", adapter_for(model).vocab_size)
        for tensor in tensors:
            tensor.add_info(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in tensors:  # one tensor's data in memory at a time
            writer.write_tensor_data(tensor.data())
            release_pages(tensor.sources)
        writer.close()
    return ftype
