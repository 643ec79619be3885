"""Long-context decoding: tokens/s, cache bytes and peak memory against context length.

Rows (``--rows``): the float model with transformers' ``DynamicCache`` and lowbit's KV
recipes (``kv-int 4``, ``kvquant 4``, ``kvquant 3``, ``kivi 2``, ``ksort-bfp``), each on its
own copy of the embedded model in ``--dtype``. lowbit's decode steps read the packed pages with
the compiled kernels (:mod:`lowbit.kv.native`) where they read the format (all but
``ksort-bfp``); the rows ``kv-int 4, torch decode`` and ``kvquant 4, torch decode`` (not run
unless named) store and attend on the torch path instead, to show the kernels' share.

For every context length (``--contexts``) each row's cache is prefilled with that many
WikiText-2 test tokens in chunks of ``--chunk``, then ``--steps`` greedy decode steps are
timed, the rows interleaved step by step in one process so every row shares the same machine
load; a row's figure is the median step. Ratios are to the first row of the same run (the
float row by default).

Columns: the median decode step in ms and decode tokens/s (1 / median step, batch 1), the
ratio to the first row's tokens/s, the cache's bytes measured from its stored tensors (lowbit:
``QuantizedKVCache.nbytes``, sinks and fp residual in float16; float: every key and value
tensor), the seconds of the row's real prefill (chunks of ``--chunk`` tokens), and the peak
resident memory above what was resident before the row's prefill (sampled every 20 ms: prefill
and its first decode step).

``kvquant`` rows calibrate on ``--calib-tokens`` tokens of WikiText-2's test text from character
800,000 on, far past the prompts (speed does not depend on the codebook; accuracy is
docs/results/kv-cache.md's).

``--replicate-from P``: each row really prefills ``min(P, context)`` tokens, then its cache is
grown to the context by copies of its own contents (:func:`grow`: lowbit's packed pages cloned,
the float cache's keys and values repeated; positions ``0..context-1``), labelled "replicated"
in the table: the same bytes and the same decode work as a real prefill of that length, at a
fraction of the prefill time, and the only way past the model's 8,192 positions (32k to 1M
tokens: the model's weights and the cache's shape, RoPE extrapolated). Decode steps are the
whole model's.

``--llama-cpp f16 q8_0 q4_0``: after lowbit's rows, in the same process, llama.cpp (the
``gguf`` extra) runs the embedded model's own GGUF (Q4_1 weights, whose dequantized values are
lowbit's float model) with each named K and V cache type (flash attention for the quantized
ones) at every context: a real prefill of the same WikiText-2 prefix (llama.cpp's cache cannot
be grown by copies; contexts are capped at the model's 8,192 positions), then ``--steps``
greedy steps, the median step reported. Its rows form a second table, with ratios to the first
cache type named: llama.cpp's quantized caches against its own f16 cache, as lowbit's rows
against transformers' float cache (the two engines' weights differ, so their absolute speeds
are not the caches' comparison).

Command (docs/results/long-context.md)::

    nice python benchmarks/bench_long_context.py --contexts 1024 4096 8192 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PeakRSS, command_line, markdown_table, stamp  # noqa: E402

WIKI = Path("/work/shared/data/wikitext-2-raw")
CALIB_OFFSET = 800_000  # characters: calibration text starts far past the prompts
MODEL_POSITIONS = 8192  # the embedded model's max_position_embeddings
ROWS = {
    "float (DynamicCache)": None,
    "kv-int 4": ("kv-int", {"bits": 4}),
    "kvquant 4": ("kvquant", {"bits": 4}),
    "kvquant 3": ("kvquant", {"bits": 3}),
    "kivi 2": ("kivi", {"bits": 2}),
    "ksort-bfp": ("ksort-bfp", {}),
    "kv-int 4, torch decode": ("kv-int", {"bits": 4}),
    "kvquant 4, torch decode": ("kvquant", {"bits": 4}),
}
#: rows whose decode steps store and attend on the torch path (no compiled library) although the
#: compiled kernels (lowbit.kv.native) read their pages: the kernels' gain, in the same run
TORCH_DECODE = {name for name in ROWS if name.endswith(", torch decode")}
DEFAULT_ROWS = [name for name in ROWS if name not in TORCH_DECODE]


@contextlib.contextmanager
def decode_path(name: str):
    """Inside: ``name``'s decode steps take the path its row names."""
    from lowbit.kv import native

    if name not in TORCH_DECODE:
        yield
        return
    library = native.library
    native.library = lambda: None
    try:
        yield
    finally:
        native.library = library


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _tokens(tokenizer, count: int, offset: int = 0) -> torch.Tensor:
    """``count`` tokens of WikiText-2's test text from character ``offset``."""
    text = (WIKI / "wiki.test.raw").read_text()[offset : offset + count * 8]
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < count:
        raise SystemExit(f"WikiText-2 has fewer than {count} tokens in the slice read")
    return ids[:, :count]


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    return total


def build_rows(names, dtype, calib_tokens):
    from lowbit.api import quantize
    from lowbit.models.loader import load_model
    from lowbit.recipes.registry import get_recipe

    loaded = load_model("embedded", dtype=dtype)
    base, tokenizer = loaded.model, loaded.tokenizer
    calib = _tokens(tokenizer, calib_tokens, CALIB_OFFSET).view(-1, 512)
    models = {}
    for name in names:
        model = copy.deepcopy(base)
        if ROWS[name] is not None:
            method, settings = ROWS[name]
            if method == "kvquant":
                settings = {**settings, "calib_tokens": calib_tokens}
            recipe = get_recipe(method, **settings)
            calibration = calib if recipe.needs_calibration else None
            quantize(model, recipe, calibration=calibration, progress=False)
        models[name] = model
        _trim()
    return models, tokenizer


def new_cache(model):
    from transformers import DynamicCache

    maker = getattr(model, "lowbit_make_cache", None)
    return maker() if maker is not None else DynamicCache(config=model.config)


def prefill_rows(models, prompt, chunk):
    """Each row's cache filled with ``prompt`` in chunks of ``chunk``; returns caches, next
    tokens and per row the prefill's seconds and peak RSS above the start."""
    caches, nxt, info = {}, {}, {}
    with torch.no_grad():
        for name, model in models.items():
            _trim()
            cache = new_cache(model)
            start = time.perf_counter()
            with PeakRSS() as peak:
                for lo in range(0, prompt.shape[1] - 1, chunk):  # all but the last token
                    hi = min(lo + chunk, prompt.shape[1] - 1)
                    model(prompt[:, lo:hi], past_key_values=cache, logits_to_keep=1)
                logits = model(prompt[:, -1:], past_key_values=cache).logits
            info[name] = {
                "prefill_s": time.perf_counter() - start,
                "peak_mb": peak.mb - peak.start_mb,
            }
            caches[name], nxt[name] = cache, logits[:, -1:].argmax(-1)
    return caches, nxt, info


def time_rows(models, caches, nxt, steps):
    """Median seconds of ``steps`` decode steps per row, the rows interleaved step by step."""
    times = {name: [] for name in models}
    with torch.no_grad():
        for _ in range(steps):
            for name, model in models.items():
                with decode_path(name):
                    start = time.perf_counter()
                    logits = model(nxt[name], past_key_values=caches[name]).logits
                    times[name].append(time.perf_counter() - start)
                nxt[name] = logits[:, -1:].argmax(-1)
    return {name: statistics.median(t) for name, t in times.items()}


def grow(cache, tokens: int) -> None:
    """Grow a prefilled cache to ``tokens`` slots with copies of its own contents: a lowbit
    cache's packed tokens repeated, in pages of ``PAGE_TOKENS`` as a prefill of that length
    would lay them out, before the fp residual; a ``DynamicCache`` repeats its keys and values;
    pre-RoPE positions become ``0..tokens-1``."""
    for layer in cache.layers:
        if not hasattr(layer, "k"):  # transformers' DynamicLayer
            reps = -(-tokens // layer.keys.shape[2])
            layer.keys = layer.keys.repeat(1, 1, reps, 1)[:, :, :tokens].contiguous()
            layer.values = layer.values.repeat(1, 1, reps, 1)[:, :, :tokens].contiguous()
            continue
        for stream in (layer.k, layer.v):
            fixed = sum(t.shape[2] for t in (stream.sink, stream.residual) if t is not None)
            need = tokens - fixed - sum(p.num_tokens for p in stream.chunks)
            if not stream.chunks:  # a stream kept in floating point: repeat its residual
                if need > 0:
                    kept = stream.residual.shape[2] + need
                    reps = -(-kept // stream.residual.shape[2])
                    stream.residual = stream.residual.repeat(1, 1, reps, 1)[:, :, :kept]
                continue
            source = type(stream.chunks[0]).concat(stream.chunks)  # every packed token once
            page = stream.page_tokens
            at = 0  # next token of the source to copy
            while need > 0:
                last = stream.chunks[-1]
                room = page - last.num_tokens
                take = min(need, room if room > 0 else page, source.num_tokens - at)
                piece = source.slice_tokens(at, at + take)
                if room > 0:  # the join copies it
                    stream.chunks[-1] = type(last).concat([last, piece])
                else:
                    stream.chunks.append(_clone(piece))
                need -= take
                at = (at + take) % source.num_tokens
        layer.length = tokens
        if layer.track is not None and layer.owns_positions:
            layer.track.positions = torch.arange(tokens, dtype=torch.int32)[None]


def _clone(page):
    import dataclasses

    return dataclasses.replace(page, **{k: t.clone() for k, t in page.stored_tensors().items()})


def llama_cpp_table(
    caches: list[str], contexts: list[int], tokenizer, steps: int, threads: int
) -> str:
    """llama.cpp's decode steps on the embedded GGUF with each K/V cache type after a real
    prefill of each context (up to the model's positions), as a markdown table."""
    from lowbit.eval.llama_cpp import decode_speed, gguf_kv_bytes_per_token
    from lowbit.models.loader import embedded_gguf_path

    path = embedded_gguf_path()
    per_token = {cache: gguf_kv_bytes_per_token(path, cache) for cache in caches}
    base = caches[0]
    rows = []
    for context in contexts:
        if context > MODEL_POSITIONS:
            continue
        prompt = _tokens(tokenizer, context)[0].tolist()
        speed = {}
        for cache in caches:
            speed[cache] = decode_speed(
                path, threads, steps, prompt=prompt, kv_cache=cache, median=True
            )
            nbytes = per_token[cache] * context
            rows.append(
                [f"{context:,}", "real", f"llama.cpp {cache}", f"{1e3 / speed[cache]:,.0f}",
                 f"{speed[cache]:.3g}", f"{speed[cache] / speed[base]:.2f}",
                 f"{nbytes / 1e6:.1f}"]
            )  # fmt: skip
            print(rows[-1], flush=True)
    header = ["context", "contents", "KV cache", "ms a step", "decode tok/s",
              f"× {caches[0]} cache", "cache MB"]  # fmt: skip
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument(
        "--replicate-from", type=int, default=0,
        help="prefill at most this many real tokens and grow the cache to the context by "
        "copies of its pages (0: a real prefill of the whole context)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--llama-cpp", nargs="*", default=[], metavar="CACHE",
        help="llama.cpp K/V cache types to time on the embedded GGUF (f16, q8_0, q4_0, ...): "
        "a second table, ratios to the first one named",
    )  # fmt: skip
    parser.add_argument(
        "--chunked-prefill", action="store_true",
        help="every prefill step reads the cache chunk by chunk (the road past "
        "lowbit.kv.decode.DENSE_PREFILL_BYTES), not the layer whole",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.chunked_prefill:
        from lowbit.kv import decode

        decode.DENSE_PREFILL_BYTES = 0
    torch.set_num_threads(args.threads or torch.get_num_threads())
    threads = torch.get_num_threads()
    lines = [stamp(command_line()), ""]  # after the threads are set: the stamp names them
    models, tokenizer = build_rows(args.rows, dtype, args.calib_tokens)
    contexts = sorted(args.contexts)
    rows, caches = [], None
    for context in contexts:
        real = min(context, args.replicate_from) if args.replicate_from else context
        if caches is None or not args.replicate_from:  # a real prefill (once when replicating)
            prompt = _tokens(tokenizer, real)
            caches, nxt, info = prefill_rows(models, prompt, args.chunk)
            measured = {
                n: [f"{i['prefill_s']:.1f}", f"{i['peak_mb']:.0f}"] for n, i in info.items()
            }
        else:
            measured = {name: ["", ""] for name in models}
        for name in models:
            if caches[name].get_seq_length() < context:
                grow(caches[name], context)
        step = time_rows(models, caches, nxt, args.steps)
        base = args.rows[0]
        contents = "real" if real == context else f"replicated from {real:,}"
        base_bytes = _cache_bytes(caches[base])
        for name in args.rows:
            nbytes = _cache_bytes(caches[name])
            rows.append(
                [f"{context:,}", contents, name, args.dtype, f"{step[name] * 1e3:,.0f}",
                 f"{1 / step[name]:.3g}",
                 f"{step[base] / step[name]:.2f}", f"{nbytes / 1e6:.1f}",
                 f"{nbytes / base_bytes:.3f}", *measured[name]]
            )  # fmt: skip
            print(rows[-1], flush=True)
    header = ["context", "contents", "KV cache", "dtype", "ms a step", "decode tok/s", "× float",
              "cache MB", "× float bytes", "prefill s", "prefill peak MB above model"]  # fmt: skip
    lines.append(markdown_table(header, rows))
    if args.llama_cpp:
        lines += ["", llama_cpp_table(args.llama_cpp, contexts, tokenizer, args.steps, threads)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
