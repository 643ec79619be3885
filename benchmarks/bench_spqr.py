"""SpQR against round-to-nearest and GPTQ at 3 and 4 bits on WikiText-2, every bit counted.

    python benchmarks/bench_spqr.py --windows 8 --calib wiki --calib-samples 32 \\
        --json docs/results/spqr_accuracy.json

The project's protocol (docs/results/gptq.md): the embedded model, WikiText-2 test, first
``--windows`` windows of ``--seqlen`` tokens; calibration ``--calib-samples`` x ``--seqlen``
tokens from WikiText-2 windows >= 16 (never the evaluated ones) or from the pydoc calibration
text. Rows: fp; RTN and GPTQ at 4 bits in groups of 64 (symmetric, the GPTQ table's settings)
and at 3 bits in groups of 16 (asymmetric, integer zeros); SpQR (the ``spqr`` recipe: 3-bit
codes and statistics, beta 16/16, act-order) with 0%, 0.5%, 1% and 2% outliers, and with SpQR's
relative threshold tau = 0.2 (budget 10%). Columns: perplexity, KL and top-1 agreement against
the fp model, bits per weight counted from the stored tensors over every block linear (codes,
words, statistics, outliers with their offsets, permutations; SpQR's dense part is 4.0 bits per
weight in the 64-bit words of Crnčević's SpQR inference kernel, master's thesis, 2025) beside
the analytic count of the statistics (3.625 for SpQR), the share of outliers, and the wall
seconds of quantization. Each row is written to ``--json`` as it finishes, so an interrupted run
keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_window_arguments,
    fmt,
    markdown_table,
    stamp,
    weight_calibrations,
)

from lowbit.api import (
    load_model,  # noqa: E402
    quantize,  # noqa: E402
)
from lowbit.data import eval_windows, load_corpus, tokenize  # noqa: E402
from lowbit.eval.evaluate import FloatReference, evaluate  # noqa: E402
from lowbit.eval.memory import linear_weight_bits  # noqa: E402
from lowbit.formats.accounting import spqr_bits, two_order_bits  # noqa: E402
from lowbit.models.adapter import adapter_for  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402

#: row name -> (recipe, settings, analytic bits of the dense format)
ROWS = {
    "rtn-w4-g64": ("rtn", {"w_bits": 4, "w_group": 64}, 4 + 16 / 64),
    "rtn-w3-g16": ("rtn", {"w_bits": 3, "w_group": 16, "w_symmetric": False}, 3 + 19 / 16),
    "gptq-w4-g64": ("gptq", {"w_bits": 4, "w_group": 64}, 4 + 16 / 64),
    "gptq-w3-g16": ("gptq", {"w_bits": 3, "w_group": 16, "w_symmetric": False}, 3 + 19 / 16),
    "spqr-0%": ("spqr", {"outlier_fraction": 0.0}, spqr_bits()),
    "spqr-0.5%": ("spqr", {"outlier_fraction": 0.005}, spqr_bits()),
    "spqr-1%": ("spqr", {"outlier_fraction": 0.01}, spqr_bits()),
    "spqr-2%": ("spqr", {"outlier_fraction": 0.02}, spqr_bits()),
    "spqr-tau0.2": ("spqr", {"tau": 0.2, "outlier_fraction": 0.1}, spqr_bits()),
}
_ = two_order_bits  # the analytic counts above are its one-order form


def outlier_share(model, adapter) -> float | None:
    """Outliers over weights across the block linears (None without SpQR weights)."""
    nnz = weights = 0
    for name in adapter.linear_names():
        q = getattr(model.get_submodule(name), "quantized_weight", None)
        if q is None or not hasattr(q, "nnz"):
            return None
        nnz += q.nnz
        weights += q.shape[0] * q.shape[1]
    return nnz / weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser)
    parser.add_argument("--calib", default="wiki", choices=["wiki", "pydoc"])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--set", nargs="*", default=[], help="key=value for the spqr rows")
    parser.add_argument("--json", default=None, help="write the rows to this file as they finish")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    extra = dict(item.split("=", 1) for item in args.set)

    fp = load_model(None)
    adapter = adapter_for(fp.model)
    tokens = tokenize(fp.tokenizer, load_corpus(args.dataset).text)
    windows = eval_windows(tokens, args.seqlen, args.windows)
    calibration = weight_calibrations(fp.tokenizer, tokens, args.calib_samples, args.seqlen)[
        args.calib
    ]
    reference = FloatReference(fp.model)
    fp_result = evaluate(fp.model, windows, reference=reference, progress=False)
    fp_bits, _ = linear_weight_bits(fp.model, adapter)
    rows = [
        {"row": "fp", "ppl": fp_result.ppl, "kl": 0.0, "top1": 1.0, "bits": 32.0,
         "analytic": None, "outliers": None, "quantize_s": None}
    ]  # fmt: skip
    print(json.dumps(rows[0]), flush=True)

    for name in args.rows:
        method, settings, analytic = ROWS[name]
        if method == "spqr":
            settings = {**settings, **extra}
        model = load_model(None).model
        start = time.perf_counter()
        quantize(
            model, get_recipe(method, **settings),
            calibration=None if method == "rtn" else calibration, progress=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        result = evaluate(model, windows, reference=reference, progress=False)
        bits, weights = linear_weight_bits(model, adapter)
        entry = {
            "row": name, "settings": settings, "ppl": result.ppl, "kl": result.kl,
            "top1": result.top1, "bits": bits / weights, "analytic": analytic,
            "outliers": outlier_share(model, adapter), "quantize_s": seconds,
        }  # fmt: skip
        rows.append(entry)
        print(json.dumps(entry), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        del model

    command = "python benchmarks/bench_spqr.py " + " ".join(sys.argv[1:])
    print(stamp(command.strip()))
    print(
        f"WikiText-2 first {args.windows} windows x {args.seqlen}, fp ppl {fp_result.ppl:.2f}; "
        f"calibration {args.calib_samples} x {args.seqlen} tokens ({args.calib}).\n"
    )
    header = ["method", "ppl", "KL", "top-1", "bits/weight", "analytic", "outliers", "quantize s"]
    table = [
        [r["row"], fmt(r["ppl"], ".2f"), fmt(r["kl"], ".4f"), fmt(r["top1"], ".3f"),
         fmt(r["bits"], ".3f"), fmt(r["analytic"], ".3f"),
         "—" if r["outliers"] is None else f"{100 * r['outliers']:.2f}%",
         fmt(r["quantize_s"], ".0f")]
        for r in rows
    ]  # fmt: skip
    print(markdown_table(header, table))
    _ = fp_bits


if __name__ == "__main__":
    main()
