"""QuaRot ablations on the embedded model: the clip ratios by bit width, and where 4-bit
activations cost the most.

    python benchmarks/bench_quarot_ablation.py --windows 2

Weights stay in float (w_bits=16) so each row isolates one quantizer of the rotated model.

* Clip rows: activations (KV off) or KV (activations off) at 4, 6 and 8 bits, with the
  paper's clip (0.9 activations, 0.95 KV) and without. They set
  ``lowbit.recipes.base.CLIP_MAX_BITS``. Then 4-bit activations at tighter clips.
* Site rows: 4-bit activations at the input of one kind of linear only (per-layer overrides of
  ``lowbit.quantize``), then at all of them.

WikiText-2 test, first ``--windows`` windows of 2048 tokens, one pass per window.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_window_arguments, command_line, markdown_table, stamp  # noqa: E402

from lowbit.api import (
    load_model,  # noqa: E402
    quantize,  # noqa: E402
)
from lowbit.data import eval_windows, load_corpus, tokenize  # noqa: E402
from lowbit.eval.evaluate import FloatReference, evaluate  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402

FLOAT = dict(w_bits=16, a_bits=16, kv_bits=16)
SITES = {
    "q/k/v": ["*q_proj", "*k_proj", "*v_proj"],
    "o_proj": ["*o_proj"],
    "gate/up": ["*gate_proj", "*up_proj"],
    "down_proj": ["*down_proj"],
}


def _rows() -> list[tuple[str, dict, dict]]:
    """(name, recipe settings, per-layer overrides)."""
    rows = []
    for stream, clip_key, paper in (("A", "a", 0.9), ("KV", "kv", 0.95)):
        for bits in (4, 6, 8):
            for clip in (paper, 1.0):
                settings = {**FLOAT, f"{clip_key}_bits": bits, f"{clip_key}_clip_ratio": clip}
                rows.append((f"{stream}{bits}, clip {clip}", settings, {}))
    for clip in (0.85, 0.8, 0.75):
        rows.append((f"A4, clip {clip}", {**FLOAT, "a_bits": 4, "a_clip_ratio": clip}, {}))
    for site, patterns in SITES.items():
        rows.append((f"A4 at {site} only", FLOAT, {p: {"a_bits": 4} for p in patterns}))
    rows.append(("A4 everywhere", {**FLOAT, "a_bits": 4}, {}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser, windows=2)
    parser.add_argument("--only", nargs="*", default=None, help="rows whose name starts so")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(None)
    model = loaded.model
    tokens = tokenize(loaded.tokenizer, load_corpus(args.dataset).text)
    windows = eval_windows(tokens, args.seqlen, args.windows)
    reference = FloatReference(model)
    fp = evaluate(model, windows, reference=reference, progress=False)
    table = [["fp", f"{fp.ppl:.3f}", "0", "1.000"]]
    print(" | ".join(table[-1]), flush=True)
    for name, settings, overrides in _rows():
        if args.only is not None and not name.startswith(tuple(args.only)):
            continue
        recipe = get_recipe("quarot", **settings)
        candidate = quantize(copy.deepcopy(model), recipe, overrides=overrides, progress=False)
        result = evaluate(candidate, windows, reference=reference, progress=False)
        table.append([name, f"{result.ppl:.3f}", f"{result.kl:.4f}", f"{result.top1:.3f}"])
        print(" | ".join(table[-1]), flush=True)
        del candidate
        gc.collect()
    print()
    print(stamp(command_line()))
    print(
        f"{args.windows} WikiText-2 windows x {args.seqlen} tokens; rotated model, weights in float."
    )
    print()
    print(markdown_table(["quantizer (rotated, W16)", "ppl", "KL", "top-1"], table))


if __name__ == "__main__":
    main()
