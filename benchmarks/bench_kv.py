"""Quantized KV caches side by side on the embedded model (WikiText-2 test windows).

Setup (the peers are benchmark-only, not lowbit dependencies):

    .venv/bin/python -m pip install optimum-quanto hqq
    .venv/bin/python benchmarks/bench_kv.py --windows 8 --seqlen 2048 --chunk 128

Every row is evaluated the same way: each window is fed in chunks of ``--chunk`` tokens through
the row's cache (``lowbit.eval.evaluate(..., chunk=...)``), so tokens attend to the cached,
quantized earlier tokens. lowbit's caches also quantize the current chunk's own keys and values
before attention; transformers' QuantizedCache returns the current chunk unquantized (and its
first chunk entirely), which is its design and favours it. A row whose peer package is missing
is reported as skipped.

Rows (``ROWS``; another module adds rows by appending ``KVRow``s):
- fp: the float model through transformers' DynamicCache.
- int-post K*V*: asymmetric integer, keys after RoPE and values per token, group 64, no clip
  (the issue's plain fake-quant reference: K4V4 22.0, K3V3 37.3, K2V2 634 at fp 19.26).
- int-pre-ch K*V*: keys per channel before RoPE over runs of 128 tokens (tokens of an unfinished
  run stay in float16), values per token (reference: K4V4 20.1, K3V3 24.0, K2V2 143).
- quarot K*V*: QuaRot's cache: online Hadamard on q/k after RoPE, asymmetric per token,
  group = head_dim, clip 0.95.
- kivi-*: KIVI, keys per channel in groups of 32 tokens, values per token in groups of 32
  channels, last 128 tokens in float16.
- kvquant-*: KVQuant (nuqX, 1% outliers, sink), calibrated once by one Fisher pass over
  ``--calib-samples`` windows of WikiText-2 from window 16 on (never the evaluated ones);
  "kvquant-4, 1.5%/2.0% outliers" spend more of the bytes the 4-bit peers use.
- hf-quanto-* / hf-hqq-*: transformers' QuantizedCache (residual 128, group 64, its defaults).

Columns: perplexity, KL to the float model, top-1 agreement, analytic bits per element of the
K / V format, analytic KV bytes per token at ``--seqlen`` (lowbit rows; fp parts in float16),
and bytes per token measured from the tensors of the last window's cache (lowbit keeps fp parts
in float16; transformers keeps its residual and scales in the model's dtype, fp32 here).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_window_arguments, fmt, markdown_table, stamp  # noqa: E402


@dataclass
class KVRow:
    """One benchmark row.

    ``install(model, adapter, seqlen)`` sets the row's cache up on a fresh copy of the model (setting
    ``model.lowbit_make_cache``) and returns ``(bits_k, bits_v, analytic_bytes_per_token)``
    (any may be None).
    """

    name: str
    install: Callable
    needs: str | None = None  # a Python package the row needs


def _recipe_row(name: str, method: str, **settings) -> KVRow:
    def install(model, adapter, seqlen):
        from lowbit.api import quantize
        from lowbit.recipes.registry import get_recipe

        recipe = get_recipe(method, **settings)
        quantize(model, recipe, progress=False)
        k_bits, v_bits = model.lowbit_kv.bits_per_element(adapter.head_dim)
        return k_bits, v_bits, recipe.kv_bytes_per_token(adapter, seqlen)

    return KVRow(name, install)


def _fp_row() -> KVRow:
    def install(model, adapter, seqlen):
        return 16, 16, 2.0 * adapter.num_layers * 2 * adapter.num_kv_heads * adapter.head_dim

    return KVRow("fp", install)


def _hf_row(backend: str, bits: int) -> KVRow:
    def install(model, adapter, seqlen):
        from transformers.cache_utils import QuantizedCache

        model.lowbit_make_cache = lambda: QuantizedCache(
            backend=backend, config=model.config, nbits=bits
        )
        per_element = bits + 32 / 64  # codes + fp16 scale and zero per group of 64
        return per_element, per_element, None

    package = {"quanto": "optimum.quanto", "hqq": "hqq"}[backend]
    return KVRow(f"hf-{backend}-{bits}", install, needs=package)


#: the KVQuant rows' calibration, made on first use by ``main`` (one Fisher pass for all rows)
KVQUANT_CALIBRATION: dict = {}


def _kvquant_row(bits: int, outlier_fraction: float | None = None) -> KVRow:
    """KVQuant at ``bits``, with the recipe's outlier fraction unless one is given."""
    settings = {} if outlier_fraction is None else {"outlier_fraction": outlier_fraction}

    def install(model, adapter, seqlen):
        from lowbit.recipes.registry import get_recipe

        recipe = get_recipe("kvquant", bits=bits, **settings)
        keys, values = recipe.quantizers(adapter, KVQUANT_CALIBRATION["calibration"])
        layout = recipe.install(model, adapter, keys, values)
        k_bits, v_bits = layout.bits_per_element(adapter.head_dim)
        return k_bits, v_bits, recipe.kv_bytes_per_token(adapter, seqlen)

    suffix = "" if outlier_fraction is None else f", {outlier_fraction:.1%} outliers"
    return KVRow(f"kvquant-{bits}{suffix}", install)


ROWS: list[KVRow] = [_fp_row()]
for _b in (4, 3, 2):
    ROWS.append(_recipe_row(f"int-post K{_b}V{_b}", "kv-int", bits=_b, clip_ratio=1.0))
for _b in (4, 3, 2):
    ROWS.append(
        _recipe_row(
            f"int-pre-ch K{_b}V{_b}",
            "kv-int",
            bits=_b,
            clip_ratio=1.0,
            pre_rope=True,
            per_channel_keys=True,
            key_token_group=128,
        )
    )
for _b in (4, 3, 2):
    ROWS.append(_recipe_row(f"quarot K{_b}V{_b}", "kv-int", bits=_b, rotate_qk="hadamard"))
for _b in (4, 2):
    ROWS.append(_recipe_row(f"kivi-{_b}", "kivi", bits=_b))
for _b in (4, 3, 2):
    ROWS.append(_kvquant_row(_b))
for _fraction in (0.015, 0.02):  # 4 bits with the bytes of quanto-4 / fewer than KIVI-4's
    ROWS.append(_kvquant_row(4, _fraction))
for _backend in ("quanto", "hqq"):
    for _b in (4, 2):
        ROWS.append(_hf_row(_backend, _b))


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensor subclasses flattened), each once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def measured_bytes_per_token(cache) -> float | None:
    if cache is None or cache.get_seq_length() == 0:
        return None
    if hasattr(cache, "bytes_per_token"):
        return cache.bytes_per_token()
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total / cache.get_seq_length()


def _record_caches(model) -> list:
    """Keep every cache the evaluation makes (to measure the last one); returns their list."""
    made = []
    make = getattr(model, "lowbit_make_cache", None)
    if make is not None:

        def recording():
            made.append(make())
            return made[-1]

        model.lowbit_make_cache = recording
    return made


def _available(package: str | None) -> bool:
    if package is None:
        return True
    import importlib

    try:
        importlib.import_module(package)
    except Exception:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--rows", nargs="*", default=None, help="row names (default: all)")
    parser.add_argument("--calib-samples", type=int, default=16, help="KVQuant Fisher windows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from lowbit.api import load_model
    from lowbit.data import calibration_samples, eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import FloatReference, evaluate
    from lowbit.kv.fisher import collect_kv_fisher
    from lowbit.models.adapter import adapter_for

    loaded = load_model(None)
    tokens = tokenize(loaded.tokenizer, load_corpus(args.dataset).text)
    windows = eval_windows(tokens, args.seqlen, args.windows)
    reference = FloatReference(loaded.model)
    table = []
    rows = [r for r in ROWS if args.rows is None or r.name in args.rows]
    for row in rows:
        if not _available(row.needs):
            table.append([row.name] + ["skipped: pip install " + row.needs] + ["—"] * 5)
            continue
        if row.name.startswith("kvquant") and not KVQUANT_CALIBRATION:
            start = time.perf_counter()
            samples = calibration_samples(
                tokens, args.calib_samples, args.seqlen, seed=0, skip_windows=16
            )
            KVQUANT_CALIBRATION["calibration"] = collect_kv_fisher(
                loaded.model, adapter_for(loaded.model), samples
            )
            took = time.perf_counter() - start
            print(f"KVQuant Fisher pass: {tuple(samples.shape)} in {took:.0f} s", flush=True)
        model = copy.deepcopy(loaded.model)
        adapter = adapter_for(model)
        bits_k, bits_v, analytic = row.install(model, adapter, args.seqlen)
        made = _record_caches(model)
        start = time.perf_counter()
        result = evaluate(
            model, windows, reference=reference, chunk=args.chunk, progress=False, desc=row.name
        )
        measured = measured_bytes_per_token(made[-1] if made else None)
        table.append(
            [
                row.name,
                fmt(result.ppl, ".2f"),
                fmt(result.kl, ".4f"),
                fmt(result.top1, ".3f"),
                f"{fmt(bits_k, '.3f')} / {fmt(bits_v, '.3f')}",
                fmt(analytic, ".0f"),
                fmt(measured, ".0f"),
            ]
        )
        print(" | ".join(table[-1]), f"({time.perf_counter() - start:.0f} s)", flush=True)
    command = "python benchmarks/bench_kv.py " + " ".join(sys.argv[1:])
    print()
    print(stamp(command))
    print(f"{args.windows} windows x {args.seqlen} tokens, fed in chunks of {args.chunk} tokens.")
    print()
    header = ["cache", "ppl", "KL", "top-1", "bits/elem K / V", "bytes/token analytic",
              "bytes/token measured"]  # fmt: skip
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
