"""The baseline table of docs/results/baseline.md: fp and round-to-nearest rows on WikiText-2.

    python benchmarks/baseline.py --dataset ../shared/data/wikitext-2-raw/wiki.test.raw --windows 8

Rows: fp, RTN W8A16, W4A16 per channel, W4A16 group 64, W8A8, W8A4, W4A4 (weights symmetric
per output channel unless grouped, activations symmetric per token at every block linear's
input). Every row is evaluated on the same windows against the fp model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_window_arguments, command_line, fmt, markdown_table, stamp  # noqa: E402

from lowbit.eval.run import evaluate_recipes  # noqa: E402

ROWS = ["fp", "w8a16", "w4a16", "w4a16-g64", "w8a8", "w8a4", "w4a4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser)
    parser.add_argument("--model", default=None)
    parser.add_argument("--recipes", nargs="*", default=ROWS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = evaluate_recipes(
        args.model, args.recipes, dataset=args.dataset, windows=args.windows,
        seqlen=args.seqlen, device="cuda" if torch.cuda.is_available() else "cpu",
        progress=False,
    )  # fmt: skip
    print(stamp(command_line()))
    print(
        f"Dataset: {rows[0]['dataset']}, {rows[0]['windows']} windows x {rows[0]['seqlen']} tokens.\n"
    )
    fp_ppl = rows[0]["ppl"]
    table = [
        [
            name,
            fmt(r["ppl"], ".2f"),
            fmt(r["ppl"] / fp_ppl, ".3f"),
            fmt(r["kl"], ".4f"),
            fmt(r["top1"], ".3f"),
            fmt(r["bits_per_weight"], ".3f"),
            fmt(r["model_bytes"] / 1e6, ".1f"),
            fmt(r["quantize_seconds"], ".1f"),
        ]
        for name, r in zip(args.recipes, rows, strict=True)
    ]
    header = ["recipe", "ppl", "ppl / fp", "KL", "top-1", "bits/weight", "model MB", "quantize s"]
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
