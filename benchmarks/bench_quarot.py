"""QuaRot on the embedded model: the accuracy table of the QuaRot issue.

    python benchmarks/bench_quarot.py --windows 8 --calib wiki pydoc [--rows NAME ...]

Groups of 128 do not divide SmolLM2's width 576 = 2^6 x 9, so the grouped rows use 64 and 32.
WikiText-2 test, first ``--windows`` windows of 2048 tokens; calibration (GPTQ rows) on
``--calib-samples`` windows drawn from WikiText-2 windows >= 16 (never the evaluated ones) and,
as a second column, from the pydoc calibration text. Every row is evaluated in one pass per
window (the KV quantizers act on the whole window as it is attended to, per token). Rows print
as they finish. Columns: ppl, KL to fp, top-1, bits per weight, KV bytes per token, quantize
wall seconds and the process's peak resident memory while quantizing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PeakRSS,
    add_window_arguments,
    command_line,
    fmt,
    stamp,
    weight_calibrations,
)

from lowbit.api import (
    load_model,  # noqa: E402
    quantize,  # noqa: E402
)
from lowbit.data import eval_windows, load_corpus, tokenize  # noqa: E402
from lowbit.eval.evaluate import FloatReference, evaluate  # noqa: E402
from lowbit.eval.memory import memory_report  # noqa: E402
from lowbit.models.adapter import adapter_for  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402

# name -> (method, settings); quarot rows without "w_algo" use GPTQ
ROWS: dict[str, tuple[str, dict]] = {
    "fp": ("fp", {}),
    "rtn W4A4KV4 (no rotation)": ("quarot", {"rotation": "none", "w_algo": "rtn"}),
    "rtn W8A8KV8 (no rotation)": (
        "quarot",
        {"rotation": "none", "w_algo": "rtn", "w_bits": 8, "a_bits": 8, "kv_bits": 8},
    ),
    "rtn W6A6KV6 (no rotation)": (
        "quarot",
        {"rotation": "none", "w_algo": "rtn", "w_bits": 6, "a_bits": 6, "kv_bits": 6},
    ),
    "rtn W4A16 (no rotation)": (
        "quarot",
        {"rotation": "none", "w_algo": "rtn", "a_bits": 16, "kv_bits": 16},
    ),
    "quarot-rtn W8A8KV8": ("quarot", {"w_algo": "rtn", "w_bits": 8, "a_bits": 8, "kv_bits": 8}),
    "quarot-rtn W6A6KV6": ("quarot", {"w_algo": "rtn", "w_bits": 6, "a_bits": 6, "kv_bits": 6}),
    "quarot-rtn W4A4KV4": ("quarot", {"w_algo": "rtn"}),
    "quarot-rtn W4A16": ("quarot", {"w_algo": "rtn", "a_bits": 16, "kv_bits": 16}),
    "quarot-rtn W4A16 g64": (
        "quarot",
        {"w_algo": "rtn", "w_group": 64, "a_bits": 16, "kv_bits": 16},
    ),
    "quarot-rtn W4A4KV4 g64": ("quarot", {"w_algo": "rtn", "w_group": 64, "a_group": 64}),
    "quarot-rtn W4A16 random orthogonal": (
        "quarot",
        {"w_algo": "rtn", "a_bits": 16, "kv_bits": 16, "rotation": "random"},
    ),
    "quarot-gptq W8A8KV8": ("quarot", {"w_bits": 8, "a_bits": 8, "kv_bits": 8}),
    "quarot-gptq W6A6KV6": ("quarot", {"w_bits": 6, "a_bits": 6, "kv_bits": 6}),
    "quarot-gptq W4A4KV4": ("quarot", {}),
    "quarot-gptq W4A16": ("quarot", {"a_bits": 16, "kv_bits": 16}),
    "quarot-gptq W4A16 g64": ("quarot", {"w_group": 64, "a_bits": 16, "kv_bits": 16}),
    "quarot-gptq W4A4KV4 g32": ("quarot", {"w_group": 32, "a_group": 32}),
    "quarot-gptq W4A4KV4 g64": ("quarot", {"w_group": 64, "a_group": 64}),
    "quarot-gptq W4A4KV4 random orthogonal": ("quarot", {"rotation": "random"}),
    "quarot-gptq W4A4KV4 a_clip 0.75": ("quarot", {"a_clip_ratio": 0.75}),
    "quarot-gptq W4A4KV4 g64 a_clip 0.75": (
        "quarot",
        {"w_group": 64, "a_group": 64, "a_clip_ratio": 0.75},
    ),
    "quarot A6KV6 only": ("quarot", {"w_bits": 16, "a_bits": 6, "kv_bits": 6}),
    "quarot-gptq W6A16": ("quarot", {"w_bits": 6, "a_bits": 16, "kv_bits": 16}),
    "quarot K4V4 only": ("quarot", {"w_bits": 16, "a_bits": 16, "k_bits": 4, "v_bits": 4}),
    "quarot K4V2 only": ("quarot", {"w_bits": 16, "a_bits": 16, "k_bits": 4, "v_bits": 2}),
    "quarot K3V3 only": ("quarot", {"w_bits": 16, "a_bits": 16, "kv_bits": 3}),
    "quarot K2V2 only": ("quarot", {"w_bits": 16, "a_bits": 16, "kv_bits": 2}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser)
    parser.add_argument("--calib", nargs="+", default=["wiki", "pydoc"], choices=["wiki", "pydoc"])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), metavar="NAME")
    parser.add_argument(
        "--w-mse-clip",
        choices=["true", "false"],
        default="true",
        help="the weights' MSE clip search in every quarot row (the recipe's default: true)",
    )
    parser.add_argument("--jsonl", default=None, help="append one JSON object per row here")
    args = parser.parse_args()
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    torch.set_num_threads(args.threads)

    loaded = load_model(None)
    model, tokenizer = loaded.model, loaded.tokenizer
    wiki_tokens = tokenize(tokenizer, load_corpus(args.dataset).text)
    windows = eval_windows(wiki_tokens, args.seqlen, args.windows)
    calibrations = weight_calibrations(tokenizer, wiki_tokens, args.calib_samples, args.seqlen)
    reference = FloatReference(model)
    print(stamp(command_line()))
    print(
        f"{loaded.name}; {windows.shape[0]} windows x {args.seqlen} tokens of {args.dataset}; "
        f"GPTQ calibration {args.calib_samples} x {args.seqlen} tokens.\n"
    )
    print(
        "| row | calibration | ppl | KL | top-1 | bits/w | KV B/token | quantize s | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.rows:
        method, settings = ROWS[name]
        if method == "quarot":
            settings = {**settings, "w_mse_clip": args.w_mse_clip}
        recipe = get_recipe(method, **settings)
        calib_names = args.calib if recipe.needs_calibration else ["—"]
        for calib in calib_names:
            candidate = model if method == "fp" else copy.deepcopy(model)
            start = time.perf_counter()
            with PeakRSS() as peak:
                if method != "fp":
                    quantize(candidate, recipe, calibration=calibrations.get(calib), progress=False)
            seconds = time.perf_counter() - start
            result = evaluate(candidate, windows, reference=reference, progress=False)
            memory = memory_report(candidate, adapter_for(candidate), kv_context=args.seqlen)
            print(
                f"| {name} | {calib} | {result.ppl:.2f} | {fmt(result.kl, '.4f')} | "
                f"{fmt(result.top1, '.3f')} | {memory.bits_per_weight:.3f} | "
                f"{memory.kv_bytes_per_token:.0f} | {seconds:.0f} | {peak.mb:.0f} |",
                flush=True,
            )
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    record = {"row": name, "calibration": calib, "recipe": recipe.to_dict(),
                              "ppl": result.ppl, "kl": result.kl, "top1": result.top1,
                              "bits_per_weight": memory.bits_per_weight,
                              "kv_bytes_per_token": memory.kv_bytes_per_token,
                              "quantize_seconds": seconds, "peak_rss_mb": peak.mb}  # fmt: skip
                    f.write(json.dumps(record) + "\n")
            if candidate is not model:
                del candidate
                gc.collect()  # quantized models hold reference cycles (cache factories)


if __name__ == "__main__":
    main()
