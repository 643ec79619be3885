"""The ``lowbit`` command line: eval, quantize, export, info, recipes, demo, generate.

Bad input ends with one sentence on stderr and exit status 2, never a traceback; files are
written under a temporary name and renamed, so nothing half-written is left behind (SIGTERM
and Ctrl-C too end with one sentence, exit status 143 and 130). This module parses options and
prints; the work is the library's (:mod:`lowbit.eval.run` for eval and demo).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import threading
from pathlib import Path

from lowbit.errors import LowbitError

# Every method but spqr and mixed (their calibration alone takes longer), at sizes that keep
# `lowbit demo` under 5 minutes on 2 CPU cores.
DEMO_RECIPES = (
    "fp",
    "w8a16",
    "w4a16-g64",
    "w8a8",
    "w4a4",
    "w4a16-g64-gptq",
    "quarot-rtn",
    "kv-int",
    "kivi",
    "kvquant",
    "ksort-bfp",
)
DEMO_SEQLEN = 512
DEMO_WINDOWS = 4
DEMO_CALIB_SAMPLES = 4

EPILOG = """\
model specs: a local Hugging Face directory, a .gguf file, a hub id (online or cached), or
nothing for the embedded SmolLM2-135M-Instruct.
datasets: pydoc (CPython's documentation text, split into calibration and eval parts that never
overlap), wikitext2 (through the `datasets` package), or the path of a UTF-8 text file.
"""


# -- argument parsing ----------------------------------------------------------------------------
def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="model directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a hub model's own Python code to run (off by default)",
    )


def _add_calibration_args(
    parser: argparse.ArgumentParser, *, for_demo: bool = False, resume: bool = True
) -> None:
    """Where calibration samples come from, for methods that calibrate (``resume``: and
    ``--resume-dir``, for commands that keep what they quantize)."""
    parser.add_argument(
        "--calib",
        default="pydoc",
        metavar="NAME|PATH",
        help="calibration corpus for methods that calibrate: pydoc (its calibration part), "
        "wikitext2, or a text file (default: pydoc)",
    )
    parser.add_argument(
        "--calib-samples",
        type=int,
        default=DEMO_CALIB_SAMPLES if for_demo else 16,
        metavar="N",
        help="calibration windows (default: %(default)s)",
    )
    parser.add_argument(
        "--calib-seqlen",
        type=int,
        default=None,
        metavar="S",
        help="tokens per calibration window (default: --seqlen)",
    )
    parser.add_argument(
        "--calib-skip",
        type=int,
        default=0,
        metavar="N",
        help="skip the first N windows of the calibration corpus, e.g. the evaluated ones when "
        "calibrating on the evaluation file (default: 0)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for calibration sampling (and for sampling tokens in generate)",
    )
    if not resume:
        return
    parser.add_argument(
        "--resume-dir",
        default=None,
        metavar="DIR",
        help="GPTQ runs (gptq, quarot with w_algo=gptq) write each finished block here; run the "
        "same command again after an interruption and finished blocks are restored, giving the "
        "weights of an uninterrupted run (default: no checkpoints)",
    )


def _add_eval_args(parser: argparse.ArgumentParser, *, for_demo: bool = False) -> None:
    parser.add_argument(
        "--dataset",
        default="pydoc",
        metavar="NAME|PATH",
        help="evaluation corpus: pydoc (its eval part), wikitext2, or a text file (default: pydoc)",
    )
    parser.add_argument(
        "--seqlen",
        type=int,
        default=DEMO_SEQLEN if for_demo else 2048,
        help="tokens per window (default: %(default)s)",
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=DEMO_WINDOWS if for_demo else None,
        metavar="N",
        help="evaluate only the first N windows (default: %(default)s = all)",
    )
    _add_calibration_args(parser, for_demo=for_demo)
    parser.add_argument(
        "--chunk",
        type=int,
        default=None,
        metavar="T",
        help="feed each window in chunks of T tokens through the KV cache, so later tokens attend "
        "to cached (quantized) earlier ones (default: one pass per window)",
    )
    parser.add_argument(
        "--kv-context",
        type=int,
        default=2048,
        metavar="T",
        help="context length at which KV-cache bytes per token are stated (default: 2048)",
    )
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="also write the results as JSON"
    )
    _add_force_arg(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


FORCE_HELP = (
    "replace an existing regular file at the target (never a directory that holds files, "
    "never what a symbolic link points to); without it an existing target is refused"
)


def _add_force_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)


def _add_backend_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default="auto",
        metavar="NAME",
        help="how packed linears multiply: auto (by device and input), reference, torch-cpu, ...; "
        "a name other than auto packs simulated (fake-quantized) weights first so that the "
        "backend is what runs (default: auto)",
    )


DEVICE_HELP = (
    "where the model runs: the model loads on the CPU and moves there; auto is CUDA when a "
    "CUDA device is present, else the CPU (default: auto)"
)
CALIBRATION_DEVICE_HELP = (
    "where calibration runs (GPTQ's layer-by-layer walk, KVQuant's Fisher pass): the model "
    "stays on the CPU and one block at a time moves there; auto is CUDA when a CUDA device is "
    "present, else the CPU (default: auto)"
)


def _add_device_arg(parser: argparse.ArgumentParser, help: str = DEVICE_HELP) -> None:
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N", help=help)


DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_HELP = (
    "the dtype the model runs in: auto is the one a saved lowbit model records (bfloat16 when "
    "it was quantized in float32: torch's packed CPU kernels take bf16 activations) and float32 "
    "for a float model; float32 on a packed model is the exact path, several times slower on "
    "the CPU (default: auto)"
)
SAVE_DTYPE_HELP = (
    "the dtype the saved model runs in when it loads (its config's dtype; the stored tensors "
    "keep theirs, so --dtype float32 at load time is still exact): auto is bfloat16 for a "
    "float32 model (default: auto)"
)


def _add_dtype_arg(parser: argparse.ArgumentParser, help: str = DTYPE_HELP) -> None:
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=help)


def resolve_dtype(name: str):
    """The torch dtype ``--dtype NAME`` means; None for auto."""
    import torch

    return None if name == "auto" else getattr(torch, name)


def resolve_device(name: str):
    """The torch device ``--device NAME`` means; a CUDA device this machine lacks is a sentence."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    kind, colon, index = name.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise LowbitError(f"unknown --device {name!r}; choose auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise LowbitError(
            f"--device {name} asks for a CUDA device, but torch finds none on this machine "
            "(use --device cpu or auto)"
        )
    count = torch.cuda.device_count()
    if colon and int(index) >= count:
        raise LowbitError(
            f"--device {name} names CUDA device {index}, but this machine has {count} "
            f"(cuda:0 to cuda:{count - 1})"
        )
    return torch.device(name)


# The least value of each integer option (options a command lacks, or left at None, pass).
INT_MINIMUMS = {
    "seqlen": ("--seqlen", 2),  # a window scores positions 1..S-1
    "windows": ("--windows", 1),
    "calib_samples": ("--calib-samples", 1),
    "calib_seqlen": ("--calib-seqlen", 1),
    "calib_skip": ("--calib-skip", 0),
    "seed": ("--seed", 0),
    "chunk": ("--chunk", 1),
    "kv_context": ("--kv-context", 1),
    "max_new_tokens": ("--max-new-tokens", 1),
}


def check_int_args(args) -> None:
    """Refuse an integer option below its least value, with one sentence, before any work."""
    for attr, (option, least) in INT_MINIMUMS.items():
        value = getattr(args, attr, None)
        if value is not None and value < least:
            raise LowbitError(f"{option} must be at least {least}, not {value}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowbit",
        description="Run Hugging Face causal LMs in low bits and measure what it costs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    eval_parser = commands.add_parser(
        "eval",
        help="quantize with one or more recipes and measure perplexity, KL, top-1 and memory",
        description="Quantize the model with each --recipe and evaluate it against the "
        "unquantized model on the same windows: perplexity, mean KL divergence of the next-token "
        "distributions, top-1 agreement, bits per weight, model bytes, KV bytes per token.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arg(eval_parser)
    eval_parser.add_argument(
        "--recipe",
        action="append",
        default=None,
        metavar="NAME",
        help="a method (see `lowbit recipes`) or preset; repeat for several rows (default: fp)",
    )
    eval_parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a recipe setting, e.g. --set w_bits=4; applies to every listed recipe that "
        "has the setting; repeatable",
    )
    _add_backend_arg(eval_parser)
    _add_device_arg(eval_parser)
    _add_dtype_arg(eval_parser)
    _add_eval_args(eval_parser)
    eval_parser.add_argument(
        "--engine",
        choices=["transformers", "llama.cpp"],
        default="transformers",
        help="llama.cpp: --model is a .gguf file run by llama.cpp (llama-cpp-python), measured "
        "against --reference in transformers (default: transformers)",
    )
    eval_parser.add_argument(
        "--reference",
        default=None,
        metavar="MODEL",
        help="the float model to compare --model with, evaluated as it is: a .gguf file "
        "(--engine llama.cpp), a compressed-tensors export, whose transforms lowbit applies, or "
        "a lowbit checkpoint (default: the embedded model)",
    )
    eval_parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --model a lowbit checkpoint and --reference its float model's directory of "
        "safetensors: run both layer-major, one block in memory at a time, and the heads a "
        "chunk of tokens at a time (the in-memory numbers to rounding); default: stream when "
        "both models would not fit this machine's available memory",
    )
    eval_parser.add_argument(
        "--threads", type=int, default=2, help="--engine llama.cpp: llama.cpp's threads (2)"
    )
    eval_parser.add_argument(
        "--kv-cache",
        default="f16",
        metavar="TYPE",
        help="--engine llama.cpp: llama.cpp's KV cache type for keys and values (f16, q8_0, "
        "q4_0, q4_1, q5_0, q5_1; quantized caches run with flash attention), so llama.cpp's "
        "caches get KL and perplexity on the windows lowbit's get (default: f16)",
    )

    quantize_parser = commands.add_parser(
        "quantize",
        help="quantize a model with a recipe and save it, packed, as a model directory",
        description="Quantize the model with --recipe (calibrating where the method does) and "
        "write it to --out: config.json with the recipe, packed weights in safetensors, the "
        "tokenizer, and everything the recipe calibrated. `--model DIR` then loads it in every "
        "command, and transformers' from_pretrained loads it after `import lowbit`. A model "
        "directory of safetensors is quantized block by block, one block in memory at a time, "
        "with --stream or when the whole model would not fit in the available memory (the "
        "same bits as in memory).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arg(quantize_parser)
    quantize_parser.add_argument(
        "--recipe", required=True, metavar="NAME", help="a method or preset (`lowbit recipes`)"
    )
    quantize_parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="change a recipe setting"
    )
    quantize_parser.add_argument(
        "--seqlen", type=int, default=2048, help="tokens per calibration window (default: 2048)"
    )
    _add_calibration_args(quantize_parser)
    quantize_parser.add_argument(
        "--out", required=True, metavar="DIR", help="directory to write (new or empty)"
    )
    _add_device_arg(quantize_parser, help=CALIBRATION_DEVICE_HELP)
    _add_dtype_arg(quantize_parser, help=SAVE_DTYPE_HELP)
    quantize_parser.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="the most bytes one weights file holds, e.g. 500MB, 2GB (default: 5GB, as "
        "transformers; 1GB when streamed); a larger model is written as Hugging Face's shards "
        "and index",
    )
    quantize_parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantize block by block, reading each block's weights from the model directory's "
        "safetensors when its turn comes (memory bounded by one block); default: stream when "
        "the whole model would not fit this machine's available memory",
    )
    quantize_parser.add_argument(
        "--distributed",
        action="store_true",
        help="share the calibration between the processes torchrun starts (torchrun "
        "--nproc-per-node N -m lowbit quantize ... --distributed; gptq; gloo on the CPU, NCCL "
        "with --device cuda); rank 0 writes --out, equal bit for bit to one process's",
    )
    quantize_parser.add_argument(
        "--calib-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype the weights are read and calibrated in (default: float32; bfloat16 halves "
        "the memory and changes the results)",
    )
    _add_force_arg(quantize_parser)
    quantize_parser.add_argument("--no-progress", action="store_true", help="hide progress bars")

    export_parser = commands.add_parser(
        "export",
        help="write a quantized model in a format other engines load (compressed-tensors, gguf)",
        description="Export a quantized model to --format: compressed-tensors (what vLLM and "
        "transformers load; rotations fused into the weights, online Hadamards as its "
        "transforms) or gguf (llama.cpp). --model is a model lowbit saved, or a float model "
        "quantized first with --recipe. What the format cannot express (codebooks, BFP, "
        "quantized KV caches, ...) is refused with a sentence naming the layer.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arg(export_parser)
    export_parser.add_argument(
        "--recipe", default=None, metavar="NAME", help="quantize the model with this first"
    )
    export_parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="change a recipe setting"
    )
    export_parser.add_argument(
        "--seqlen", type=int, default=2048, help="tokens per calibration window (default: 2048)"
    )
    _add_calibration_args(export_parser)
    export_parser.add_argument(
        "--format",
        required=True,
        choices=["compressed-tensors", "gguf"],
        help="the format to write: compressed-tensors (a directory) or gguf (one file "
        "llama.cpp loads; recipes gguf and rotate+gguf with online=false)",
    )
    export_parser.add_argument(
        "--type",
        default=None,
        metavar="TYPE",
        help="gguf: llama.cpp's file type (Q8_0, Q5_0, Q4_0, Q5_1, Q4_1, IQ4_NL, Q6_K, Q5_K_M, "
        "Q5_K_S, Q4_K_M, Q4_K_S, Q3_K_L, Q3_K_M, Q3_K_S, Q2_K): each linear on the type "
        "llama.cpp's quantizer gives it; sets the gguf recipe's gguf_type",
    )
    export_parser.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="directory to write (new or empty); for gguf the .gguf file",
    )
    _add_force_arg(export_parser)
    export_parser.add_argument("--no-progress", action="store_true", help="hide progress bars")

    info_parser = commands.add_parser(
        "info", help="architecture, dimensions (as 2^m x odd), parameters, tied embeddings, GQA"
    )
    _add_model_arg(info_parser)
    _add_device_arg(info_parser)
    _add_dtype_arg(info_parser)

    commands.add_parser("recipes", help="list methods, their settings and defaults, and presets")

    demo_parser = commands.add_parser(
        "demo",
        help="evaluate the model unquantized and with every recipe on the embedded corpus",
        description=f"Evaluate the recipes {', '.join(DEMO_RECIPES)} on the pydoc evaluation "
        f"text ({DEMO_WINDOWS} windows of {DEMO_SEQLEN} tokens; methods that calibrate use "
        f"{DEMO_CALIB_SAMPLES} windows of the pydoc calibration text) and print the table.",
    )
    _add_model_arg(demo_parser)
    _add_device_arg(demo_parser)
    _add_eval_args(demo_parser, for_demo=True)

    report_parser = commands.add_parser(
        "report",
        help="plot lowbit eval --json results in one self-contained HTML page",
        description="Write --out, a new directory: index.html (figures embedded) and each "
        "figure as a PNG. From lowbit eval --json files (nothing re-evaluated): ppl and KL "
        "against bits per weight with the Pareto front, KV-cache bytes against context length. "
        "With --layer-error: each recipe quantizes --model and every block's and linear's "
        "output is compared with the float model's on --dataset. With --channels: per-channel "
        "magnitudes of activations before and after the rotation and of keys before and after "
        "K-sort.",
    )
    report_parser.add_argument(
        "results", nargs="*", metavar="JSON", help="lowbit eval --json files"
    )
    report_parser.add_argument("--out", required=True, help="the directory to write")
    _add_force_arg(report_parser)
    report_parser.add_argument(
        "--layer-error",
        nargs="+",
        default=[],
        metavar="RECIPE",
        help="recipes whose per-block and per-linear output error against float to plot",
    )
    report_parser.add_argument(
        "--channels",
        action="store_true",
        help="plot activation and key channel magnitudes before and after rotation and K-sort",
    )
    report_parser.add_argument(
        "--layer",
        type=int,
        default=None,
        metavar="N",
        help="the block --channels measures (default: the middle one)",
    )
    _add_model_arg(report_parser)
    report_parser.add_argument(
        "--dataset",
        default="pydoc",
        metavar="NAME|PATH",
        help="text the model runs on for --layer-error and --channels: pydoc, wikitext2 or a "
        "text file (default: pydoc)",
    )
    report_parser.add_argument(
        "--seqlen", type=int, default=512, help="tokens per window (default: %(default)s)"
    )
    report_parser.add_argument(
        "--windows", type=int, default=2, help="windows of --dataset (default: %(default)s)"
    )
    _add_calibration_args(report_parser, resume=False)
    report_parser.set_defaults(calib_samples=8)
    report_parser.add_argument("--no-progress", action="store_true", help="hide progress bars")

    lm_eval_parser = commands.add_parser(
        "lm-eval",
        help="run lm-evaluation-harness tasks on a model (lm-eval's model type lowbit)",
        description="Register lm-eval's model type lowbit (lm-eval's hf scoring on a model "
        "lowbit loads: a saved quantized directory runs with its activation quantizers and "
        "KV cache) and call lm_eval.simple_evaluate. --tasks local runs the offline task "
        "lowbit_pydoc_cloze (multiple-choice cloze over CPython's pydoc text).",
    )
    _add_model_arg(lm_eval_parser)
    lm_eval_parser.add_argument("--tasks", default="local", help="comma-separated lm-eval tasks")
    lm_eval_parser.add_argument("--limit", type=int, default=None, help="items per task")
    lm_eval_parser.add_argument("--items", type=int, default=200, help="items of the local task")
    lm_eval_parser.add_argument("--batch-size", type=int, default=8)
    lm_eval_parser.add_argument("--chunk", type=int, default=128,
                                help="tokens fed at a time through a quantized KV cache")  # fmt: skip
    lm_eval_parser.add_argument("--json", default=None, metavar="FILE", help="write the results")
    _add_force_arg(lm_eval_parser)

    generate_parser = commands.add_parser(
        "generate",
        help="generate text from a prompt (or hold a chat), quantized with a recipe or not",
        description="Load the model, quantize it with --recipe if given (calibrating as eval "
        "does), and stream the answer to --prompt on stdout, with the recipe's quantized KV "
        "cache when it has one. Decode tokens/s (prefill apart) and peak memory go to stderr. "
        "With --chat the tokenizer's chat template is applied and each further line of stdin "
        "is another user turn, until end of input; every turn re-encodes the whole "
        "conversation with a fresh cache (exact with any template, at the cost of a prefill of "
        "the history per turn).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arg(generate_parser)
    generate_parser.add_argument(
        "--recipe", default=None, metavar="NAME", help="a method or preset (default: none, float)"
    )
    generate_parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="change a recipe setting"
    )
    generate_parser.add_argument(
        "--prompt",
        default=None,
        help="the prompt; with --chat the first user turn (left out: the first line of stdin)",
    )
    generate_parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        metavar="N",
        help="at most N new tokens per answer (default: %(default)s)",
    )
    generate_parser.add_argument(
        "--chat",
        action="store_true",
        help="apply the tokenizer's chat template and read further user turns from stdin",
    )
    generate_parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 for greedy decoding, else sample at temperature T (default: 0)",
    )
    generate_parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling threshold when sampling (default: 1)",
    )
    generate_parser.add_argument(
        "--static-cache",
        action="store_true",
        help="decode into a fixed-size float cache (transformers' StaticCache)",
    )
    generate_parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model's forward (implies --static-cache; CUDA graphs on a GPU); "
        "the first tokens include the compile time",
    )
    generate_parser.add_argument(
        "--seqlen", type=int, default=2048, help="tokens per calibration window (default: 2048)"
    )
    _add_calibration_args(generate_parser)
    _add_backend_arg(generate_parser)
    _add_device_arg(generate_parser)
    _add_dtype_arg(generate_parser)
    generate_parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


# -- helpers ---------------------------------------------------------------------------------------
def parse_settings(pairs: list[str]) -> dict[str, str]:
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise LowbitError(f"--set takes KEY=VALUE, not {pair!r}")
        settings[key.strip()] = value.strip()
    return settings


def build_recipes(names: list[str], settings: dict[str, str]) -> list[tuple[str, object]]:
    """(label, recipe) per name; each --set applies to the recipes that have that setting.

    The label is the name as given (a method or preset), followed by the --set values that
    changed it.
    """
    from lowbit.recipes.registry import get_recipe

    named = [(name, get_recipe(name)) for name in names]
    for key in settings:
        if not any(key in r.field_types() for _, r in named):
            raise LowbitError(
                f"no listed recipe has a setting {key!r} (see `lowbit recipes` for the settings)"
            )
    built = []
    for name, recipe in named:
        changes = {k: v for k, v in settings.items() if k in recipe.field_types()}
        changed = recipe.with_settings(**changes)
        shown = [f"{k}={v}" for k, v in changes.items()]
        built.append((name + (f" ({', '.join(shown)})" if shown else ""), changed))
    return built


def command_inputs(args) -> list:
    """The paths a command reads (``--model``, ``--dataset``, ``--calib``, ``--reference``,
    report's result files): no output may be one of them, not even with ``--force``."""
    names = ("model", "dataset", "calib", "reference", "resume_dir")
    return [getattr(args, n, None) for n in names] + list(getattr(args, "results", None) or [])


def check_json_target(args) -> None:
    """Refuse, before any work, a ``--json`` target the writing rule refuses
    (:func:`lowbit.atomic.check_target`)."""
    from lowbit.atomic import check_target

    if getattr(args, "json", None) is not None:  # "" too: a sentence, not ignored
        check_target(args.json, "write", kind="file", force=args.force, inputs=command_inputs(args))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'recipe':<34} {'ppl':>9} {'KL':>8} {'top-1':>7} {'bits/w':>7} {'model MB':>9} "
        f"{'KV B/tok':>9} {'quant s':>8} {'train s':>8} {'eval s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['label'][:34]:<34} {_fmt(r['ppl'], '.3f'):>9} {_fmt(r['kl'], '.4f'):>8} "
            f"{_fmt(r['top1'], '.4f'):>7} {r['bits_per_weight']:>7.3f} "
            f"{r['model_bytes'] / 1e6:>9.1f} {r['kv_bytes_per_token']:>9.1f} "
            f"{r['quantize_seconds']:>8.1f} {r.get('train_seconds', 0.0):>8.1f} "
            f"{r['eval_seconds']:>7.1f}"
        )
    return "\n".join(lines)


def build_calibration(args, corpus, tokenizer):
    """[calib_samples, calib_seqlen] token ids from ``corpus`` as the calibration args say."""
    from lowbit.data import calibration_samples, tokenize

    return calibration_samples(
        tokenize(tokenizer, corpus.text),
        args.calib_samples,
        args.seqlen if args.calib_seqlen is None else args.calib_seqlen,
        seed=args.seed,
        skip_windows=args.calib_skip,
    )


# -- commands --------------------------------------------------------------------------------------
def run_eval(args, recipe_names: list[str]) -> list[dict]:
    """The rows of ``lowbit eval`` / ``lowbit demo``: options checked here, the work done by
    :func:`lowbit.eval.run.evaluate_recipes` (or, with ``--engine llama.cpp``,
    :func:`lowbit.eval.llama_cpp.evaluate_gguf`)."""
    from lowbit.eval.run import evaluate_recipes

    if getattr(args, "engine", "transformers") == "llama.cpp":
        return [run_eval_llama_cpp(args)]
    if getattr(args, "kv_cache", "f16") != "f16":
        raise LowbitError(
            "--kv-cache is llama.cpp's cache type; lowbit's caches come from --recipe"
        )

    labelled = build_recipes(recipe_names, parse_settings(getattr(args, "set", [])))
    check_json_target(args)
    return evaluate_recipes(
        args.model,
        labelled,
        dataset=args.dataset,
        seqlen=args.seqlen,
        windows=args.windows,
        calib=args.calib,
        calib_samples=args.calib_samples,
        calib_seqlen=args.calib_seqlen,
        calib_skip=args.calib_skip,
        seed=args.seed,
        chunk=args.chunk,
        kv_context=args.kv_context,
        backend=getattr(args, "backend", "auto"),  # demo has no --backend
        device=resolve_device(args.device),
        dtype=resolve_dtype(getattr(args, "dtype", "auto")),  # demo has no --dtype
        resume_dir=args.resume_dir,
        trust_remote_code=args.trust_remote_code,
        progress=not args.no_progress,
        reference=getattr(args, "reference", None),
        stream=getattr(args, "stream", None),  # demo has no --stream
    )


def run_eval_llama_cpp(args) -> dict:
    """One row: the .gguf --model through llama.cpp against the float --reference."""
    from lowbit.eval.llama_cpp import evaluate_gguf

    if args.recipe or args.set:
        raise LowbitError("--engine llama.cpp evaluates a .gguf file as it is; drop --recipe/--set")
    if args.model is None or not str(args.model).lower().endswith(".gguf"):
        raise LowbitError("--engine llama.cpp needs --model FILE.gguf")
    if args.chunk is not None:
        raise LowbitError("--chunk feeds lowbit's KV caches; llama.cpp keeps its own")
    if args.stream:
        raise LowbitError("--stream runs lowbit's checkpoints layer-major; llama.cpp runs its own")
    if args.dtype != "auto" or args.backend != "auto":
        raise LowbitError(
            "--dtype and --backend choose how lowbit runs a model; llama.cpp runs the file as "
            "its types say"
        )
    if args.threads < 1:
        raise LowbitError(f"--threads must be at least 1, not {args.threads}")
    from lowbit.eval.llama_cpp import KV_CACHE_TYPES

    if args.kv_cache not in KV_CACHE_TYPES:
        raise LowbitError(
            f"--kv-cache must be one of {', '.join(KV_CACHE_TYPES)}, not {args.kv_cache!r}"
        )
    check_json_target(args)
    row = evaluate_gguf(
        args.model, reference=args.reference, dataset=args.dataset, seqlen=args.seqlen,
        windows=args.windows, threads=args.threads, progress=not args.no_progress,
        kv_cache=args.kv_cache,
    )  # fmt: skip
    # the table's other columns: no quantization time (KV bytes: llama.cpp's cache of that type)
    row.update(kv_context=args.kv_context, quantize_seconds=0.0)
    row["dtype"] = "llama.cpp, the file's own types"
    return row


def run_quantize(args) -> None:
    from lowbit.api import quantize_to_directory
    from lowbit.atomic import check_target
    from lowbit.data import load_corpus
    from lowbit.eval.memory import memory_report
    from lowbit.io.shards import parse_size
    from lowbit.models.adapter import adapter_for

    if args.max_shard_size is not None:
        parse_size(args.max_shard_size)  # before the long work
    ((label, recipe),) = build_recipes([args.recipe], parse_settings(args.set))
    if recipe.method == "fp":
        raise LowbitError("recipe fp quantizes nothing: there is no quantized model to save")
    out = Path(args.out).expanduser()
    check_target(out, "save to", force=args.force, inputs=command_inputs(args))  # before the work
    resume = None if args.resume_dir is None else Path(args.resume_dir).expanduser()
    if resume is not None and resume.resolve() == out.resolve():
        raise LowbitError("--resume-dir must be another directory than --out")
    device = resolve_device(args.device)
    calib_corpus = load_corpus(args.calib, part="calibration") if recipe.needs_calibration else None
    seqlen = args.seqlen if args.calib_seqlen is None else args.calib_seqlen

    def calibration(tokenizer):
        return build_calibration(args, calib_corpus, tokenizer)

    result = quantize_to_directory(
        args.model, recipe, out,
        calibration=None if calib_corpus is None else calibration,
        calibration_shape=(args.calib_samples, seqlen) if calib_corpus is not None else (0, 0),
        stream=args.stream, calib_dtype=resolve_dtype(args.calib_dtype), device=device,
        dtype=resolve_dtype(args.dtype) or "auto", resume_dir=args.resume_dir,
        max_shard_size=args.max_shard_size, trust_remote_code=args.trust_remote_code,
        progress=not args.no_progress, force=args.force, distributed=args.distributed,
    )  # fmt: skip
    if not result.written:
        return  # another rank wrote and reports
    if result.model is not None:
        # as the saved model runs (what `eval --model OUT` states), not as it sits here in float32
        memory = memory_report(result.model, adapter_for(result.model), float_dtype=result.dtype)
        bits, size = memory.bits_per_weight, memory.model_bytes
    else:
        bits, size = result.bits_per_weight, result.bytes_written
    how = "streamed block by block" if result.streamed else "in memory"
    print(
        f"wrote {out}: {label}, {bits:.3f} bits per weight, {size / 1e6:.1f} MB, quantized "
        f"{how} in {result.seconds:.1f} s; runs in {str(result.dtype).removeprefix('torch.')}"
    )


def _quantize_for_export(args, loaded, recipe, saved, calib_corpus) -> None:
    """``export --recipe``: quantize the loaded float model in place (calibrating on
    ``calib_corpus`` when the recipe needs it); a model that is already quantized is refused."""
    from lowbit.api import quantize

    if saved is not None:
        raise LowbitError(
            f"{loaded.name} is already quantized ({saved.method}); export it without --recipe"
        )
    calibration = None
    if calib_corpus is not None:
        calibration = build_calibration(args, calib_corpus, loaded.tokenizer)
    quantize(
        loaded.model, recipe, calibration=calibration, progress=not args.no_progress,
        resume_dir=args.resume_dir,
    )  # fmt: skip


def run_export_gguf(args) -> None:
    """``lowbit export --format gguf``: quantize with --recipe (gguf, rotate+gguf) or take a
    saved model, then write one GGUF file."""
    import torch

    from lowbit.api import load_model
    from lowbit.atomic import check_target
    from lowbit.data import load_corpus
    from lowbit.formats.gguf_mix import file_type
    from lowbit.io.gguf import check_gguf_recipe, export_gguf, gguf_settings_of
    from lowbit.models.loader import embedded_gguf_path

    settings = parse_settings(args.set)
    recipe = None
    if args.recipe is not None:
        from lowbit.recipes.registry import get_recipe

        check_gguf_recipe(get_recipe(args.recipe).to_dict())  # the methods, before any setting
        if args.type is not None:
            given = settings.get("gguf_type")
            if given is not None and file_type(given) != file_type(args.type):
                raise LowbitError(
                    f"--type {args.type} and --set gguf_type={given} ask for two file types; "
                    "give one of them"
                )
            settings["gguf_type"] = args.type
        ((_, recipe),) = build_recipes([args.recipe], settings)
        check_gguf_recipe(recipe.to_dict())  # before any model loads or calibrates
    elif args.set:
        raise LowbitError("--set changes a recipe's settings; give it with --recipe")
    out = Path(args.out).expanduser()
    check_target(out, "export to", kind="file", force=args.force, inputs=command_inputs(args))
    calib_corpus = None
    if recipe is not None and recipe.needs_calibration:
        calib_corpus = load_corpus(args.calib, part="calibration")
    # float32: a saved model's float tensors as they are stored, not the dtype it runs in
    loaded = load_model(args.model, dtype=torch.float32, trust_remote_code=args.trust_remote_code)
    model = loaded.model
    saved = getattr(model, "lowbit_recipe", None)
    if recipe is None and saved is None:
        raise LowbitError(
            f"{loaded.name} is not quantized; give --recipe gguf (or rotate+gguf), or a model "
            "lowbit quantize saved with it"
        )
    if recipe is not None:
        _quantize_for_export(args, loaded, recipe, saved, calib_corpus)
    elif args.type is not None:
        held = gguf_settings_of(saved.to_dict())
        if held is not None and held[0] != file_type(args.type):
            raise LowbitError(
                f"{loaded.name} holds {held[0]} weights, not {args.type}; drop --type or "
                "quantize it again"
            )
    source = None
    if loaded.source == "embedded":
        source = embedded_gguf_path()
    elif loaded.source == "gguf":
        source = Path(loaded.name)
    ftype = export_gguf(
        model, out, tokenizer=loaded.tokenizer, source_gguf=source, force=args.force
    )
    print(f"wrote {args.out}: {model.lowbit_recipe.method}, {ftype}")


def run_export(args) -> None:
    if args.format == "gguf":
        run_export_gguf(args)
        return
    if args.type is not None:
        raise LowbitError("--type is a gguf setting; it needs --format gguf")
    import torch

    from lowbit.api import load_model
    from lowbit.atomic import check_target
    from lowbit.data import load_corpus
    from lowbit.io.compressed_tensors import (
        check_recipe,
        check_saved_recipe,
        export_compressed_tensors,
    )

    recipe = None
    if args.recipe is not None:
        ((_, recipe),) = build_recipes([args.recipe], parse_settings(args.set))
        if recipe.method == "fp":
            raise LowbitError("recipe fp quantizes nothing: there is no quantized model to export")
        check_recipe(recipe.to_dict())  # before any model loads or calibrates
    elif args.set:
        raise LowbitError("--set changes a recipe's settings; give it with --recipe")
    elif args.model is not None:
        check_saved_recipe(Path(args.model).expanduser())  # from its config.json alone
    out = Path(args.out).expanduser()
    check_target(out, "export to", force=args.force, inputs=command_inputs(args))  # before work
    needs_calib = recipe is not None and recipe.needs_calibration
    calib_corpus = load_corpus(args.calib, part="calibration") if needs_calib else None
    # float32: a saved model's float tensors as they are stored, not the dtype it runs in
    loaded = load_model(args.model, dtype=torch.float32, trust_remote_code=args.trust_remote_code)
    model = loaded.model
    saved = getattr(model, "lowbit_recipe", None)
    if recipe is None and saved is None:
        raise LowbitError(
            f"{loaded.name} is not quantized; give --recipe, or a model lowbit quantize saved"
        )
    if recipe is not None:
        _quantize_for_export(args, loaded, recipe, saved, calib_corpus)
    export_compressed_tensors(model, out, tokenizer=loaded.tokenizer, force=args.force)
    print(f"wrote {out}: {model.lowbit_recipe.method} as {args.format}")


def report(rows: list[dict], args) -> None:
    from lowbit.atomic import write_json

    first = rows[0]
    print(
        f"model: {first['model']} (runs in {first['dtype']})\n"
        f"dataset: {first['dataset']}, {first['windows']} windows x "
        f"{first['seqlen']} tokens; KV bytes/token at context {first['kv_context']} "
        "(unquantized caches counted in fp16)"
    )
    print(format_table(rows))
    if args.json is not None:
        write_json(args.json, rows[0] if len(rows) == 1 else rows, force=args.force)
        print(f"wrote {args.json}")


def run_report(args) -> None:
    try:
        from lowbit.eval.report import write_report
    except ImportError as err:  # matplotlib is the extra `report`
        raise LowbitError(
            f"lowbit report needs matplotlib: pip install 'lowbit[report]' ({err})"
        ) from err
    from lowbit.atomic import check_target

    if not (args.results or args.layer_error or args.channels):
        raise LowbitError("nothing to report: give eval --json files, --layer-error or --channels")
    check_target(  # before the long work
        args.out, "write the report to", force=args.force, inputs=command_inputs(args)
    )
    layer_errors, magnitudes, model_name = [], None, ""
    if args.layer_error or args.channels:
        layer_errors, magnitudes, model_name = measure_insides(args)
    page = write_report(
        args.results, args.out, layer_errors=layer_errors, magnitudes=magnitudes,
        model=model_name, force=args.force,
    )  # fmt: skip
    print(f"wrote {page}")


def measure_insides(args):
    """``lowbit report``'s measurements on --model: (layer errors, channel magnitudes or None,
    the model's name)."""
    from lowbit.api import load_model
    from lowbit.data import eval_windows, load_corpus, tokenize
    from lowbit.eval.distributions import channel_magnitudes
    from lowbit.eval.layer_error import layer_error

    labelled = build_recipes(args.layer_error, {})
    corpus = load_corpus(args.dataset, part="eval")
    calib_corpus = None
    if any(recipe.needs_calibration for _, recipe in labelled):
        calib_corpus = load_corpus(args.calib, part="calibration")
    loaded = load_model(args.model, trust_remote_code=args.trust_remote_code)
    if getattr(loaded.model, "lowbit_recipe", None) is not None:
        raise LowbitError(
            f"{loaded.name} is already quantized; --layer-error and --channels measure a float "
            "model (the one it came from)"
        )
    ids = eval_windows(tokenize(loaded.tokenizer, corpus.text), args.seqlen, args.windows)
    calibration = None
    if calib_corpus is not None:
        calibration = build_calibration(args, calib_corpus, loaded.tokenizer)
    magnitudes = channel_magnitudes(loaded.model, ids, args.layer) if args.channels else None
    errors = [
        layer_error(
            loaded.model,
            recipe,
            ids,
            calibration=calibration,
            label=label,
            progress=not args.no_progress,
        )  # fmt: skip
        for label, recipe in labelled
    ]
    return errors, magnitudes, loaded.name


def run_lm_eval(args) -> None:
    from lowbit.eval.harness import cloze_items
    from lowbit.models.loader import check_model_spec

    # what can be refused in a moment comes before lm-eval's import and the model's load
    for option, value in (("--limit", args.limit), ("--batch-size", args.batch_size),
                          ("--chunk", args.chunk)):  # fmt: skip
        if value is not None and value < 1:
            raise LowbitError(f"{option} must be at least 1, not {value}")
    if "local" in args.tasks.split(","):
        cloze_items(args.items)  # refuses --items below 1
    check_json_target(args)
    check_model_spec(args.model)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise LowbitError(
            f"lowbit lm-eval needs lm-eval: pip install 'lowbit[lm-eval]' ({err})"
        ) from err
    from lowbit.atomic import write_json
    from lowbit.eval.harness import TASK_NAME, register, write_cloze_task

    register()
    tasks = [TASK_NAME if t == "local" else t for t in args.tasks.split(",") if t]
    with tempfile.TemporaryDirectory() as directory:
        manager = TaskManager(include_path=str(write_cloze_task(directory, args.items)))
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise LowbitError(f"lm-eval has no task {', '.join(unknown)}")
        results = lm_eval.simple_evaluate(
            model="lowbit", model_args={"path": args.model, "chunk": args.chunk},
            tasks=tasks, task_manager=manager, limit=args.limit, batch_size=args.batch_size,
            device=str(resolve_device("auto")),
        )  # fmt: skip
    for task, values in results["results"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items() if isinstance(v, float))
        print(f"{task}: {shown}")
    if args.json is not None:
        write_json(args.json, results["results"], force=args.force)
        print(f"wrote {args.json}")


def factor_pow2(n: int) -> str:
    """576 -> '2^6 x 9'."""
    m = 0
    while n and n % 2 == 0:
        n //= 2
        m += 1
    return f"2^{m} x {n}"


def run_info(args) -> None:
    from lowbit.api import load_model
    from lowbit.eval.memory import parameter_count
    from lowbit.models.adapter import adapter_for

    device = resolve_device(args.device)
    loaded = load_model(
        args.model, dtype=resolve_dtype(args.dtype), trust_remote_code=args.trust_remote_code,
        need_tokenizer=False,
    )  # fmt: skip
    loaded.model.to(device)
    adapter = adapter_for(loaded.model)
    recipe = getattr(loaded.model, "lowbit_recipe", None)
    params = parameter_count(loaded.model)
    dims = {
        "hidden_size": adapter.hidden_size,
        "intermediate_size": adapter.intermediate_size,
        "head_dim": adapter.head_dim,
        "attention width (heads x head_dim)": adapter.num_heads * adapter.head_dim,
        "kv width": adapter.num_kv_heads * adapter.head_dim,
        "vocab_size": adapter.vocab_size,
    }
    print(f"model: {loaded.name}")
    print(f"family: {adapter.family} ({loaded.model.config.model_type})")
    print(f"layers: {adapter.num_layers}")
    print(
        f"attention heads: {adapter.num_heads}, KV heads: {adapter.num_kv_heads} "
        f"(GQA group {adapter.gqa_group})"
    )
    for name, value in dims.items():
        print(f"{name}: {value} = {factor_pow2(value)}")
    counted = " (packed linears count the weights they stand for, in x out)" if recipe else ""
    print(f"parameters: {params:,}{counted}")
    print(f"tied embeddings: {'yes' if adapter.tied_embeddings else 'no'}")
    print(f"max context: {adapter.max_context}")
    print(f"device: {device}")
    print(f"dtype: {str(loaded.model.dtype).removeprefix('torch.')}")
    if recipe is not None:  # a saved lowbit model
        from lowbit.eval.memory import memory_in_use, memory_report
        from lowbit.models.run import prepare_run

        memory = memory_report(loaded.model, adapter)
        settings = " ".join(f"{k}={v}" for k, v in recipe.settings().items())
        print(f"quantized: {recipe.method} ({settings})")
        print(
            f"bits per weight: {memory.bits_per_weight:.3f}; model: "
            f"{memory.model_bytes / 1e6:.1f} MB; KV cache: {memory.kv_bytes_per_token:.1f} "
            f"bytes per token at context {memory.kv_context}"
        )
        run = prepare_run(loaded.model)
        run_dtype = str(loaded.model.dtype).removeprefix("torch.")
        if run.decoded:
            print(
                f"run: {run.decoded} layers without a packed CPU kernel run from their weight "
                f"decoded to {run_dtype}, which replaces their packed buffers in memory"
            )
        if run.kernel:
            print(
                f"run: {run.kernel} layers keep only their kernel's layout in place of "
                f"their packed buffers; {run.shared} groups of projections of one input "
                "(q/k/v, gate/up) multiplied in one call each"
            )
        print(f"in memory: {memory_in_use(loaded.model) / 1e6:.1f} MB of weights and buffers")


def _stdin_turns():
    """Further user turns of a chat: the non-empty lines of stdin, until end of input."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as err:  # stdin decodes ahead in blocks: no line number
            raise LowbitError(
                f"a line of stdin is not valid UTF-8 text (the byte "
                f"0x{err.object[err.start]:02x}), so it cannot be a turn of the chat"
            ) from None
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def run_generate(args) -> None:
    import itertools

    import torch

    from lowbit.api import load_model, quantize
    from lowbit.data import load_corpus
    from lowbit.eval.run import check_backend, use_backend
    from lowbit.generate import check_sampling, check_text, generate
    from lowbit.models.run import prepare_run

    recipe = None
    if args.recipe is not None:
        ((_, recipe),) = build_recipes([args.recipe], parse_settings(args.set))
    elif args.set:
        raise LowbitError("--set changes a recipe's settings; give it with --recipe")
    if args.prompt is None and not args.chat:
        raise LowbitError("generate needs --prompt (or --chat, which reads turns from stdin)")
    if args.prompt is not None:
        check_text(args.prompt, "--prompt")
        if not args.prompt.strip():
            raise LowbitError("--prompt is empty")
    check_sampling(
        args.max_new_tokens, args.temperature, args.top_p,
        names=("--max-new-tokens", "--temperature", "--top-p"),
    )  # fmt: skip
    check_backend(args.backend)
    device = resolve_device(args.device)
    quantizes = recipe is not None and recipe.method != "fp"
    needs_calib = quantizes and recipe.needs_calibration
    calib_corpus = load_corpus(args.calib, part="calibration") if needs_calib else None

    loaded = load_model(
        args.model, dtype=resolve_dtype(args.dtype), trust_remote_code=args.trust_remote_code
    )
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise LowbitError(
            f"the tokenizer of {loaded.name} has no chat template, so --chat cannot format a "
            "conversation; leave out --chat"
        )
    saved = getattr(model, "lowbit_recipe", None)
    if quantizes and saved is not None:
        raise LowbitError(
            f"{loaded.name} is already quantized ({saved.method}); generate without --recipe"
        )
    model.to(device)  # loaded on the CPU
    if quantizes:
        calibration = None
        if calib_corpus is not None:
            calibration = build_calibration(args, calib_corpus, tokenizer)
        quantize(
            model, recipe, calibration=calibration, progress=not args.no_progress,
            resume_dir=args.resume_dir,
        )  # fmt: skip
    use_backend(model, args.backend)
    prepare_run(model)  # what eval measures: lowbit.models.run
    torch.manual_seed(args.seed)

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def answer(prompt):
        result = generate(
            model, tokenizer, prompt, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, streamer=emit,
            static_cache=args.static_cache, compile=args.compile,
        )  # fmt: skip
        emit("\n")
        speed = "-" if result.tokens_per_second is None else f"{result.tokens_per_second:.1f}"
        print(
            f"lowbit: {len(result.new_tokens)} new tokens; prefill {result.prefill_seconds:.2f} s "
            f"({result.prompt_tokens} prompt tokens); decode {speed} tokens/s in "
            f"{str(model.dtype).removeprefix('torch.')}; KV cache: {result.cache_type}",
            file=sys.stderr,
        )
        return result

    if not args.chat:
        result = answer(args.prompt)
    else:
        messages = []
        result = None
        first = [] if args.prompt is None else [args.prompt]
        for turn in itertools.chain(first, _stdin_turns()):
            messages.append({"role": "user", "content": turn})
            result = answer(messages)
            messages.append({"role": "assistant", "content": result.text})
        if result is None:
            raise LowbitError("--chat read no user turn: give --prompt or lines on stdin")
    if result.peak_memory_bytes is not None:
        print(
            f"lowbit: peak memory {result.peak_memory_bytes / 2**20:.1f} MiB "
            f"({result.peak_memory_kind}) on {device}",
            file=sys.stderr,
        )


def run_recipes() -> None:
    from lowbit.recipes.settings_help import recipes_help

    print(recipes_help())


class Terminated(BaseException):
    """SIGTERM, raised where the main thread runs so that cleanup code runs as it unwinds."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_unwinds():
    """While inside, SIGTERM raises :class:`Terminated` instead of ending the process silently
    (main thread only; a SIGTERM that is ignored stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        with _sigterm_unwinds():
            _run(args)
    except LowbitError as err:
        print(f"lowbit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowbit: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("lowbit: terminated", file=sys.stderr)
        return 143
    return 0


def _run(args) -> None:
    check_int_args(args)
    if args.command == "eval":
        report(run_eval(args, args.recipe or ["fp"]), args)
    elif args.command == "demo":
        report(run_eval(args, list(DEMO_RECIPES)), args)
    elif args.command == "quantize":
        run_quantize(args)
    elif args.command == "export":
        run_export(args)
    elif args.command == "info":
        run_info(args)
    elif args.command == "generate":
        run_generate(args)
    elif args.command == "recipes":
        run_recipes()
    elif args.command == "report":
        run_report(args)
    elif args.command == "lm-eval":
        run_lm_eval(args)


if __name__ == "__main__":
    sys.exit(main())
