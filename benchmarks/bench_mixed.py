"""The 2/4/16-bit mixed weights of Li et al., 2024 against GPTQ at 3 bits, and the paper's
ablations, on WikiText-2.

    python benchmarks/bench_mixed.py --calib wiki --rows gptq-w3-g64 mixed --json mixed.json
    python benchmarks/bench_mixed.py --table mixed.json     # the markdown table of a JSON
    python benchmarks/bench_mixed.py --clip-study           # scale clipping's 3-bit levels
    python benchmarks/bench_mixed.py --layer-study          # per-layer output errors
    python benchmarks/bench_mixed.py --bits                 # stored bits beside eq. 10

Protocol of ``bench_gptq.py``: the embedded model, WikiText-2 test, first ``--windows`` windows
of ``--seqlen`` tokens; calibration ``--calib-samples`` x ``--seqlen`` tokens from WikiText-2
windows >= 16 (never the evaluated ones) or from the pydoc calibration text, seed 0. Rows:

* ``gptq-w3-g64``: lowbit's GPTQ, 3-bit symmetric groups of 64 (``gptq`` recipe defaults:
  act-order, ``absmax_half`` scales, the RTN guard); ``gptq-w3-g64-asym`` with zero points;
  ``gptq-w2-g64``: 2-bit.
* ``mixed``: the ``mixed-2-4-16`` preset (25 % 4-bit groups by eq. 9, 0.2 % fp16 outliers in
  2-bit groups, g1 = g2 = 16, GPTQ); ``mixed-out0`` / ``mixed-out0.5`` with 0 % / 0.5 %
  outliers; ``mixed-10``: 10 % 4-bit groups; ``mixed-2bit``: no 4-bit groups and no outliers
  (2-bit GPTQ in the same format); ``mixed-rtn``: round to nearest (4-bit groups by the
  weights' energy); ``mixed-qat``: ``--qat-steps`` steps of QAT first.
* ``inter-25`` / ``inter-10`` (the paper's Table 4): whole matrices in 4 bits and the rest in
  2, the matrices ranked by their eq. 9 sensitivity per weight on the float model, as many as
  bring the 4-bit share of the weights closest to 25 % / 10 %; same format otherwise (2-bit
  matrices keep 0.2 % outliers, a 4-bit matrix has none).

Columns: perplexity, KL and top-1 agreement against the fp model, bits per weight of the block
linears with every stored bit counted (codes, scales, zeros, second order, group order,
outliers with their row pointers), the share of weights in 4-bit groups, quantize wall and
process CPU seconds. ``--json`` adds each row to the file as it finishes (rows already there
for the same calibration are kept, so a table can be built over several runs).
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
    command_line,
    fmt,
    markdown_table,
    stamp,
    weight_calibrations,
)

ROWS = [
    "gptq-w3-g64", "gptq-w3-g64-asym", "gptq-w2-g64", "mixed", "mixed-out0", "mixed-out0.5",
    "mixed-10", "mixed-2bit", "mixed-rtn", "inter-25", "inter-10", "mixed-qat",
]  # fmt: skip

MIXED_ROWS = {
    "mixed": {},
    "mixed-out0": {"outlier_fraction": 0.0},
    "mixed-out0.5": {"outlier_fraction": 0.005},
    "mixed-10": {"frac_4bit": 0.10},
    "mixed-2bit": {"frac_4bit": 0.0, "outlier_fraction": 0.0},
    "mixed-rtn": {"w_algo": "rtn"},
}
GPTQ_ROWS = {
    "gptq-w3-g64": {"w_bits": 3, "w_group": 64},
    "gptq-w3-g64-asym": {"w_bits": 3, "w_group": 64, "w_symmetric": False},
    "gptq-w2-g64": {"w_bits": 2, "w_group": 64},
}


def four_bit_share(model, adapter) -> float | None:
    """Share of the block linears' weights in 4-bit groups (None for non-mixed weights)."""
    from lowbit.formats.mixed import GROUP, MixedQuantized

    four = total = 0
    for name in adapter.linear_names():
        weight = model.get_submodule(name).quantized_weight
        if not isinstance(weight, MixedQuantized):
            return None
        n, k = weight.shape
        four += weight.n4 * GROUP * n
        total += n * k
    return four / total


def inter_layer_overrides(model, adapter, calibration, target: float, damp: float = 0.01):
    """``{layer name: {"frac_4bit": 1.0 or 0.0}}``: the matrices of largest eq. 9 sensitivity
    per weight (on the float model) in 4 bits, as many as bring the 4-bit share closest to
    ``target``, the others in 2."""
    from lowbit.algorithms.mixed import MixedWeightSpec
    from lowbit.algorithms.qat import choose_on_float

    choices = choose_on_float(
        model, adapter, calibration, lambda fqn: MixedWeightSpec(outlier_fraction=0.0),
        damp=damp,
    )  # fmt: skip
    sizes = {n: model.get_submodule(n).weight.numel() for n in choices}
    density = {n: float(c.sensitivity.sum()) / sizes[n] for n, c in choices.items()}
    ranked = sorted(choices, key=density.get, reverse=True)
    total = sum(sizes.values())
    best, share, best_gap = 0, 0.0, target
    for i, name in enumerate(ranked, 1):
        share += sizes[name] / total
        if abs(share - target) < best_gap:
            best, best_gap = i, abs(share - target)
    chosen = set(ranked[:best])
    return {n: {"frac_4bit": 1.0 if n in chosen else 0.0} for n in ranked}


def clip_study(threads: int) -> None:
    """Relative squared rounding error of RTN 2-bit groups (MSE range search) on six of the
    embedded model's weights, with the scale codes of triplet positions 1 and 2 restricted to
    each candidate set of eight 4-bit codes (``none``: all sixteen, no clipping)."""
    import math

    import lowbit.formats.mixed as formats
    from lowbit.api import load_model

    torch.set_num_threads(threads)
    model = load_model(None).model
    layers = model.model.layers
    weights = [layers[i].self_attn.q_proj.weight for i in (0, 10, 20)]
    weights += [layers[i].mlp.down_proj.weight for i in (0, 15, 29)]
    options = {
        "none (18 bits per triplet)": None,
        "odd codes 1, 3, ..., 15 (lowbit)": (1, 3, 5, 7, 9, 11, 13, 15),
        "even codes 0, 2, ..., 14": (0, 2, 4, 6, 8, 10, 12, 14),
        "range clipped to codes 0-7": (0, 1, 2, 3, 4, 5, 6, 7),
    }
    original = formats.CLIP_LEVELS, formats.second_order_quantize
    rows = []
    try:
        for label, levels in options.items():
            errors = []
            for weight in weights:
                w = weight.detach().float()
                is4 = torch.zeros(math.ceil(w.shape[1] / formats.GROUP), dtype=torch.bool)
                if levels is None:
                    formats.second_order_quantize = lambda s, g2, c=None: original[1](s, g2, None)
                else:
                    formats.CLIP_LEVELS = levels
                stats = formats.mixed_statistics(w, is4, mse_clip=True)
                codes, _ = formats.mixed_rtn(w, stats)
                n = w.shape[0]
                q = codes.view(n, -1, formats.GROUP).float()
                deq = ((q - stats.zero[..., None]) * stats.scale[..., None]).view(n, -1)
                errors.append(float((deq[:, : w.shape[1]] - w).square().sum() / w.square().sum()))
                formats.CLIP_LEVELS, formats.second_order_quantize = original
            rows.append([label, f"{sum(errors) / len(errors):.4f}"])
    finally:
        formats.CLIP_LEVELS, formats.second_order_quantize = original
    print(stamp(command_line()))
    print("Weights: q_proj of blocks 0, 10, 20 and down_proj of blocks 0, 15, 29; all groups "
          "2-bit, RTN with the MSE range search, g2 = 16.\n")  # fmt: skip
    print(markdown_table(["clipped scale codes", "mean relative squared error"], rows))


def layer_study(args) -> None:
    """Relative output error ``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)`` of six linears of the embedded model
    (q_proj, o_proj, down_proj of blocks 3 and 20; Hessians of the float model on 8 x 1024
    WikiText-2 tokens from windows >= 16) under the mixed format's variants and GPTQ's
    integer formats."""
    from lowbit.algorithms.gptq import gptq_quantize
    from lowbit.algorithms.int_spec import IntWeightSpec
    from lowbit.algorithms.mixed import MixedWeightSpec, choose_4bit_groups, mixed_quantize
    from lowbit.api import load_model
    from lowbit.calibrate.hessian import HessianCollector
    from lowbit.data import calibration_samples, load_corpus, tokenize

    torch.set_num_threads(args.threads)
    fp = load_model(None)
    tokens = tokenize(fp.tokenizer, load_corpus(args.dataset).text)
    calibration = calibration_samples(tokens, 8, 1024, seed=0, skip_windows=16)
    names = [f"model.layers.{i}.{n}" for i in (3, 20)
             for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]  # fmt: skip
    linears = {n: fp.model.get_submodule(n) for n in names}
    with HessianCollector(linears) as collector, torch.no_grad():
        for sample in calibration:
            collector.new_sample()
            fp.model(sample[None])
    spec = MixedWeightSpec()
    variants = {
        "mixed (GPTQ, static statistics, act-order)": lambda w, h: mixed_quantize(w, h, spec),
        "mixed, dynamic statistics, group act-order": lambda w, h: mixed_quantize(
            w, h, spec, dynamic=True),
        "mixed, no outliers": lambda w, h: mixed_quantize(
            w, h, MixedWeightSpec(outlier_fraction=0.0)),
        "mixed, no range search": lambda w, h: mixed_quantize(
            w, h, MixedWeightSpec(mse_clip=False)),
        "mixed, random 4-bit groups": lambda w, h: mixed_quantize(w, h, MixedWeightSpec(
            is4=choose_4bit_groups(torch.rand(-(-w.shape[1] // 16),
                                   generator=torch.Generator().manual_seed(0)), 0.25))),
        "mixed, RTN": lambda w, h: mixed_quantize(w, None, spec),
        "mixed, 2-bit only (no 4-bit groups, no outliers)": lambda w, h: mixed_quantize(
            w, h, MixedWeightSpec(frac_4bit=0.0, outlier_fraction=0.0)),
        "GPTQ W3 g64 sym": lambda w, h: gptq_quantize(w, h, IntWeightSpec(3, 64, True, False,
                                                                          "absmax_half")),
        "GPTQ W3 g64 asym": lambda w, h: gptq_quantize(w, h, IntWeightSpec(3, 64, False)),
        "GPTQ W2 g64 sym": lambda w, h: gptq_quantize(w, h, IntWeightSpec(2, 64, True, False,
                                                                          "absmax_half")),
    }  # fmt: skip
    rows = []
    for label, run in variants.items():
        errors, bits = [], []
        for name in names:
            w = linears[name].weight.detach().float()
            h = collector.accumulators[name].hessian("train")
            result = run(w, h)
            container = getattr(result, "quantized", None)
            delta = result.weight - w
            errors.append(float(((delta @ h) * delta).sum() / ((w @ h) * w).sum()))
            bits.append(container.storage_bits() / w.numel())
        rows.append([label, *(f"{e:.4f}" for e in errors), f"{sum(bits) / len(bits):.3f}"])
    print(stamp(command_line()))
    print("Hessians of the float model on 8 x 1024 WikiText-2 tokens (windows >= 16); relative "
          "output error per linear, mean bits per weight (every stored bit).\n")  # fmt: skip
    short = [n.replace("model.layers.", "").replace("self_attn.", "") for n in names]
    print(markdown_table(["format", *short, "bits"], rows))


def bits_table(threads: int) -> None:
    """Stored bits per weight by part (RTN on a random weight) beside eq. 10 and its CSR term,
    at the paper's settings (25 % 4-bit groups, 0.2 % outliers, g1 = g2 = 16) for 4096 x 4096
    and the embedded model's three shapes."""
    from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize
    from lowbit.formats.accounting import mixed_2_4_bits

    torch.set_num_threads(threads)
    parts = ["codes2", "codes4", "stats2", "second2", "outliers", "stats4", "second4", "order"]
    rows = []
    for n, k in ((4096, 4096), (576, 576), (1536, 576), (576, 1536)):
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
        q = mixed_quantize(weight, None, MixedWeightSpec()).quantized
        got = {p: v / (n * k) for p, v in q.bits_breakdown().items()}
        eq10_parts = sum(got[p] for p in parts[:5])
        formula = mixed_2_4_bits(rows=n, cols=k)
        rows.append([f"{n}x{k}", *(f"{got[p]:.4f}" for p in parts), f"{eq10_parts:.4f}",
                     f"{formula:.4f}", f"{eq10_parts - formula:+.4f}",
                     f"{q.bits_per_element():.4f}"])  # fmt: skip
    print(stamp(command_line()))
    print("RTN on a random weight; bits per weight of each stored part.\n")
    header = ["N x K", *parts, "eq. 10's parts", "eq. 10 + CSR", "alignment", "all stored"]
    print(markdown_table(header, rows))


def print_table(rows: list[dict], header_note: str = "") -> None:
    header = ["calibration", "method", "ppl", "KL", "top-1", "bits/weight", "4-bit share",
              "quantize s", "CPU s"]  # fmt: skip
    table = [
        [r["calib"], r["row"], fmt(r["ppl"], ".2f"), fmt(r["kl"], ".4f"), fmt(r["top1"], ".3f"),
         fmt(r["bits"], ".3f"), fmt(r.get("share4"), ".3f"), fmt(r["quantize_s"], ".0f"),
         fmt(r["quantize_cpu_s"], ".0f")]
        for r in rows
    ]  # fmt: skip
    if header_note:
        print(header_note)
    print(markdown_table(header, table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser)
    parser.add_argument("--calib", nargs="+", default=["wiki", "pydoc"], choices=["wiki", "pydoc"])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--rows", nargs="+", default=["gptq-w3-g64", "mixed"], choices=ROWS)
    parser.add_argument("--qat-steps", type=int, default=64)
    parser.add_argument("--qat-seqlen", type=int, default=512)
    parser.add_argument("--qat-lr", type=float, default=1e-4)
    parser.add_argument("--json", default=None, help="add each row to this file")
    parser.add_argument("--table", default=None, help="print the table of a JSON file and exit")
    parser.add_argument("--clip-study", action="store_true", help="the scale-clipping levels")
    parser.add_argument("--layer-study", action="store_true", help="per-layer output errors")
    parser.add_argument("--bits", action="store_true", help="stored bits beside eq. 10")
    args = parser.parse_args()
    if args.table:
        print_table(json.loads(Path(args.table).read_text()))
        return
    if args.clip_study:
        clip_study(args.threads)
        return
    if args.layer_study:
        layer_study(args)
        return
    if args.bits:
        bits_table(args.threads)
        return
    torch.set_num_threads(args.threads)

    from lowbit.api import load_model, quantize
    from lowbit.data import eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import FloatReference, evaluate
    from lowbit.eval.memory import linear_weight_bits
    from lowbit.models.adapter import adapter_for
    from lowbit.recipes.registry import get_recipe

    fp = load_model(None)
    tokens = tokenize(fp.tokenizer, load_corpus(args.dataset).text)
    windows = eval_windows(tokens, args.seqlen, args.windows)
    calibrations = weight_calibrations(fp.tokenizer, tokens, args.calib_samples, args.seqlen)
    reference = FloatReference(fp.model)
    fp_result = evaluate(fp.model, windows, reference=reference, progress=False)
    print(f"fp: ppl {fp_result.ppl:.2f} ({fp_result.seconds:.0f} s)", flush=True)
    out = Path(args.json) if args.json else None
    saved = json.loads(out.read_text()) if out is not None and out.exists() else []

    rows = []
    for calib in args.calib:
        calibration = calibrations[calib]
        for row in args.rows:
            model = load_model(None).model
            adapter = adapter_for(model)
            wall, cpu = time.perf_counter(), time.process_time()
            overrides = None
            if row in GPTQ_ROWS:
                recipe = get_recipe("gptq", **GPTQ_ROWS[row])
            elif row in MIXED_ROWS:
                recipe = get_recipe("mixed-2-4-16", **MIXED_ROWS[row])
            elif row == "mixed-qat":
                recipe = get_recipe(
                    "mixed-2-4-16", qat_steps=args.qat_steps, qat_seqlen=args.qat_seqlen,
                    qat_lr=args.qat_lr,
                )  # fmt: skip
            else:  # inter-25, inter-10
                target = int(row.split("-")[1]) / 100
                overrides = inter_layer_overrides(model, adapter, calibration, target)
                recipe = get_recipe("mixed-2-4-16", frac_4bit=0.0)
            quantize(model, recipe, calibration=calibration, overrides=overrides, progress=False)
            seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
            result = evaluate(model, windows, reference=reference, progress=False)
            bits, weights = linear_weight_bits(model, adapter)
            qat = getattr(model, "lowbit_qat_report", None)
            entry = {
                "calib": calib,
                "row": row,
                "recipe": recipe.to_dict(),
                "ppl": result.ppl,
                "kl": result.kl,
                "top1": result.top1,
                "bits": bits / weights,
                "share4": four_bit_share(model, adapter),
                "quantize_s": seconds,
                "quantize_cpu_s": cpu_seconds,
                "qat": None if qat is None else {
                    "steps": qat.steps, "seconds": qat.seconds,
                    "choose_seconds": qat.choose_seconds, "first_loss": qat.losses[0],
                    "last_loss": qat.losses[-1],
                },
                "calib_samples": args.calib_samples,
                "seqlen": args.seqlen,
                "windows": args.windows,
                "fp_ppl": fp_result.ppl,
                "command": command_line(),
                "date": time.strftime("%Y-%m-%d"),
            }  # fmt: skip
            rows.append(entry)
            print(json.dumps(entry), flush=True)
            if out is not None:
                saved = [r for r in saved if (r["calib"], r["row"]) != (calib, row)] + [entry]
                out.write_text(json.dumps(saved, indent=2))

    print(stamp(command_line()))
    print_table(
        rows,
        f"WikiText-2 first {args.windows} windows x {args.seqlen}, fp ppl {fp_result.ppl:.2f}; "
        f"calibration {args.calib_samples} x {args.seqlen} tokens.\n",
    )


if __name__ == "__main__":
    main()
