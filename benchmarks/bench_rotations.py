"""Learned rotations against QuaRot's random Hadamard on the embedded model, side by side.

    python benchmarks/bench_rotations.py --windows 8 --calib-samples 16 --calib wiki pydoc \
        --bits W4A4KV4 [--steps 300 --train-seqlen 256]

For each calibration corpus (WikiText-2 windows >= 16, or the pydoc calibration text; both
``--calib-samples`` x 2048 tokens drawn with seed 0) and each bit setting: QuaRot's rotation
(``rotate``) and the learned one, trained on that calibration text (``learn-rotate``: R1 and R2
alone; ``learn-rotate-clip``: with ``learn_clip``, one activation clip learned per layer and
point; ``learn-rotate-scale``: with the clips and ``learn_scale``, a scale per channel of each
down_proj input; ``learn-rotate-weights``: with those and ``learn_weights``, the block linears'
weights fine-tuned in the same loop), each with RTN and GPTQ weights (``+rtn+kv-int`` /
``+gptq+kv-int``, QuaRot's settings: symmetric per-channel weights with the MSE clip, per-token
activations clipped at 0.9 unless learned and a KV cache clipped at 0.95 at 4 bits or fewer, keys
Hadamard-rotated after RoPE).
Every model is evaluated on both WikiText-2 test (first ``--windows`` windows of ``--seqlen``)
and the pydoc evaluation text (first ``--pydoc-windows`` windows), so each calibration is also
measured on the other corpus. The weights stay float in the training loop (``--train-w-bits
4``: the RTN rows' weights are quantized there; at W4A16, where nothing else is, every learned
row's are); rows whose loop is the same share one training (the second row's "train s" says it
resumed at the last step). Rows print as they finish.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PeakRSS,
    add_window_arguments,
    command_line,
    fmt,
    machine,
    stamp,
    weight_calibrations,
)

from lowbit.api import load_model, quantize  # noqa: E402
from lowbit.data import eval_windows, load_corpus, tokenize  # noqa: E402
from lowbit.eval.evaluate import FloatReference, evaluate  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402

#: bit setting -> (activation bits, KV bits; 16 = off); weights are 4-bit in every row
BITS = {"W4A4KV4": (4, 4), "W4A8KV4": (8, 4), "W4A16": (16, 16)}
#: the rotations' rows, in order
ROTATIONS = (
    "rotate", "learn-rotate", "learn-rotate-clip", "learn-rotate-scale", "learn-rotate-weights"
)  # fmt: skip


def recipe_for(rotation: str, weights: str, bits: str, args):
    """One row's composed recipe with QuaRot's quantizer settings (the quarot recipe's: MSE
    weight clip, activations clipped at 0.9 at 4 bits, KV asymmetric with keys rotated after
    RoPE); a learned rotation at W4A16 has its weights in the loop (4 bits), nothing else to
    learn for."""
    a_bits, kv_bits = BITS[bits]
    learned = rotation.startswith("learn-rotate")
    settings = {"w_bits": 4, "w_mse_clip": True, "a_bits": a_bits}
    settings["a_clip_ratio"] = 0.9 if a_bits <= 4 else 1.0
    parts = ["learn-rotate" if learned else rotation, weights]
    if kv_bits != 16:
        parts.append("kv-int")
        settings.update(k_bits=kv_bits, v_bits=kv_bits, rotate_qk="hadamard", symmetric=False)
    if learned:
        settings.update(steps=args.steps, seqlen=args.train_seqlen)
        settings["learn_clip"] = rotation != "learn-rotate"
        settings["learn_scale"] = rotation in ("learn-rotate-scale", "learn-rotate-weights")
        settings["learn_weights"] = rotation == "learn-rotate-weights"
        settings["train_w_bits"] = args.train_w_bits if weights == "rtn" else 16
        settings["v_bits"] = kv_bits  # the loop's values quantized as the deployed cache's
        if a_bits == kv_bits == 16:  # weight-only: the weights are all the loop can see
            settings["train_w_bits"] = 4
        if args.lr is not None:
            settings["lr"] = args.lr
        if args.weight_lr is not None:
            settings["weight_lr"] = args.weight_lr
        if args.train_loss is not None:
            settings["train_loss"] = args.train_loss
        if args.lr_schedule is not None:
            settings["lr_schedule"] = args.lr_schedule
    return get_recipe("+".join(parts)).with_settings(**settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser)
    parser.add_argument("--pydoc-windows", type=int, default=8)
    parser.add_argument("--calib", nargs="+", default=["wiki", "pydoc"], choices=["wiki", "pydoc"])
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--bits", nargs="+", default=["W4A4KV4"], choices=list(BITS))
    parser.add_argument("--steps", type=int, default=300, help="learn-rotate training steps")
    parser.add_argument("--train-seqlen", type=int, default=256)
    parser.add_argument(
        "--rotations", nargs="+", default=["fp", "rotate", "learn-rotate-scale"],
        choices=["fp", *ROTATIONS],
        help="which rows to run (fp: the float row; learn-rotate-scale: the recipe's defaults)",
    )  # fmt: skip
    parser.add_argument(
        "--weights", nargs="+", default=["gptq", "rtn"], choices=["gptq", "rtn"],
        help="weight algorithms, in this order",
    )  # fmt: skip
    parser.add_argument(
        "--work", default=None,
        help="directory of the learned rotations' resume states (default: a temporary one); "
        "a rerun with the same one resumes the training",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=None, help="learn-rotate's lr (its default)")
    parser.add_argument(
        "--lr-schedule", default=None, choices=["constant", "cosine"],
        help="learn-rotate's lr_schedule (default: the recipe's)",
    )  # fmt: skip
    parser.add_argument(
        "--weight-lr", type=float, default=None,
        help="learn-rotate's weight_lr, for learn-rotate-weights (its default)",
    )  # fmt: skip
    parser.add_argument(
        "--train-w-bits", type=int, default=16, choices=[4, 16],
        help="learn-rotate's RTN rows: weights in the training loop at 4 bits (16: float)",
    )  # fmt: skip
    parser.add_argument(
        "--train-loss", default=None, choices=["kl", "ce"],
        help="learn-rotate's loss: KL to the float model or cross-entropy (default: the recipe's)",
    )  # fmt: skip
    parser.add_argument("--jsonl", default=None, help="append one JSON object per row here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(None)
    model, tokenizer = loaded.model, loaded.tokenizer
    wiki_tokens = tokenize(tokenizer, load_corpus(args.dataset).text)
    pydoc_tokens = tokenize(tokenizer, load_corpus("pydoc", part="eval").text)
    evals = {
        "wiki": eval_windows(wiki_tokens, args.seqlen, args.windows),
        "pydoc": eval_windows(pydoc_tokens, args.seqlen, args.pydoc_windows),
    }
    references = {name: FloatReference(model) for name in evals}
    calibrations = weight_calibrations(tokenizer, wiki_tokens, args.calib_samples, args.seqlen)
    print(stamp(command_line()))
    print(
        f"{loaded.name}; {machine()}; eval: WikiText-2 {evals['wiki'].shape[0]} x {args.seqlen}, "
        f"pydoc/eval {evals['pydoc'].shape[0]} x {args.seqlen}; calibration "
        f"{args.calib_samples} x {args.seqlen} tokens; learn-rotate {args.steps} steps of "
        f"{args.train_seqlen} tokens.\n"
    )
    print(
        "| bits | rotation | weights | calibration | wiki ppl | wiki KL | wiki top-1 | "
        "pydoc ppl | pydoc KL | pydoc top-1 | train s | quantize s | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def row(label_parts, candidate, seconds, training, peak_mb, recipe):
        """Evaluate ``candidate`` on both corpora and print (and record) its row."""
        train_seconds = None if training is None else training.seconds
        train_cell = fmt(train_seconds, ".0f")
        if training is not None and training.resumed_from == training.steps:
            train_cell = "(the row above's)"  # the same loop, resumed at its last step
        elif training is not None and training.resumed_from:  # seconds of the remaining steps
            train_cell += f" (steps {training.resumed_from}-{training.steps})"
        results = {
            name: evaluate(candidate, ids, reference=references[name], progress=False)
            for name, ids in evals.items()
        }
        cells = []
        for name in evals:
            r = results[name]
            cells += [f"{r.ppl:.2f}", fmt(r.kl, ".4f"), fmt(r.top1, ".3f")]
        print(
            f"| {' | '.join(label_parts)} | {' | '.join(cells)} | "
            f"{train_cell} | {seconds:.0f} | {peak_mb:.0f} |",
            flush=True,
        )
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                record = {
                    "row": label_parts,
                    "recipe": None if recipe is None else recipe.to_dict(),
                    **{f"{n}_{k}": getattr(r, k) for n, r in results.items()
                       for k in ("ppl", "kl", "top1")},
                    "train_seconds": train_seconds,
                    "resumed_from": training.resumed_from if training else None,
                    "quantize_seconds": seconds,
                    "peak_rss_mb": peak_mb,
                }  # fmt: skip
                f.write(json.dumps(record) + "\n")

    if "fp" in args.rotations:
        row(["16", "none", "fp", "—"], model, 0.0, None, 0.0, None)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-rotations-"))
    for bits in args.bits:
        for calib in args.calib:
            for rotation in [r for r in ROTATIONS if r in args.rotations]:
                for weights in args.weights:
                    label = [bits, rotation, weights, calib]
                    recipe = recipe_for(rotation, weights, bits, args)
                    # rows whose training is the same share it (the second resumes the first's)
                    loop_w_bits = recipe.parts[0].train_w_bits if rotation != "rotate" else 16
                    resume = work / f"{bits}-{calib}-{rotation}-w{loop_w_bits}"
                    candidate = copy.deepcopy(model)
                    start = time.perf_counter()
                    with PeakRSS() as peak:
                        quantize(
                            candidate, recipe, calibration=calibrations[calib], progress=False,
                            resume_dir=resume if rotation != "rotate" else None,
                        )  # fmt: skip
                    seconds = time.perf_counter() - start
                    training = getattr(candidate, "lowbit_rotation_training", None)
                    row(label, candidate, seconds, training, peak.mb, recipe)
                    del candidate
                    gc.collect()
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
