"""Write a random-weight Llama of a real model's shape, as Hugging Face writes big models.

The output is a float model directory every lowbit command takes (``--model DIR``): bf16
safetensors shards with ``model.safetensors.index.json`` (or one ``model.safetensors`` when the
model fits one shard), ``config.json``, ``generation_config.json`` and the embedded model's
tokenizer (SmolLM2's, vocabulary 49152: every id it gives is inside each shape's vocabulary).
It is for measuring time and memory at real sizes, never accuracy: the weights are noise.

Tensors are generated one at a time (large ones a slab of rows at a time) and handed to
lowbit's ShardWriter, which writes a shard as soon as it is full, so the memory held is about
one shard (``--max-shard-size``, 1GB by default) or the largest tensor (the 8B shape's 1.05 GB
embedding), whatever the model's size: the 1B shape was written with a peak resident set of
1.31 GiB (2026-11-28, 1GB shards).

Weights are normal with std 0.02 (``--std``), RMSNorm scales 1, so activations stay finite
through every layer. The directory is written atomically (a temporary directory renamed at the
end); an existing one is refused unless ``--force``.

Shapes (``--shape``):

* ``llama3-8b``: Llama-3-8B: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads,
  vocabulary 128256, rope_theta 500000, untied embeddings (8.03 B parameters).
* ``llama-1b``: a ~1B Llama: hidden 2048, intermediate 5632, 16 layers, 32 heads of 64, 4 KV
  heads (TinyLlama-1.1B's widths and GQA, at 16 layers), vocabulary 49152 (the embedded
  tokenizer's), rope_theta 10000, untied (0.91 B parameters).
* ``smollm2-135m``: the embedded model's shape: hidden 576, intermediate 1536, 30 layers, 9
  heads, 3 KV heads, vocabulary 49152, rope_theta 100000, tied (0.135 B parameters).

Usage::

    python benchmarks/make_shaped_model.py --shape llama-1b --out /work/scratch/llama-1b
    python benchmarks/make_shaped_model.py --shape llama3-8b --layers 2 --out /tmp/l8b-2
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    tied: bool
    max_positions: int


SHAPES = {
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, 500000.0, False, 8192),
    "llama-1b": Shape(2048, 5632, 16, 32, 4, 49152, 10000.0, False, 4096),
    "smollm2-135m": Shape(576, 1536, 30, 9, 3, 49152, 100000.0, True, 8192),
}

#: rows of a large tensor generated at once (float32 before the cast): about 64 MB of them
SLAB_ELEMENTS = 16 * 2**20


def llama_config(shape: Shape, layers: int, tokenizer):
    """The config.json of the shape, with the tokenizer's special ids."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )
    return config


def random_bf16(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """A bf16 tensor of normal noise with ``std``, generated a slab of rows at a time (the
    float32 draw of a whole embedding would take twice its bf16 size again)."""
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = out.view(shape[0], -1)
    step = max(1, SLAB_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        slab = torch.randn(rows[start : start + step].shape, generator=generator)
        rows[start : start + step] = slab.mul_(std)
    return out


def tensors(shape: Shape, layers: int, std: float, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Every tensor of the model, one block's worth at a time, in checkpoint order."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    yield {"model.embed_tokens.weight": random_bf16((shape.vocab, shape.hidden), std, gen)}
    ones = torch.ones(shape.hidden, dtype=torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield {
            p + "input_layernorm.weight": ones.clone(),
            p + "post_attention_layernorm.weight": ones.clone(),
        }
        for name, rows, cols in (
            ("self_attn.q_proj", shape.hidden, shape.hidden),
            ("self_attn.k_proj", kv, shape.hidden),
            ("self_attn.v_proj", kv, shape.hidden),
            ("self_attn.o_proj", shape.hidden, shape.hidden),
            ("mlp.gate_proj", shape.intermediate, shape.hidden),
            ("mlp.up_proj", shape.intermediate, shape.hidden),
            ("mlp.down_proj", shape.hidden, shape.intermediate),
        ):
            yield {f"{p}{name}.weight": random_bf16((rows, cols), std, gen)}
    yield {"model.norm.weight": ones.clone()}
    if not shape.tied:
        yield {"lm_head.weight": random_bf16((shape.vocab, shape.hidden), std, gen)}


def write_model(
    out: Path,
    shape_name: str,
    *,
    layers: int | None = None,
    seed: int = 0,
    std: float = 0.02,
    max_shard_size: str = "1GB",
    force: bool = False,
) -> dict[str, str]:
    """Write the shaped model to ``out``; returns ``{weights file: sha256}``."""
    from transformers import GenerationConfig

    from lowbit.atomic import atomic_directory, check_target
    from lowbit.errors import LowbitError
    from lowbit.io.shards import ShardWriter, parse_size
    from lowbit.models.loader import embedded_tokenizer

    shape = SHAPES[shape_name]
    layers = shape.layers if layers is None else layers
    if layers < 1:
        raise LowbitError(f"--layers must be at least 1, not {layers}")
    max_shard_bytes = parse_size(max_shard_size)
    if force and out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    check_target(out, "write the model to")
    tokenizer = embedded_tokenizer()
    config = llama_config(shape, layers, tokenizer)
    with atomic_directory(out, verb="write the model to") as tmp:
        writer = ShardWriter(tmp, max_shard_bytes=max_shard_bytes)
        for group in tensors(shape, layers, std, seed):
            writer.add(group)
            del group
        checksums = writer.close()
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return checksums


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, help="the directory to write (new or empty)")
    parser.add_argument("--layers", type=int, default=None, help="cut the depth to N layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="the weights' std (0.02)")
    parser.add_argument("--max-shard-size", default="1GB", help="bytes per shard (1GB)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    from lowbit.errors import LowbitError

    start = time.perf_counter()
    try:
        checksums = write_model(
            Path(args.out).expanduser(),
            args.shape,
            layers=args.layers,
            seed=args.seed,
            std=args.std,
            max_shard_size=args.max_shard_size,
            force=args.force,
        )
    except LowbitError as err:
        print(f"make_shaped_model: {err}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser()
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    shards = sum(name.endswith(".safetensors") for name in checksums)
    print(
        f"wrote {out}: {args.shape}"
        + (f" cut to {args.layers} layers" if args.layers else "")
        + f", {size / 1e9:.2f} GB in {shards} shard(s), {time.perf_counter() - start:.0f} s, "
        f"peak RSS {peak:.2f} GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
