"""What quantizing costs at real sizes: time per stage and peak memory of a streamed run.

Runs :func:`lowbit.quantize_to_directory` (what ``lowbit quantize`` runs) on a float model
directory, streamed block by block, and prints a markdown table: seconds per stage (``load``:
reading the safetensors; ``forward``: capturing the first block's inputs, the blocks' forward
passes and the Hessians; ``solve``: RTN or GPTQ; ``pack``; ``write``: the shards), in total, per
block and per billion parameters, with the process's peak resident set (``VmHWM``). Each row
runs in a fresh process, so its peak is its own; its CPU seconds (user + system) beside the wall
time say what a shared machine's wall time hides.

Models of real shapes with random weights come from ``benchmarks/make_shaped_model.py``::

    python benchmarks/make_shaped_model.py --shape llama-1b --out /work/scratch/llama-1b
    python benchmarks/bench_scale.py --model /work/scratch/llama-1b --recipe w4a16-g64 \\
        --recipe gptq:w_group=128 --calib-samples 4 --calib-seqlen 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

STAGES = ("load", "forward", "solve", "pack", "write")


def peak_rss() -> int:
    """This process's peak resident set in bytes (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process (wall time on a shared machine is not)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_one(args) -> dict:
    """One row, in this process."""
    import torch

    from lowbit.api import quantize_to_directory
    from lowbit.data import calibration_samples, load_corpus, tokenize
    from lowbit.recipes.registry import get_recipe

    text = args.recipe[-1]  # a child row gets one
    name, _, settings = text.partition(":")
    values = dict(item.split("=", 1) for item in settings.split(",") if item)
    recipe = get_recipe(name, **values)
    corpus = load_corpus("pydoc", part="calibration") if recipe.needs_calibration else None

    def calibration(tokenizer):
        tokens = tokenize(tokenizer, corpus.text[: 4 * args.calib_samples * args.calib_seqlen * 8])
        return calibration_samples(tokens, args.calib_samples, args.calib_seqlen, seed=0)

    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        result = quantize_to_directory(
            args.model, recipe, Path(scratch) / "out",
            calibration=calibration if corpus is not None else None,
            calibration_shape=(args.calib_samples, args.calib_seqlen),
            stream=True, calib_dtype=getattr(torch, args.calib_dtype), progress=False,
        )  # fmt: skip
        return {
            "recipe": text,
            "seconds": result.seconds,
            "stages": result.stages,
            "parameters": result.memory.parameters,
            "bits_per_weight": result.bits_per_weight,
            "bytes_written": result.bytes_written,
            "peak_rss": peak_rss(),
            "cpu_seconds": _cpu_seconds(),
            "estimate": result.memory.streamed,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a float model directory (safetensors)")
    parser.add_argument("--recipe", action="append", default=[], metavar="NAME[:K=V,...]")
    parser.add_argument("--calib-samples", type=int, default=4)
    parser.add_argument("--calib-seqlen", type=int, default=256)
    parser.add_argument("--calib-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--scratch", default=None, help="where outputs are written (deleted)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child row
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    from common import command_line, machine

    import lowbit.models.adapter  # noqa: F401  (fail early on a bad environment)

    if args.scratch:
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    rows = []
    for recipe in args.recipe or ["w4a16-g64"]:
        command = [sys.executable, __file__, "--one", "--model", args.model, "--recipe", recipe,
                   "--calib-samples", str(args.calib_samples), "--calib-seqlen",
                   str(args.calib_seqlen), "--calib-dtype", args.calib_dtype]  # fmt: skip
        if args.scratch:
            command += ["--scratch", args.scratch]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{recipe}: {proc.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"`{command_line()}`; {machine()}\n")
    layers = _layers(args.model)
    head = (
        "| recipe | "
        + " | ".join(STAGES)
        + " | total s | CPU s | s/block | s per 1e9 params | peak RSS GB |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        stages = " | ".join(f"{row['stages'].get(s, 0.0):.1f}" for s in STAGES)
        billions = row["parameters"] / 1e9
        # load, forward, solve and pack happen per block (the embeddings' read is in load)
        per_block = sum(row["stages"].get(s, 0.0) for s in STAGES[:4]) / layers
        print(
            f"| {row['recipe']} | {stages} | {row['seconds']:.1f} | {row['cpu_seconds']:.0f} | "
            f"{per_block:.1f} | {row['seconds'] / billions:.1f} | {row['peak_rss'] / 1e9:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _layers(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]


if __name__ == "__main__":
    main()
