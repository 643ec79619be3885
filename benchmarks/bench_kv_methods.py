"""KVQuant's ablation ladder and K-sort + BFP12 on the embedded model (WikiText-2 test windows).

Rows: the KVQuant ladder (int per token -> per-channel keys -> pre-RoPE -> nuq -> 1% outliers
-> attention sink) at each of ``--bits``, calibrated once per calibration corpus (one Fisher
pass reused by every rung); then K-sort BFP12 keys (BFP16 queries) at each of ``--blocks``,
sorted and unsorted. Columns: perplexity, KL to the float model, top-1 agreement, analytic
bits per K/V element, analytic KV bytes per token at ``--seqlen``.

    .venv/bin/python benchmarks/bench_kv_methods.py --windows 8 --calib wikitext pydoc
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from common import WIKITEXT, fmt, markdown_table, stamp


def _row(name, calib_name, result, bits, kv_bytes):
    return [
        name,
        calib_name,
        fmt(result.ppl, ".3f"),
        fmt(result.kl, ".4f"),
        fmt(result.top1, ".4f"),
        fmt(bits, ".3f"),
        fmt(kv_bytes, ".1f"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--calib", nargs="+", default=["wikitext", "pydoc"])
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seqlen", type=int, default=2048)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2], help="ladder bits")
    parser.add_argument(
        "--full-bits", type=int, nargs="*", default=[], help="more bits, full kvquant row only"
    )
    parser.add_argument(
        "--kv-alone", type=int, nargs="*", default=[], help="kvquant with only K, only V"
    )
    parser.add_argument("--calib-cache", default=None, help="save/load the Fisher pass here")
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--rungs", nargs="+", default=None, help="ladder rungs (default: all)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a kvquant setting for every ladder row, e.g. --set channel_codebooks=true",
    )  # fmt: skip
    parser.add_argument("--skip-ladder", action="store_true")
    parser.add_argument("--skip-ksort", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from lowbit.api import load_model, quantize
    from lowbit.cli import parse_settings
    from lowbit.data import calibration_samples, eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import FloatReference, evaluate
    from lowbit.kv.fisher import KVCalibration, collect_kv_fisher
    from lowbit.models.adapter import adapter_for
    from lowbit.recipes.kvquant import LADDER
    from lowbit.recipes.registry import get_recipe

    extra = parse_settings(args.set)
    shown = "".join(f", {k}={v}" for k, v in extra.items())
    loaded = load_model(None)
    model, tokenizer = loaded.model.float(), loaded.tokenizer
    adapter = adapter_for(model)
    wiki_tokens = tokenize(tokenizer, load_corpus(str(WIKITEXT)).text)
    windows = eval_windows(wiki_tokens, args.seqlen, args.windows)
    reference = FloatReference(model)
    header = ["method", "calibration", "ppl", "KL", "top-1", "bits/elem", "KV bytes/token"]
    rows = [_row("fp16 cache", "—", evaluate(model, windows, reference=reference), 16.0, None)]
    print(markdown_table(header, rows), flush=True)

    h, d = adapter.num_kv_heads, adapter.head_dim
    for calib_name in [] if args.skip_ladder else args.calib:
        if calib_name == "wikitext":  # windows 16 onward: never the evaluated ones
            tokens, skip = wiki_tokens, 16 * args.seqlen // args.calib_seqlen
        else:
            tokens, skip = tokenize(tokenizer, load_corpus(calib_name, "calibration").text), 0
        samples = calibration_samples(
            tokens, args.calib_samples, args.calib_seqlen, seed=0, skip_windows=skip
        )
        cache = Path(f"{args.calib_cache}.{calib_name}.pt") if args.calib_cache else None
        start = time.perf_counter()
        if cache is not None and cache.exists():
            calib = KVCalibration(**torch.load(cache))
        else:
            calib = collect_kv_fisher(model, adapter, samples)
            if cache is not None:
                torch.save(vars(calib), cache)
        took = time.perf_counter() - start
        print(f"Fisher pass on {calib_name}: {tuple(samples.shape)} in {took:.0f} s", flush=True)
        rungs = args.rungs or LADDER
        unknown = sorted(set(rungs) - set(LADDER))
        if unknown:
            parser.error(f"unknown rungs {unknown}; choose from {list(LADDER)}")
        runs = [(b, name, {}, "") for b in args.bits for name in rungs]
        runs += [(b, "kvquant", {}, "") for b in args.full_bits]
        for b in args.kv_alone:  # one stream quantized, the other in fp16
            runs += [(b, "kvquant", {"v_bits": 16}, ", keys only")]
            runs += [(b, "kvquant", {"k_bits": 16}, ", values only")]
        for bits, name, settings, suffix in runs:
            recipe = get_recipe(name, bits=bits, **settings, **extra)
            candidate = copy.deepcopy(model)
            cand_adapter = adapter_for(candidate)
            keys, values = recipe.quantizers(cand_adapter, calib)
            layout = recipe.install(candidate, cand_adapter, keys, values)
            result = evaluate(candidate, windows, reference=reference, progress=False)
            bpe = sum(layout.bits_per_element(d)) / 2
            kv_bytes = recipe.kv_bytes_per_token(adapter, args.seqlen)
            rows.append(_row(f"{name} ({bits}b{suffix}{shown})", calib_name, result, bpe, kv_bytes))
            print(markdown_table(header, rows[-1:]).splitlines()[-1], flush=True)
            del candidate

    for block in [] if args.skip_ksort else args.blocks:
        for sort in (False, True):
            recipe = get_recipe("ksort-bfp", block=block, sort=sort)
            candidate = quantize(copy.deepcopy(model), recipe, progress=False)
            result = evaluate(candidate, windows, reference=reference, progress=False)
            bpe = sum(candidate.lowbit_kv.bits_per_element(d)) / 2  # values stay fp16
            name = f"BFP12 K, block {block}, {'K-sort' if sort else 'unsorted'}"
            kv_bytes = recipe.kv_bytes_per_token(adapter, args.seqlen)
            rows.append(_row(name, "none", result, bpe, kv_bytes))
            print(markdown_table(header, rows[-1:]).splitlines()[-1], flush=True)
            del candidate

    command = "benchmarks/bench_kv_methods.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if not isinstance(v, bool) and v is not None and v != []
    )
    print()
    print(stamp(command) + f" KV heads {h}, head_dim {d}.")
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
