"""Peak resident memory of ``lowbit generate`` on saved models, against their size on disk and
the size of the form they run in.

For each checkpoint directory given, three fresh processes:

* ``lowbit generate --model DIR --max-new-tokens 8`` (greedy, a short prompt), its peak RSS
  read from ``wait4`` (what ``/usr/bin/time -v`` reports as "Maximum resident set size");
* a baseline: the same imports and the tokenizer, no model (the interpreter, torch and
  transformers cost about 0.5 GB whatever the model);
* an in-process census: the model loaded and prepared as ``generate`` prepares it
  (``lowbit.models.run.prepare_run``), its run form's bytes counted (float parameters and
  buffers plus the kernels' layouts), each storage once.

Writes a markdown table (stdout, or ``--out``): checkpoint bytes, run-form bytes, peak RSS,
peak minus baseline, and their ratios.

Usage::

    python benchmarks/bench_load_memory.py /work/scratch/smollm2-w4 /work/scratch/llama-1b-w4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "The capital of France is"

BASELINE = """
import sys, resource
import torch, transformers, lowbit, lowbit.cli, lowbit.io.checkpoint, lowbit.models.run
import transformers.models.llama.modeling_llama
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1])
"""

CENSUS = """
import json, sys
import torch
from lowbit.io.checkpoint import load
from lowbit.models.run import prepare_run
from lowbit.nn.run_linear import RunLinear
model = load(sys.argv[1])
prepare_run(model)
seen, total = set(), 0
tensors = [*model.parameters(), *model.buffers()]
for module in model.modules():
    if isinstance(module, RunLinear):
        tensors += module.run_tensors()
for t in tensors:
    key = (t.untyped_storage().data_ptr(), t.storage_offset())
    if key not in seen:
        seen.add(key)
        total += t.numel() * t.element_size()
print(json.dumps({"run_bytes": total, "dtype": str(model.dtype)}))
"""


def run(command: list[str]) -> tuple[int, str]:
    """Run ``command`` in a fresh process; its peak RSS in bytes (``wait4``) and its stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"{command[:4]} failed:\n{err.read().decode()[-2000:]}")
        return usage.ru_maxrss * 1024, out.read().decode()


def measure(directory: Path) -> dict:
    python = sys.executable
    generate = [python, "-m", "lowbit", "generate", "--model", str(directory),
                "--max-new-tokens", "8", "--prompt", PROMPT]  # fmt: skip
    rows = {
        "generate": run(generate),
        "baseline": run([python, "-c", BASELINE, str(directory)]),
        "census": run([python, "-c", CENSUS, str(directory)]),
    }
    files = [p for p in directory.iterdir() if p.name.endswith(".safetensors")]
    census = json.loads(rows["census"][1].strip().splitlines()[-1])
    return {
        "model": directory.name,
        "checkpoint_bytes": sum(p.stat().st_size for p in files),
        "shards": len(files),
        "run_bytes": census["run_bytes"],
        "dtype": census["dtype"],
        "peak_rss": rows["generate"][0],
        "baseline_rss": rows["baseline"][0],
    }


def table(results: list[dict]) -> str:
    lines = [
        "| model | checkpoint | files | run form | generate peak RSS | baseline | peak − baseline "
        "| peak / checkpoint | (peak − baseline) / run form |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        model_rss = r["peak_rss"] - r["baseline_rss"]
        lines.append(
            f"| {r['model']} | {r['checkpoint_bytes'] / 2**20:,.0f} MiB | {r['shards']} "
            f"| {r['run_bytes'] / 2**20:,.0f} MiB | {r['peak_rss'] / 2**20:,.0f} MiB "
            f"| {r['baseline_rss'] / 2**20:,.0f} MiB | {model_rss / 2**20:,.0f} MiB "
            f"| {r['peak_rss'] / r['checkpoint_bytes']:.2f} | {model_rss / r['run_bytes']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", help="saved lowbit checkpoints")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    results = [measure(Path(d).expanduser()) for d in args.directories]
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
