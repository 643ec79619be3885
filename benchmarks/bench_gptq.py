"""GPTQ against round-to-nearest (and, opt-in, llm-compressor's GPTQ) on WikiText-2.

    python benchmarks/bench_gptq.py --windows 8 --calib wiki pydoc --groups none 64 \\
        --rows rtn gptq gptq-guard [--peer]

Weights W4A16 symmetric, per output channel (``none``) or in groups of 64; calibration 32 x
2048 tokens either from the evaluated text itself (windows >= 16, never the evaluated ones:
``calibration_samples(tokens, 32, 2048, seed=0, skip_windows=16)``) or from the pydoc
calibration text. Rows: RTN, RTN with the absmax_half scale (``rtn-half``), GPTQ (all samples
in the Hessians, no guard), GPTQ + guard (1/8 of the samples held out; per layer the smaller
held-out output error wins). Columns: ppl,
KL to the fp model, quantize wall seconds (and process CPU seconds), guard wins.

``--peer`` also runs llm-compressor's GPTQModifier (W4A16, same group size, same calibration
tokens, same model directory) in its own virtual environment (it pins its own transformers),
then evaluates the weights it produced here, on the same windows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
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
from lowbit.recipes.registry import get_recipe  # noqa: E402

PEER_VENV = Path("/tmp/llmc-venv")

# Runs inside the peer's venv: GPTQ with llm-compressor, then dump the dequantized weights.
PEER_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationScheme, QuantizationStrategy)

    model_dir, tokens_path, group, out_path = sys.argv[1:5]
    torch.set_num_threads(int(sys.argv[5]))
    tokens = load_file(tokens_path)["tokens"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True,
        strategy=QuantizationStrategy.CHANNEL if group == "none" else QuantizationStrategy.GROUP,
        group_size=None if group == "none" else int(group))
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"],
                          block_size=128, dampening_frac=0.01, actorder="static")
    data = Dataset.from_dict({"input_ids": tokens.tolist(),
                              "attention_mask": torch.ones_like(tokens).tolist()})
    start, cpu_start = time.perf_counter(), time.process_time()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(tokens),
            max_seq_length=tokens.shape[1])
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    state = {n: m.weight.detach().float().contiguous() for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    save_file(state, out_path, metadata={"seconds": str(seconds), "cpu_seconds": str(cpu_seconds)})
    """
)


def peer_gptq(model_dir: Path, tokens: torch.Tensor, group: int | None, threads: int, workdir):
    """llm-compressor GPTQ in its own venv -> ({linear name: dequantized weight}, wall seconds,
    process CPU seconds)."""
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        pip = [str(PEER_VENV / "bin" / "pip"), "install", "-q"]
        subprocess.run(pip + ["torch==2.13.0", "llmcompressor"], check=True)
    from safetensors import safe_open
    from safetensors.torch import save_file

    tokens_path, script, out = workdir / "tokens.st", workdir / "peer.py", workdir / "peer.st"
    save_file({"tokens": tokens.contiguous()}, str(tokens_path))
    script.write_text(PEER_SCRIPT)
    group_arg = "none" if group is None else str(group)
    command = [str(python), str(script), str(model_dir), str(tokens_path), group_arg, str(out)]
    subprocess.run(command + [str(threads)], check=True)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        weights = {k: f.get_tensor(k) for k in f.keys()}
    return weights, float(meta["seconds"]), float(meta["cpu_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser)
    parser.add_argument("--calib", nargs="+", default=["wiki", "pydoc"], choices=["wiki", "pydoc"])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--groups", nargs="+", default=["none", "64"])
    parser.add_argument(
        "--rows", nargs="+", default=["rtn", "gptq", "gptq-guard"],
        choices=["rtn", "rtn-half", "gptq", "gptq-guard"],
    )  # fmt: skip
    parser.add_argument("--no-sequential", action="store_true", help="one pass per block")
    parser.add_argument("--peer", action="store_true", help="also run llm-compressor's GPTQ")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    fp = load_model(None)
    text = load_corpus(args.dataset).text
    tokens = tokenize(fp.tokenizer, text)
    windows = eval_windows(tokens, args.seqlen, args.windows)
    calibrations = weight_calibrations(fp.tokenizer, tokens, args.calib_samples, args.seqlen)
    reference = FloatReference(fp.model)
    fp_result = evaluate(fp.model, windows, reference=reference, progress=False)
    print(f"fp: ppl {fp_result.ppl:.2f} ({fp_result.seconds:.0f} s)", flush=True)

    rows = []
    for calib in args.calib:
        for group_text in args.groups:
            group = None if group_text == "none" else int(group_text)
            for row in args.rows + (["llm-compressor"] if args.peer else []):
                rtn = row.startswith("rtn")
                if rtn and calib != args.calib[0]:
                    continue  # RTN does not calibrate: one row per group is enough
                model = load_model(None).model
                wall, cpu = time.perf_counter(), time.process_time()
                wins = "—"
                if row == "llm-compressor":
                    import tempfile

                    with tempfile.TemporaryDirectory() as tmp:
                        weights, seconds, cpu_seconds = peer_gptq(
                            Path(_model_dir()), calibrations[calib], group, args.threads, Path(tmp)
                        )
                    with torch.no_grad():
                        for name, weight in weights.items():
                            model.get_submodule(name).weight.copy_(weight)
                else:
                    settings = {"w_bits": 4, "w_group": group}
                    if row == "rtn-half":
                        settings["w_scale_rule"] = "absmax_half"
                    elif row != "rtn":
                        settings.update(
                            guard=row == "gptq-guard", sequential=not args.no_sequential
                        )
                    recipe = get_recipe("rtn" if rtn else "gptq", **settings)
                    quantize(
                        model, recipe,
                        calibration=None if rtn else calibrations[calib],
                        progress=False,
                    )  # fmt: skip
                    seconds = time.perf_counter() - wall
                    cpu_seconds = time.process_time() - cpu
                    report = getattr(model, "lowbit_weight_report", None)
                    if report is not None and row == "gptq-guard":
                        wins = " ".join(f"{k}:{v}" for k, v in sorted(report.wins().items()))
                        print(report.summary(), flush=True)
                result = evaluate(model, windows, reference=reference, progress=False)
                entry = {
                    "calib": "—" if rtn else calib,
                    "group": group_text,
                    "row": row,
                    "ppl": result.ppl,
                    "kl": result.kl,
                    "quantize_s": seconds,
                    "quantize_cpu_s": cpu_seconds,
                    "wins": wins,
                }
                rows.append(entry)
                print(json.dumps(entry), flush=True)

    command = "python benchmarks/bench_gptq.py " + " ".join(sys.argv[1:])
    print(stamp(command.strip()))
    print(
        f"WikiText-2 ({args.dataset}) first {args.windows} windows x {args.seqlen}, fp ppl "
        f"{fp_result.ppl:.2f}; calibration {args.calib_samples} x {args.seqlen} tokens; W4A16 "
        f"symmetric; {'one pass per block' if args.no_sequential else 'sequential'}.\n"
    )
    header = ["calibration", "group", "method", "ppl", "KL", "quantize s", "CPU s", "guard wins"]
    table = [
        [r["calib"], r["group"], r["row"], fmt(r["ppl"], ".2f"), fmt(r["kl"], ".4f"),
         fmt(r["quantize_s"], ".0f"), fmt(r["quantize_cpu_s"], ".0f"), r["wins"]]
        for r in rows
    ]  # fmt: skip
    print(markdown_table(header, table))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def _model_dir() -> str:
    """The embedded model's safetensors cache directory (what the peer loads)."""
    import os

    cache = Path(os.environ.get("LOWBIT_CACHE", Path.home() / ".cache" / "lowbit"))
    found = sorted(cache.glob("gguf-v1-*/model.safetensors"))
    if not found:
        raise SystemExit(f"no embedded model cache under {cache}; run `lowbit eval` once first")
    return str(found[0].parent)


if __name__ == "__main__":
    main()
