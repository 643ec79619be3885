"""Greedy decoding speed end to end: tokens/s at batch 1 and 16 and peak memory, per backend.

Every row runs in a fresh process: load the model, quantize it (RTN, packed, for lowbit rows),
prefill a fixed prompt into a transformers ``StaticCache``, then time ``--new-tokens`` greedy
steps (prefill excluded). tokens/s counts every sequence's tokens (batch x steps / seconds).
With ``--compile`` each row is also run with ``model.forward = torch.compile(model.forward)``
(default mode on CPU, ``reduce-overhead``, i.e. CUDA graphs, on GPU); a row whose compile
fails says so and keeps its eager figures; ``--compiled-only`` skips the eager runs. Peak
memory: on CPU the process's resident set sampled during decoding (after ``malloc_trim``, so
quantization's freed memory is not counted), on GPU ``torch.cuda.max_memory_allocated`` during
decoding.

CPU rows (``--shape smollm2``, the default): the embedded SmolLM2-135M in transformers fp32 and
bf16; lowbit W8 per channel and W4/W3/W2 g64 RTN-packed on each CPU backend that runs the
format, on the bf16 model (the torch-cpu kernels take bf16 activations; 2 and 3 bits run on the
int4 kernel) and W4 on the fp32 model (torch-cpu's exact path); SpQR and 2/4/16 decoded once
for the run; every lowbit row prepared as ``lowbit generate`` runs (:mod:`lowbit.models.run`); and llama.cpp on the same GGUF
file (Q4_1) with the same threads, through ``llama-cpp-python`` built from source in its own
virtual environment (``--llama-cpp-venv``, created when missing, ~5 minutes; a benchmark
dependency only). ``--shape 1b``: the same rows on a random-weight Llama of about 1B parameters
(hidden 2048, 16 layers, intermediate 5632, 32 heads, vocab 49152, untied head; 2.0 GB in
bf16), where reading the weights dominates a decode step. ``--readme``: the README's own
commands timed as a user runs them (``lowbit quantize`` then ``lowbit generate``, each a new
process), the float model beside the saved W4 model, tokens/s as ``lowbit generate`` prints.
"model MB" is what the model holds in memory while decoding (parameters, buffers and the
kernels' prepared layouts: :func:`lowbit.eval.memory.memory_in_use`); "peak MB" the process.

GPU rows (``--device cuda``): a 7B-shaped random-weight Llama (hidden 4096, intermediate 11008,
32 layers, 32 heads, vocab 32000) in fp16 against lowbit W8/W4/W3/W2 with ``auto`` backends,
W4 g128 (the format GPTQ 4-bit stores: its speed does not depend on how the codes were chosen,
so RTN codes stand in), SpQR (w3, 16/16, 1% and 0% outliers, random input permutations, fused
``triton`` kernels) and the 2/4/16 format of Li et al., 2024 (``mixed-2-4-16`` with RTN: 25 %
4-bit groups, 0.2 % fp16 outliers; its ``triton`` backend, asynchronous dequantization, outliers
fused). SpQR rows quantize without calibration (:func:`quantize_spqr`); on the CPU SpQR and
2/4/16 run on the bf16 SmolLM2 with ``torch-cpu`` (the weight decoded once) and ``reference``.

Cost (``--cost``, the paper's Table 3): while decoding, the GPU's energy counter (NVML,
``nvidia-ml-py``; its power readings, averaged, where the counter is missing) gives the mean
power and the energy per token; the cost per million tokens is ``seconds per token x
--gpu-hour-usd / 3600 + joules per token / 3.6e6 x --kwh-usd``, times 1e6. Defaults follow the
paper's method: a GPU's price over 5 years of service (an H100 at $30,000: $0.685 per hour) and
$0.09 per kWh.

Commands::

    python benchmarks/bench_decode.py --compile --out docs/results/decode.md      # CPU
    python benchmarks/bench_decode.py --device cuda --compile                      # GPU, 7B-shaped
    python benchmarks/bench_decode.py --device cuda --compile --rows fp16 "SpQR w3 1%" "SpQR w3 0%"
    python benchmarks/bench_decode.py --rows "transformers fp32" "SpQR w3 1%, torch-cpu" --no-llama-cpp
    python benchmarks/bench_decode.py --device cuda --compile --cost --new-tokens 256 \
        --rows fp16 "W4 g128 (GPTQ 4-bit format)" "2/4/16 mixed" --out docs/results/mixed_decode_gpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PeakRSS, command_line, markdown_table, stamp  # noqa: E402

LLAMA_CPP_VENV = Path("/tmp/lowbit-llamacpp-venv")
LLAMA_CPP_VERSION = "0.3.36"

# label -> (float dtype, (bits, group) or None, backend); None backend = transformers
CPU_ROWS = {
    "transformers fp32": ("float32", None, None),
    "transformers bf16": ("bfloat16", None, None),
    "W8 per-channel, torch-cpu": ("bfloat16", (8, None), "torch-cpu"),
    "W4 g64, torch-cpu": ("bfloat16", (4, 64), "torch-cpu"),
    "W3 g64, torch-cpu": ("bfloat16", (3, 64), "torch-cpu"),
    "W2 g64, torch-cpu": ("bfloat16", (2, 64), "torch-cpu"),
    "W4 g64, fp32 model, torch-cpu": ("float32", (4, 64), "torch-cpu"),
    "W3 g64, reference": ("bfloat16", (3, 64), "reference"),
    "W2 g64, reference": ("bfloat16", (2, 64), "reference"),
    "W8 per-channel, reference": ("bfloat16", (8, None), "reference"),
    "W4 g64, reference": ("bfloat16", (4, 64), "reference"),
    "SpQR w3 1%, torch-cpu": ("bfloat16", ("spqr", 0.01), "torch-cpu"),
    "SpQR w3 1%, reference": ("bfloat16", ("spqr", 0.01), "reference"),
    "2/4/16 mixed, torch-cpu": ("bfloat16", ("mixed", None), "torch-cpu"),
    "2/4/16 mixed, reference": ("bfloat16", ("mixed", None), "reference"),
}
GPU_ROWS = {
    "fp16": ("float16", None, None),
    "W4 g128 (GPTQ 4-bit format)": ("float16", (4, 128), "auto"),
    "2/4/16 mixed": ("float16", ("mixed", None), "auto"),
    "W8 per-channel": ("float16", (8, None), "auto"),
    "W4 g64": ("float16", (4, 64), "auto"),
    "W3 g64": ("float16", (3, 64), "auto"),
    "W2 g64": ("float16", (2, 64), "auto"),
    "SpQR w3 1%": ("float16", ("spqr", 0.01), "triton"),
    "SpQR w3 0%": ("float16", ("spqr", 0.0), "triton"),
}
SEVEN_B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
)  # fmt: skip
ONE_B = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=49152, max_position_embeddings=4096,
    tie_word_embeddings=False,
)  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


# -- one row, in a child process ------------------------------------------------------------------
def build_model(device: str, dtype_name: str, quant, backend, shape: str = "smollm2"):
    import torch

    import lowbit
    from lowbit.models.run import prepare_run
    from lowbit.nn.packed_linear import set_backend
    from lowbit.recipes.rtn import RTNRecipe

    dtype = getattr(torch, dtype_name)
    if device == "cpu" and shape == "smollm2":
        from lowbit.api import load_model

        loaded = load_model(None, dtype=dtype)
        model, tokenizer = loaded.model, loaded.tokenizer
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        config = LlamaConfig(**(ONE_B if shape == "1b" else SEVEN_B))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = None
    model.eval()
    if quant is not None and quant[0] == "spqr":
        quantize_spqr(model, quant[1], permute=device == "cuda")
        set_backend(model, backend)
    elif quant is not None:
        bits, group = quant
        if bits == "mixed":
            from lowbit.recipes.registry import get_recipe

            recipe = get_recipe("mixed-2-4-16", w_algo="rtn")
        else:
            recipe = RTNRecipe(w_bits=bits, w_group=group)
        lowbit.quantize(model, recipe, progress=False, packed=True)
        set_backend(model, backend)
    prepare_run(model)  # as lowbit generate runs it (lowbit.models.run): layouts made now
    return model, tokenizer


def quantize_spqr(model, fraction: float, permute: bool) -> None:
    """SpQR weights without calibration, packed (speed does not depend on calibration): the
    vectorised RTN with a tiny tau, so each layer's budget goes to its most salient weights
    without the bisection (minutes less on a 7B model). ``permute``: a random input
    permutation per layer, so the kernels gather their input as act-order's layers do (the
    7B-shaped model is random: its outputs mean nothing either way)."""
    import torch

    from lowbit.algorithms.spqr import SpQRSpec
    from lowbit.algorithms.weights import quantize_linears
    from lowbit.models.adapter import adapter_for
    from lowbit.nn.packed_linear import pack_model

    spec = SpQRSpec(outlier_fraction=fraction, tau=1e-12 if fraction else None)
    quantize_linears(model, adapter_for(model), spec_for=lambda fqn: spec, algo="rtn",
                     progress=False)  # fmt: skip
    if permute:
        generator = torch.Generator().manual_seed(0)
        for module in model.modules():
            weight = getattr(module, "quantized_weight", None)
            if weight is not None and hasattr(weight, "perm"):
                k = weight.shape[1]
                weight.perm = (
                    torch.randperm(k, generator=generator).to(torch.int16).to(weight.codes.device)
                )
    pack_model(model)


def prompt_ids(tokenizer, batch: int, prompt_tokens: int, vocab: int, device: str):
    import torch

    if tokenizer is None:
        ids = torch.randint(
            0, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(0)
        )
    else:
        ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
        ids = ids[:, :prompt_tokens]
    return ids.expand(batch, -1).contiguous().to(device)  # [B, P]


def decode(model, ids, new_tokens: int, step, cache) -> tuple[float, list[int]]:
    """Prefill ``ids`` [B, P] into ``cache`` (a StaticCache, emptied first), then time
    ``new_tokens`` greedy steps. Warm-up and timed runs share one cache object, so a compiled
    ``step`` is not compiled again for a new one inside the timed steps."""
    import torch

    batch, prompt = ids.shape
    cache.reset()
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(prompt, device=ids.device))  # fmt: skip
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        tokens = [int(token[0, 0])]
        sync(ids.device)
        start = time.perf_counter()
        for i in range(new_tokens):
            position = torch.tensor([prompt + i], device=ids.device)
            out = step(input_ids=token, past_key_values=cache, use_cache=True,
                       cache_position=position)  # fmt: skip
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token[0, 0]))
        sync(ids.device)
    return time.perf_counter() - start, tokens


class EnergyMeter:
    """Joules the GPU used while the block ran: NVML's energy counter (Volta and later), or its
    power readings sampled every 10 ms times the time. ``available`` is False without
    ``nvidia-ml-py`` (then ``joules`` stays None)."""

    def __init__(self, index: int = 0):
        self.joules = self.watts = None
        try:
            import pynvml
        except ImportError:
            self.available = False
            return
        self.available = True
        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def _counter(self):
        try:
            return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3  # mJ -> J
        except self.nvml.NVMLError:
            return None

    def __enter__(self):
        import threading

        if not self.available:
            return self
        self.samples: list[float] = []
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.01):
                self.samples.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3)  # W

        self._start_j, self._start_t = self._counter(), time.perf_counter()
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if not self.available:
            return
        self._stop.set()
        self._thread.join()
        seconds = time.perf_counter() - self._start_t
        end_j = self._counter()
        if self._start_j is not None and end_j is not None:
            self.joules = end_j - self._start_j
        elif self.samples:
            self.joules = sum(self.samples) / len(self.samples) * seconds
        self.watts = None if self.joules is None else self.joules / seconds


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_row(args) -> dict:
    import ctypes
    import gc

    import torch
    from transformers import StaticCache

    from lowbit.eval.memory import memory_in_use

    torch.set_num_threads(args.threads)
    dtype_name, quant, backend = (CPU_ROWS if args.device == "cpu" else GPU_ROWS)[args.row]
    model, tokenizer = build_model(args.device, dtype_name, quant, backend, args.shape)
    gc.collect()
    if args.device == "cpu":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    vocab = model.config.vocab_size
    result = {"row": args.row, "compile": args.compiled, "batches": {}}
    step = model.forward
    if args.compiled:
        mode = "reduce-overhead" if args.device == "cuda" else None
        step = torch.compile(model.forward, mode=mode)
    new_tokens = args.new_tokens if backend != "reference" else args.reference_tokens
    try:
        for batch in args.batches:
            ids = prompt_ids(tokenizer, batch, args.prompt_tokens, vocab, args.device)
            cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens + 1)
            if args.compiled:  # the kernels tune eagerly, outside CUDA graphs' warm-up
                decode(model, ids, 2, model.forward, cache)
            decode(model, ids, 3, step, cache)  # warm-up (and compile)
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            meter = None
            if args.cost and args.device == "cuda":
                meter = EnergyMeter(torch.cuda.current_device())
            with PeakRSS() as peak:
                if meter is not None:
                    with meter:
                        seconds, tokens = decode(model, ids, new_tokens, step, cache)
                else:
                    seconds, tokens = decode(model, ids, new_tokens, step, cache)
            memory = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else peak.mb
            result["batches"][batch] = {
                "tokens_per_s": batch * new_tokens / seconds,
                "new_tokens": new_tokens,
                "peak_mb": memory,
                "model_mb": memory_in_use(model) / 2**20,
                "first_tokens": tokens[:8],
            }
            if meter is not None and meter.joules is not None:
                result["batches"][batch]["watts"] = meter.watts
                result["batches"][batch]["joules_per_token"] = meter.joules / (batch * new_tokens)
            elif meter is not None:
                result["batches"][batch]["cost_note"] = (
                    "NVML gave no energy or power reading"
                    if meter.available
                    else "nvidia-ml-py is not installed"
                )
    except Exception as err:  # a compile failure is a result, not a crash
        if not args.compiled:
            raise
        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return result


# -- llama.cpp, in its own virtual environment ----------------------------------------------------
LLAMA_CHILD = r"""
import json, sys, time, resource
from llama_cpp import Llama
path, threads, prompt, new_tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512,
            n_batch=512, verbose=False, seed=0)
ids = llm.tokenize(prompt.encode(), add_bos=False)
def run(n):
    llm.reset()
    llm.eval(ids)  # prefill
    start = time.perf_counter()
    for _ in range(n):
        token = llm.sample(temp=0.0)
        llm.eval([token])
    return time.perf_counter() - start
run(3)
seconds = run(new_tokens)
print(json.dumps({"tokens_per_s": new_tokens / seconds, "new_tokens": new_tokens,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def llama_cpp_python(venv: Path) -> Path:
    """The venv's python with llama-cpp-python built from source; built here if missing."""
    python = venv / "bin/python"
    if python.exists() and subprocess.run([python, "-c", "import llama_cpp"]).returncode == 0:
        return python
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source in {venv} (~5 minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    subprocess.run([python, "-m", "pip", "install", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, env=env)  # fmt: skip
    return python


def run_llama_cpp(args) -> dict:
    from lowbit.models.loader import embedded_gguf_path

    python = llama_cpp_python(Path(args.llama_cpp_venv))
    result = {"row": "llama.cpp Q4_1 (same GGUF)", "compile": False, "batches": {}}
    prompt = PROMPT
    out = subprocess.run(
        [python, "-c", LLAMA_CHILD, str(embedded_gguf_path()), str(args.threads), prompt,
         str(args.new_tokens)],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode:
        result["error"] = out.stderr.strip().splitlines()[-1][:160]
    else:
        result["batches"][1] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- the table ------------------------------------------------------------------------------------
def child(args, row: str, compiled: bool) -> dict:
    argv = [sys.executable, __file__, "--row", row, "--device", args.device,
            "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
            "--reference-tokens", str(args.reference_tokens),
            "--prompt-tokens", str(args.prompt_tokens), "--shape", args.shape,
            "--batches", *map(str, args.batches)]  # fmt: skip
    if compiled:
        argv.append("--compiled")
    if args.cost:
        argv.append("--cost")
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"row": row, "compile": compiled, "batches": {}, "error": tail[:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def usd_per_million(got: dict, gpu_hour_usd: float, kwh_usd: float) -> float | None:
    """Li et al.'s eq. 11 per token: GPU time at ``gpu_hour_usd`` plus energy at ``kwh_usd``."""
    if "joules_per_token" not in got:
        return None
    seconds = 1.0 / got["tokens_per_s"]
    return 1e6 * (seconds * gpu_hour_usd / 3600 + got["joules_per_token"] / 3.6e6 * kwh_usd)


def table(results: list[dict], batches: list[int], cost: tuple[float, float] | None = None) -> str:
    """Speeds as ratios to the dense rows (transformers fp32 and bf16 on the CPU, fp16 on the
    GPU) of the same compile setting (eager when that one is missing); model and peak memory;
    with ``cost`` (``$/GPU-hour``, ``$/kWh``) the power, energy and cost columns."""
    dense_names = [n for n in ("transformers fp32", "transformers bf16", "fp16")
                   if any(r["row"] == n for r in results)]  # fmt: skip
    short = {n: n.removeprefix("transformers ") for n in dense_names}
    header = ["row", "compile"]
    for b in batches:
        header += [f"tok/s B={b}", *(f"x {short[n]} B={b}" for n in dense_names),
                   f"model MB B={b}", f"peak MB B={b}"]  # fmt: skip
        if cost is not None:
            header += [f"W B={b}", f"J/token B={b}", f"$/Mtok B={b}"]

    def base(name: str, compiled: bool) -> dict | None:
        rows = [r for r in results if r["row"] == name and r["batches"]]
        return next((r for r in rows if r["compile"] == compiled), None) or next(
            (r for r in rows if not r["compile"]), None
        )

    lines = []
    for r in results:
        cells = [r["row"], "yes" if r["compile"] else "no"]
        for b in batches:
            got = r["batches"].get(b) or r["batches"].get(str(b))
            if got is None:
                cells += ["—"] * (3 + len(dense_names) + (3 if cost is not None else 0))
                continue
            cells.append(f"{got['tokens_per_s']:.1f}")
            for name in dense_names:
                ref = base(name, r["compile"])
                ref = ref and (ref["batches"].get(b) or ref["batches"].get(str(b)))
                cells.append(f"{got['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "—")
            model_mb = got.get("model_mb")
            cells += ["—" if model_mb is None else f"{model_mb:.0f}", f"{got['peak_mb']:.0f}"]
            if cost is not None:
                usd = usd_per_million(got, *cost)
                cells += [
                    f"{got['watts']:.0f}" if "watts" in got else "—",
                    f"{got['joules_per_token']:.2f}" if "joules_per_token" in got else "—",
                    "—" if usd is None else f"{usd:.3f}",
                ]
        if r.get("error"):
            cells[1] += f" (failed: {r['error']})"
        lines.append(cells)
    return markdown_table(header, lines)


# -- the README's commands, as a user runs them ---------------------------------------------------
README_QUANTIZE = ["quantize", "--recipe", "w4a16-g64-gptq", "--calib-samples", "8",
                   "--calib-seqlen", "512", "--no-progress"]  # fmt: skip
README_PROMPT = "Once upon a time, in a small village by the sea,"


def run_readme(args) -> str:
    """``lowbit quantize`` (the README's recipe) then ``lowbit generate`` on the float model and
    on the saved one, each a new process with ``--threads`` threads; tokens/s as the command
    prints them (decode, prefill apart), seconds as the user waits (load included)."""
    import re
    import tempfile

    lowbit = [sys.executable, "-m", "lowbit"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        saved = str(Path(tmp) / "smollm2-w4")
        start = time.perf_counter()
        subprocess.run([*lowbit, *README_QUANTIZE, "--out", saved], check=True, env=env,
                       capture_output=True)  # fmt: skip
        quantize_s = time.perf_counter() - start
        for label, model in (("float model (fp32)", []), ("saved W4 g64 GPTQ", ["--model", saved])):
            argv = [*lowbit, "generate", *model, "--prompt", README_PROMPT,
                    "--max-new-tokens", str(args.readme_tokens)]  # fmt: skip
            start = time.perf_counter()
            out = subprocess.run(argv, check=True, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            found = re.search(r"(\d+) new tokens;.*decode ([\d.]+) tokens/s in (\w+)", out.stderr)
            rows.append([label, found.group(3), found.group(1), found.group(2), f"{seconds:.1f}"])
    ratio = float(rows[1][3]) / float(rows[0][3])
    header = ["lowbit generate", "runs in", "new tokens", "decode tok/s", "command s"]
    return (
        f"README path: `lowbit {' '.join(README_QUANTIZE)} --out DIR` took {quantize_s:.0f} s; "
        f"then `lowbit generate [--model DIR] --prompt {README_PROMPT!r} --max-new-tokens "
        f"{args.readme_tokens}`: the saved W4 model decodes at {ratio:.2f}x the float "
        f"model.\n\n{markdown_table(header, rows)}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reference-tokens", type=int, default=8,
                        help="steps for reference-backend rows (they are slow)")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument(
        "--shape",
        default="smollm2",
        choices=["smollm2", "1b"],
        help="CPU model: the embedded SmolLM2 or a random 1B-shaped Llama",
    )
    parser.add_argument(
        "--readme",
        action="store_true",
        help="also time the README's quantize + generate commands (CPU)",
    )
    parser.add_argument("--readme-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rows", nargs="+", default=None, help="row labels (default: all)")
    parser.add_argument("--compile", action="store_true", help="also run each row compiled")
    parser.add_argument(
        "--compiled-only",
        action="store_true",
        help="run each row compiled only (on a GPU eager decoding measures Python, not kernels)",
    )
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--llama-cpp-venv", default=str(LLAMA_CPP_VENV), metavar="PATH")
    parser.add_argument(
        "--cost",
        action="store_true",
        help="GPU: power, energy per token and cost per million tokens (NVML)",
    )
    parser.add_argument(
        "--gpu-hour-usd",
        type=float,
        default=30000 / (5 * 365 * 24),
        help="GPU price per hour (default: an H100 at $30,000 over 5 years)",
    )
    parser.add_argument("--kwh-usd", type=float, default=0.09, help="electricity per kWh")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_row(args)))
        return
    import torch

    torch.set_num_threads(args.threads)  # what the stamp reports: each row's process sets it
    load_before = os.getloadavg()[0]
    rows = args.rows or list(CPU_ROWS if args.device == "cpu" else GPU_ROWS)
    results = []
    for row in rows:
        modes = [True] if args.compiled_only else [False, True] if args.compile else [False]
        if "reference" in row:
            modes = [False]  # the reference dequantizes every call: compile is measured apart
        for compiled in modes:
            results.append(child(args, row, compiled))
            print(json.dumps(results[-1]), flush=True)
    if args.device == "cpu" and args.shape == "smollm2" and not args.no_llama_cpp:
        results.append(run_llama_cpp(args))
        print(json.dumps(results[-1]), flush=True)
    readme = run_readme(args) if args.readme and args.device == "cpu" else ""
    cost = (args.gpu_hour_usd, args.kwh_usd) if args.cost else None
    prices = (
        f" Cost: ${args.gpu_hour_usd:.3f} per GPU-hour and ${args.kwh_usd:.3f} per kWh."
        if args.cost else ""
    )  # fmt: skip
    text = (
        f"{stamp(command_line())} Load average (1 min) {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after.{prices}\n\n{table(results, args.batches, cost)}\n"
        + (f"\n{readme}" if readme else "")
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
