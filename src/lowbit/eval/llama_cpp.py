"""Measure a GGUF file through llama.cpp itself (llama-cpp-python, the ``gguf`` extra).

:class:`LlamaCppModel` gives llama.cpp's own logits for lowbit's windows, so
:func:`~lowbit.eval.evaluate.evaluate` computes perplexity, KL and top-1 against the float
model in transformers exactly as for a lowbit model. :func:`decode_speed` times llama.cpp's
decode steps; :func:`gguf_size` counts the file's bytes and the bits per weight of its block
linears (every block's scales included, as llama.cpp stores them).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowbit.errors import LowbitError
from lowbit.files import is_file, opened

__all__ = [
    "LlamaCppModel",
    "decode_speed",
    "evaluate_gguf",
    "gguf_kv_bytes_per_token",
    "gguf_size",
]


#: llama.cpp's KV cache types by name -> ggml type id (``type_k`` / ``type_v``); quantized
#: value caches need flash attention, so every non-f16 cache runs with it
KV_CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7}
#: bytes each cache type stores per element (ggml's block bytes over its 32 elements)
KV_CACHE_ELEMENT_BYTES = {
    "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32,
    "q5_1": 24 / 32,
}  # fmt: skip


def _llama(
    path: str | os.PathLike,
    n_ctx: int,
    threads: int,
    kv_cache: str = "f16",
    all_logits: bool = True,
):
    try:
        from llama_cpp import Llama
    except ImportError:
        raise LowbitError(
            "--engine llama.cpp needs llama-cpp-python: pip install 'lowbit[gguf]'"
        ) from None
    if not is_file(path):
        raise LowbitError(f"{path} is not a file")
    with opened(path):  # unreadable: a sentence naming it, not llama.cpp's "failed to load"
        pass
    if kv_cache not in KV_CACHE_TYPES:
        raise LowbitError(
            f"llama.cpp's KV cache type must be one of {', '.join(KV_CACHE_TYPES)}, not {kv_cache!r}"
        )
    cache = {}
    if kv_cache != "f16":
        kind = KV_CACHE_TYPES[kv_cache]
        cache = dict(type_k=kind, type_v=kind, flash_attn=True)
    try:
        return Llama(
            str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, logits_all=all_logits,
            verbose=False, **cache,
        )  # fmt: skip
    except (ValueError, RuntimeError) as err:
        raise LowbitError(f"llama.cpp cannot load {path}: {err}") from None


class LlamaCppModel:
    """A GGUF file run by llama.cpp, as :func:`~lowbit.eval.evaluate.evaluate` reads a model."""

    def __init__(
        self, path: str | os.PathLike, n_ctx: int, threads: int = 2, kv_cache: str = "f16"
    ):
        self.path = Path(path)
        self.kv_cache = kv_cache
        self.llm = _llama(path, n_ctx, threads, kv_cache)

    def window_logits(self, window: torch.Tensor) -> torch.Tensor:
        """llama.cpp's logits of one window: [S] -> [S, V] fp32 on the CPU."""
        self.llm.reset()  # a fresh KV cache: every window starts at position 0
        self.llm.eval(window.tolist())
        return torch.from_numpy(np.array(self.llm.scores[: window.numel()], dtype=np.float32))

    def check_vocabulary(self, vocab_size: int, tokenizer, sample: torch.Tensor) -> None:
        """Refuse, before any window runs, a file whose vocabulary is not the reference
        model's: another size (llama.cpp would fail on the first id past its end, or score
        another vocabulary), or ids that its tokenizer spells otherwise than the reference's
        (``sample``: [T] ids the reference's tokenizer made)."""
        n_vocab = int(self.llm.n_vocab())
        if n_vocab != vocab_size:
            raise LowbitError(
                f"{self.path} has a vocabulary of {n_vocab} tokens and the reference model one "
                f"of {vocab_size}: they are not the same model's; pass --reference, the float "
                "model the file was made from"
            )
        ids = sample.tolist()
        theirs = self.llm.detokenize(ids).decode("utf-8", errors="replace")
        ours = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        if theirs != ours:
            raise LowbitError(
                f"{self.path}'s tokenizer spells the reference model's tokens otherwise (the "
                "same ids are other text): the file's vocabulary is not the reference's; pass "
                "--reference, the float model the file was made from"
            )


def gguf_size(path: str | os.PathLike) -> tuple[int, float]:
    """``(file bytes, bits per weight of the block linears)``."""
    import gguf

    reader = gguf.GGUFReader(path)
    bits = weights = 0
    for tensor in reader.tensors:
        if (
            tensor.name.startswith("blk.")
            and tensor.name.endswith(".weight")
            and "norm" not in tensor.name
        ):
            bits += int(tensor.n_bytes) * 8
            weights += int(tensor.n_elements)
    return Path(path).stat().st_size, bits / max(weights, 1)


def gguf_kv_bytes_per_token(path: str | os.PathLike, kv_cache: str = "f16") -> float:
    """Bytes per token of llama.cpp's KV cache of type ``kv_cache`` (:data:`KV_CACHE_TYPES`;
    F16 by default) for the file's model: keys and values for every layer's KV heads."""
    import gguf

    reader = gguf.GGUFReader(path)

    def field(name: str):
        found = reader.fields.get(name)
        return None if found is None else found.contents()

    arch = field("general.architecture")
    layers = field(f"{arch}.block_count")
    heads = field(f"{arch}.attention.head_count")
    kv_heads = field(f"{arch}.attention.head_count_kv") or heads
    key = field(f"{arch}.attention.key_length")
    value = field(f"{arch}.attention.value_length")
    if key is None or value is None:
        width = field(f"{arch}.embedding_length")
        if width is None or not heads:
            raise LowbitError(f"{path} does not state its attention's shape (no {arch}.* fields)")
        key = value = int(width) // int(heads)
    elements = int(layers) * int(kv_heads) * (int(key) + int(value))
    return float(elements * KV_CACHE_ELEMENT_BYTES[kv_cache])


def decode_speed(
    path: str | os.PathLike,
    threads: int = 2,
    new_tokens: int = 64,
    *,
    prompt: list[int] | None = None,
    kv_cache: str = "f16",
    median: bool = False,
) -> float:
    """llama.cpp's decode tokens/s at batch 1: greedy steps after ``prompt`` (token ids; by
    default an 8-token sentence), with ``kv_cache`` as its K and V cache type. The whole run's
    rate, or with ``median`` one over the median step (a long context's steps, timed alone)."""
    llm = _llama(
        path, n_ctx=(len(prompt) if prompt else 8) + new_tokens + 16, threads=threads,
        kv_cache=kv_cache, all_logits=False,
    )  # fmt: skip
    if prompt is None:
        prompt = llm.tokenize(b"The quick brown fox jumps over the", add_bos=True)[:8]
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    llm.eval([token])  # one warm-up step
    steps = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        llm.eval([token])
        steps.append(time.perf_counter() - t0)
    if median:
        return 1.0 / float(np.median(steps))
    return new_tokens / (time.perf_counter() - start)


def evaluate_gguf(
    path: str | os.PathLike,
    *,
    reference: str | os.PathLike | None = None,
    dataset: str = "pydoc",
    seqlen: int = 2048,
    windows: int | None = None,
    threads: int = 2,
    progress: bool = True,
    float_reference: Any = None,
    kv_cache: str = "f16",
) -> dict[str, Any]:
    """Perplexity, KL and top-1 of llama.cpp's logits on lowbit's windows.

    Args:
        path: the GGUF file.
        reference: the float model (any spec :func:`lowbit.load_model` takes; None: the
            embedded model); its tokenizer cuts the windows.
        dataset, seqlen, windows: as ``lowbit eval``.
        threads: llama.cpp's threads.
        float_reference: a :class:`~lowbit.eval.evaluate.FloatReference` to reuse (a table of
            files on one model runs the float model once); its model's tokenizer is
            ``float_reference.tokenizer``.

    Returns:
        A row as ``lowbit eval`` prints it (``file_bytes``, ``bits_per_weight`` added).
    """
    from lowbit.api import load_model
    from lowbit.data import eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import FloatReference, evaluate

    corpus = load_corpus(dataset, part="eval")
    if float_reference is None:
        loaded = load_model(reference)
        float_reference = FloatReference(loaded.model)
        float_reference.tokenizer = loaded.tokenizer
    ids = eval_windows(tokenize(float_reference.tokenizer, corpus.text), seqlen, windows)  # [N, S]
    engine = LlamaCppModel(path, n_ctx=seqlen, threads=threads, kv_cache=kv_cache)
    vocab_size = int(float_reference.model.get_output_embeddings().weight.shape[0])
    engine.check_vocabulary(vocab_size, float_reference.tokenizer, ids[0, :256])
    result = evaluate(
        engine, ids, reference=float_reference, progress=progress, desc=Path(path).name[:30]
    )
    file_bytes, bits = gguf_size(path)
    return {
        "model": str(path),
        # the cache type named where it is not llama.cpp's default (f16)
        "label": f"{Path(path).name} (llama.cpp{'' if kv_cache == 'f16' else ', KV ' + kv_cache})",
        "kv_cache": kv_cache,
        "dataset": corpus.name,
        "seqlen": seqlen,
        "windows": result.windows,
        "tokens": result.tokens,
        "ppl": result.ppl,
        "kl": result.kl,
        "top1": result.top1,
        "bits_per_weight": bits,
        "model_bytes": file_bytes,
        "kv_bytes_per_token": gguf_kv_bytes_per_token(path, kv_cache),
        "eval_seconds": result.seconds,
    }
