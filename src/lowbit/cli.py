"""The ``lowbit`` command line: eval, quantize, info, recipes, demo.

Bad input ends with one sentence on stderr and exit status 2, never a traceback; files are
written under a temporary name and renamed, so nothing half-written is left behind.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from lowbit.errors import LowbitError

# Every method, at sizes that keep `lowbit demo` under 5 minutes on 2 CPU cores.
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


def _add_calibration_args(parser: argparse.ArgumentParser, *, for_demo: bool = False) -> None:
    """Where calibration samples come from, for methods that calibrate."""
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
    parser.add_argument("--seed", type=int, default=0, help="seed for calibration sampling")
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
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _add_backend_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default="auto",
        metavar="NAME",
        help="how packed linears multiply: auto (by device and input), reference, torch-cpu, ...; "
        "a name other than auto packs simulated (fake-quantized) weights first so that the "
        "backend is what runs (default: auto)",
    )


def use_backend(model, name: str) -> int:
    """Put ``model``'s packed linears on backend ``name``; returns how many there are.

    ``auto`` leaves a simulated model (``FakeQuantLinear``, float weights: the fast path on CPU)
    as it is; any other name packs it first, so the named backend is what computes.
    """
    from lowbit.nn.packed_linear import pack_model, set_backend

    if name != "auto":
        pack_model(model)
    return set_backend(model, name)


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
    _add_eval_args(eval_parser)

    quantize_parser = commands.add_parser(
        "quantize",
        help="quantize a model with a recipe and save it, packed, as a model directory",
        description="Quantize the model with --recipe (calibrating where the method does) and "
        "write it to --out: config.json with the recipe, packed weights in safetensors, the "
        "tokenizer, and everything the recipe calibrated. `--model DIR` then loads it in every "
        "command, and transformers' from_pretrained loads it after `import lowbit`.",
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
    quantize_parser.add_argument("--no-progress", action="store_true", help="hide progress bars")

    info_parser = commands.add_parser(
        "info", help="architecture, dimensions (as 2^m x odd), parameters, tied embeddings, GQA"
    )
    _add_model_arg(info_parser)

    commands.add_parser("recipes", help="list methods, their settings and defaults, and presets")

    demo_parser = commands.add_parser(
        "demo",
        help="evaluate the model unquantized and with every recipe on the embedded corpus",
        description=f"Evaluate the recipes {', '.join(DEMO_RECIPES)} on the pydoc evaluation "
        f"text ({DEMO_WINDOWS} windows of {DEMO_SEQLEN} tokens; methods that calibrate use "
        f"{DEMO_CALIB_SAMPLES} windows of the pydoc calibration text) and print the table.",
    )
    _add_model_arg(demo_parser)
    _add_eval_args(demo_parser, for_demo=True)
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


def check_writable(path: str) -> Path:
    target = Path(path).expanduser()
    if not target.parent.is_dir():
        raise LowbitError(f"cannot write {target}: the directory {target.parent} does not exist")
    if target.is_dir():
        raise LowbitError(f"cannot write {target}: it is a directory")
    return target


def write_json_atomic(path: str, data) -> None:
    target = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'recipe':<34} {'ppl':>9} {'KL':>8} {'top-1':>7} {'bits/w':>7} {'model MB':>9} "
        f"{'KV B/tok':>9} {'quant s':>8} {'eval s':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['label'][:34]:<34} {_fmt(r['ppl'], '.3f'):>9} {_fmt(r['kl'], '.4f'):>8} "
            f"{_fmt(r['top1'], '.4f'):>7} {r['bits_per_weight']:>7.3f} "
            f"{r['model_bytes'] / 1e6:>9.1f} {r['kv_bytes_per_token']:>9.1f} "
            f"{r['quantize_seconds']:>8.1f} {r['eval_seconds']:>7.1f}"
        )
    return "\n".join(lines)


def build_calibration(args, corpus, tokenizer):
    """[calib_samples, calib_seqlen] token ids from ``corpus`` as the calibration args say."""
    from lowbit.data import calibration_samples, tokenize

    return calibration_samples(
        tokenize(tokenizer, corpus.text),
        args.calib_samples,
        args.calib_seqlen or args.seqlen,
        seed=args.seed,
        skip_windows=args.calib_skip,
    )


# -- commands --------------------------------------------------------------------------------------
def run_eval(args, recipe_names: list[str]) -> list[dict]:
    import torch

    from lowbit.data import eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import FloatReference, evaluate
    from lowbit.eval.memory import memory_report
    from lowbit.models.adapter import adapter_for
    from lowbit.models.loader import load_model
    from lowbit.api import quantize

    labelled = build_recipes(recipe_names, parse_settings(getattr(args, "set", [])))
    recipes = [recipe for _, recipe in labelled]
    progress = not args.no_progress
    if args.calib_samples < 1:
        raise LowbitError(f"--calib-samples must be at least 1, not {args.calib_samples}")
    if args.chunk is not None and args.chunk < 1:
        raise LowbitError(f"--chunk must be at least 1, not {args.chunk}")
    if args.json:
        check_writable(args.json)
    resume_dir = getattr(args, "resume_dir", None)
    resumable = [r for r in recipes if getattr(r, "gptq_weights", False)]
    if resume_dir is not None and len(resumable) > 1:
        raise LowbitError(
            f"--resume-dir holds the blocks of one run, but {len(resumable)} recipes calibrate "
            "with GPTQ; give it with one of them"
        )
    from lowbit.kernels.dispatch import backend_names

    backend = getattr(args, "backend", "auto")  # demo has no --backend
    if backend not in backend_names():
        raise LowbitError(
            f"unknown backend {backend!r}; choose one of {', '.join(backend_names())}"
        )
    torch.manual_seed(args.seed)
    corpus = load_corpus(args.dataset, part="eval")  # cheap checks before the model loads
    calib_corpus = None
    if any(r.needs_calibration for r in recipes):
        calib_corpus = load_corpus(args.calib, part="calibration")

    loaded = load_model(args.model, trust_remote_code=args.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    adapter = adapter_for(model)
    if adapter.max_context and args.seqlen > adapter.max_context:
        raise LowbitError(
            f"--seqlen {args.seqlen} is larger than the model's context ({adapter.max_context})"
        )
    windows = eval_windows(tokenize(tokenizer, corpus.text), args.seqlen, args.windows)

    calibration = None if calib_corpus is None else build_calibration(args, calib_corpus, tokenizer)

    saved = getattr(model, "lowbit_recipe", None)  # a lowbit checkpoint: already quantized
    if saved is not None:
        if any(recipe.method != "fp" for recipe in recipes):
            raise LowbitError(
                f"{loaded.name} is already quantized ({saved.method}); evaluate it without "
                "--recipe, or quantize the float model instead"
            )
        labelled = [(f"{saved.method} (saved)", saved)]
    reference = None if saved is not None else FloatReference(model)  # no float model to compare
    rows = []
    for label, recipe in labelled:
        start = time.perf_counter()
        if recipe.method == "fp" or saved is not None:
            candidate = model
        else:
            candidate = copy.deepcopy(model)
            quantize(
                candidate, recipe, calibration=calibration, progress=progress,
                resume_dir=resume_dir,
            )  # fmt: skip
        quantize_seconds = time.perf_counter() - start
        use_backend(candidate, backend)
        result = evaluate(
            candidate,
            windows,
            reference=reference,
            chunk=args.chunk,
            progress=progress,
            desc=label[:30],
        )
        memory = memory_report(candidate, adapter_for(candidate), kv_context=args.kv_context)
        rows.append(
            {
                "model": loaded.name,
                "recipe": recipe.to_dict(),
                "label": label,
                "dataset": corpus.name,
                "seqlen": args.seqlen,
                "windows": result.windows,
                "tokens": result.tokens,
                "ppl": result.ppl,
                "kl": result.kl,
                "top1": result.top1,
                "bits_per_weight": memory.bits_per_weight,
                "model_bytes": memory.model_bytes,
                "kv_bytes_per_token": memory.kv_bytes_per_token,
                "kv_context": memory.kv_context,
                "calibration": None
                if calibration is None or not recipe.needs_calibration
                else {
                    "corpus": args.calib,
                    "samples": calibration.shape[0],
                    "seqlen": calibration.shape[1],
                    "skip_windows": args.calib_skip,
                    "seed": args.seed,
                },
                "chunk": args.chunk,
                "backend": backend,
                "quantize_seconds": quantize_seconds,
                "eval_seconds": result.seconds,
                "seconds": quantize_seconds + result.seconds,
            }
        )
        if candidate is not model:
            del candidate
    return rows


def run_quantize(args) -> None:
    from pathlib import Path

    from lowbit.data import load_corpus
    from lowbit.eval.memory import memory_report
    from lowbit.io.checkpoint import check_save_target, save
    from lowbit.models.adapter import adapter_for
    from lowbit.models.loader import load_model
    from lowbit.api import quantize

    ((label, recipe),) = build_recipes([args.recipe], parse_settings(args.set))
    if recipe.method == "fp":
        raise LowbitError("recipe fp quantizes nothing: there is no quantized model to save")
    if args.calib_samples < 1:
        raise LowbitError(f"--calib-samples must be at least 1, not {args.calib_samples}")
    out = Path(args.out).expanduser()
    check_save_target(out)  # before the long work
    resume = None if args.resume_dir is None else Path(args.resume_dir).expanduser()
    if resume is not None and resume.resolve() == out.resolve():
        raise LowbitError("--resume-dir must be another directory than --out")
    calib_corpus = load_corpus(args.calib, part="calibration") if recipe.needs_calibration else None
    loaded = load_model(args.model, trust_remote_code=args.trust_remote_code)
    calibration = None
    if calib_corpus is not None:
        calibration = build_calibration(args, calib_corpus, loaded.tokenizer)
    start = time.perf_counter()
    model = quantize(
        loaded.model, recipe, calibration=calibration, progress=not args.no_progress,
        packed=True, resume_dir=args.resume_dir,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    save(model, out, tokenizer=loaded.tokenizer)
    memory = memory_report(model, adapter_for(model))
    print(
        f"wrote {out}: {label}, {memory.bits_per_weight:.3f} bits per weight, "
        f"{memory.model_bytes / 1e6:.1f} MB, quantized in {seconds:.1f} s"
    )


def report(rows: list[dict], args) -> None:
    first = rows[0]
    print(
        f"model: {first['model']}\ndataset: {first['dataset']}, {first['windows']} windows x "
        f"{first['seqlen']} tokens; KV bytes/token at context {first['kv_context']} "
        "(unquantized caches counted in fp16)"
    )
    print(format_table(rows))
    if args.json:
        write_json_atomic(args.json, rows[0] if len(rows) == 1 else rows)
        print(f"wrote {args.json}")


def factor_pow2(n: int) -> str:
    """576 -> '2^6 x 9'."""
    m = 0
    while n and n % 2 == 0:
        n //= 2
        m += 1
    return f"2^{m} x {n}"


def run_info(args) -> None:
    from lowbit.models.adapter import adapter_for
    from lowbit.models.loader import load_model

    loaded = load_model(args.model, trust_remote_code=args.trust_remote_code)
    adapter = adapter_for(loaded.model)
    params = sum(p.numel() for p in {p.data_ptr(): p for p in loaded.model.parameters()}.values())
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
    print(f"parameters: {params:,}")
    print(f"tied embeddings: {'yes' if adapter.tied_embeddings else 'no'}")
    print(f"max context: {adapter.max_context}")
    recipe = getattr(loaded.model, "lowbit_recipe", None)
    if recipe is not None:  # a saved lowbit model
        from lowbit.eval.memory import memory_report

        memory = memory_report(loaded.model, adapter)
        settings = " ".join(f"{k}={v}" for k, v in recipe.settings().items())
        print(f"quantized: {recipe.method} ({settings})")
        print(
            f"bits per weight: {memory.bits_per_weight:.3f}; model: "
            f"{memory.model_bytes / 1e6:.1f} MB; KV cache: {memory.kv_bytes_per_token:.1f} "
            f"bytes per token at context {memory.kv_context}"
        )


def run_recipes() -> None:
    from lowbit.recipes.registry import PRESETS, list_recipes

    for method, cls in list_recipes().items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        print(f"{method}: {doc}")
        for key, value in cls().settings().items():
            print(f"    {key} = {value}")
    print("presets:")
    for name, (method, settings) in PRESETS.items():
        print(f"    {name}: {method} " + " ".join(f"{k}={v}" for k, v in settings.items()))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "eval":
            report(run_eval(args, args.recipe or ["fp"]), args)
        elif args.command == "demo":
            report(run_eval(args, list(DEMO_RECIPES)), args)
        elif args.command == "quantize":
            run_quantize(args)
        elif args.command == "info":
            run_info(args)
        elif args.command == "recipes":
            run_recipes()
    except LowbitError as err:
        print(f"lowbit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowbit: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
