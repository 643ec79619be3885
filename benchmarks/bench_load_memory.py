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

Writes a markdown table (stdout): checkpoint bytes, run-form bytes, peak RSS, peak minus
baseline, their ratios, and the decode tokens/s ``lowbit generate`` prints (over the steps
after the first new token).

``--gguf FILE`` (one per directory, in order) adds the peer: llama.cpp (``llama-cpp-python``,
a benchmark dependency, from ``--llama-cpp-venv`` or built there as ``bench_decode.py`` builds
it) on a GGUF of the same weights in a fresh process, the same prompt, greedy, all cores: its
peak RSS (the file is memory-mapped, so touched pages count) and decode tokens/s over
``--new-tokens`` steps after three warm-up tokens.

Usage::

    python benchmarks/bench_load_memory.py /work/scratch/smollm2-w4 /work/scratch/llama-1b-w4
    python benchmarks/bench_load_memory.py DIR --gguf FILE.gguf --llama-cpp-venv .venv
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import LLAMA_CHILD, LLAMA_CPP_VENV, llama_cpp_python  # noqa: E402

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


class ChildFailed(Exception):
    """A measured process exited with an error (the message ends with its stderr)."""


def run(command: list[str]) -> tuple[int, str, str]:
    """Run ``command`` in a fresh process; its peak RSS in bytes (``wait4``), stdout, stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise ChildFailed(f"{command[:4]} failed:\n{err.read().decode()[-2000:]}")
        return usage.ru_maxrss * 1024, out.read().decode(), err.read().decode()


def decode_speed(stderr: str) -> float | None:
    """The decode tokens/s of ``lowbit generate``'s summary line (None when it printed "-")."""
    found = re.search(r"decode (\S+) tokens/s", stderr)
    if found is None:
        raise SystemExit(f"lowbit generate printed no decode speed:\n{stderr[-2000:]}")
    return None if found.group(1) == "-" else float(found.group(1))


def measure(directory: Path, new_tokens: int) -> dict:
    python = sys.executable
    generate = [python, "-m", "lowbit", "generate", "--model", str(directory),
                "--max-new-tokens", str(new_tokens), "--prompt", PROMPT]  # fmt: skip
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
        "tokens_per_s": decode_speed(rows["generate"][2]),
    }


def measure_llama_cpp(path: Path, python: Path, new_tokens: int) -> dict:
    """llama.cpp on the GGUF ``path`` in a fresh process: peak RSS and decode tokens/s (a
    file it cannot run is reported, and the lowbit rows are kept)."""
    try:
        peak, stdout, _ = run(
            [str(python), "-c", LLAMA_CHILD, str(path), str(os.cpu_count() or 1), PROMPT,
             str(new_tokens)]
        )  # fmt: skip
    except ChildFailed as failed:
        print(failed, file=sys.stderr)
        return {"file": path.name, "file_bytes": path.stat().st_size,
                "error": str(failed).strip().splitlines()[-1][:160]}  # fmt: skip
    got = json.loads(stdout.strip().splitlines()[-1])
    return {"file": path.name, "file_bytes": path.stat().st_size, "peak_rss": peak,
            "tokens_per_s": got["tokens_per_s"]}  # fmt: skip


def table(results: list[dict]) -> str:
    lines = [
        "| model | checkpoint | files | run form | generate peak RSS | baseline | peak − baseline "
        "| peak / checkpoint | (peak − baseline) / run form | decode tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        model_rss = r["peak_rss"] - r["baseline_rss"]
        lines.append(
            f"| {r['model']} | {r['checkpoint_bytes'] / 2**20:,.0f} MiB | {r['shards']} "
            f"| {r['run_bytes'] / 2**20:,.0f} MiB | {r['peak_rss'] / 2**20:,.0f} MiB "
            f"| {r['baseline_rss'] / 2**20:,.0f} MiB | {model_rss / 2**20:,.0f} MiB "
            f"| {r['peak_rss'] / r['checkpoint_bytes']:.2f} | {model_rss / r['run_bytes']:.2f} "
            f"| {_speed(r['tokens_per_s'])} |"
        )
    peers = [r for r in results if "llama_cpp" in r]
    if peers:
        lines += [
            "",
            "| model | llama.cpp on | file | peak RSS | peak / file | decode tokens/s "
            "| lowbit ÷ llama.cpp tokens/s |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in peers:
            p = r["llama_cpp"]
            if "error" in p:
                lines.append(f"| {r['model']} | {p['file']} | failed: {p['error']} | | | | |")
                continue
            ratio = (
                "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}"
            )
            lines.append(
                f"| {r['model']} | {p['file']} | {p['file_bytes'] / 2**20:,.0f} MiB "
                f"| {p['peak_rss'] / 2**20:,.0f} MiB | {p['peak_rss'] / p['file_bytes']:.2f} "
                f"| {_speed(p['tokens_per_s'])} | {ratio} |"
            )
    return "\n".join(lines)


def _speed(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", help="saved lowbit checkpoints")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated (8)")
    parser.add_argument(
        "--gguf", action="append", default=[], metavar="FILE",
        help="llama.cpp's peer run on this GGUF of the same weights (one per directory, in order)",
    )  # fmt: skip
    parser.add_argument("--llama-cpp-venv", default=str(LLAMA_CPP_VENV), metavar="PATH")
    args = parser.parse_args(argv)
    if args.gguf and len(args.gguf) != len(args.directories):
        parser.error(f"{len(args.gguf)} --gguf files for {len(args.directories)} directories")
    try:
        results = [measure(Path(d).expanduser(), args.new_tokens) for d in args.directories]
    except ChildFailed as failed:
        raise SystemExit(str(failed)) from None
    if args.gguf:
        python = llama_cpp_python(Path(args.llama_cpp_venv))
        for result, gguf in zip(results, args.gguf, strict=True):
            result["llama_cpp"] = measure_llama_cpp(
                Path(gguf).expanduser(), python, args.new_tokens
            )
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
