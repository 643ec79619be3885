"""Memory a packed model really holds, against the float model and the analytic bytes.

Each row runs in a fresh Python process, so its figures are that model's alone:

* CPU (default: the embedded SmolLM2): anonymous resident memory (``RssAnon`` in
  ``/proc/self/status``) once the model is ready, every tensor copied out of the memory-mapped
  file (so a load that maps the file and one that copies it compare alike), and one short
  forward pass run, minus the same figure before the model was created (after the same code
  ran once on a tiny model, so imports and allocator pools are not counted), both read after ``malloc_trim`` so memory the allocator freed but kept is not
  counted; and the process's peak resident set (``VmHWM``, loading included). ``fp32`` / ``bf16``
  load the float model; ``W8 / W4 / W3 / W2`` load a checkpoint that ``lowbit.save`` wrote
  (packed codes, fp16 scales, float embeddings and norms), as a user deploying it would.
* GPU (``--device cuda``; a 7B-shaped random-weight Llama by default): ``torch.cuda
  .memory_allocated`` once the model is on the GPU and ``max_memory_allocated`` during
  quantization, fp16 against RTN-packed W8/W4/W3/W2 (quantized on the GPU, float weights freed).

Beside them: the bytes of every parameter and buffer the model holds (measured from the
tensors) and lowbit's analytic ``model_bytes`` (``lowbit.eval.memory``). Commands::

    python benchmarks/bench_memory.py                      # CPU, SmolLM2 (~3 minutes)
    python benchmarks/bench_memory.py --device cuda --shape 7b   # GPU, 7B-shaped random Llama
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = {  # label -> (recipe or None for float, float dtype)
    "fp32": (None, "float32"),
    "bf16": (None, "bfloat16"),
    "fp16": (None, "float16"),
    "W8 per-channel": ("w8a16", "float32"),
    "W4 g64": ("w4a16-g64", "float32"),
    "W4 g64, bf16 rest": ("w4a16-g64", "bfloat16"),
    "W4 g128": ("w4a16-g128", "float32"),
    "W3 g64": ("rtn:w_bits=3,w_group=64", "float32"),
    "W2 g64": ("rtn:w_bits=2,w_group=64", "float32"),
}

SHAPES = {  # a random-weight Llama of a real model's shape
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
}  # fmt: skip

CHILD = r"""
import ctypes, gc, json, sys, torch, transformers, lowbit
from lowbit.eval.memory import memory_report
from lowbit.models.adapter import adapter_for

def rss(field="VmRSS"):
    if not cuda:  # hand memory freed but kept by malloc back to the OS: count live memory only
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
cuda = args["device"] == "cuda"
def warm_up():  # import and run every code path once on a tiny model, so "before" includes it
    from lowbit.models.tiny import tiny_model
    tiny = tiny_model("llama").to(args["device"])
    if args["recipe"] or args["checkpoint"]:
        lowbit.quantize(tiny, "w4a16", progress=False, packed=True)
    with torch.no_grad():
        tiny(torch.zeros(1, 16, dtype=torch.long, device=args["device"]))

warm_up()
gc.collect()
before = torch.cuda.memory_allocated() if cuda else rss("RssAnon")
if args["checkpoint"]:
    model = lowbit.load(args["checkpoint"], dtype=getattr(torch, args["dtype"]))
elif args["source"] == "embedded":
    from lowbit.api import load_model
    model = load_model(None, dtype=getattr(torch, args["dtype"])).model
else:
    config = transformers.LlamaConfig(**args["shape"], tie_word_embeddings=False)
    with torch.device(args["device"]):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, args["dtype"])).eval()
    if args["recipe"]:
        recipe = args["recipe"]
        if ":" in recipe:
            method, settings = recipe.split(":")
            recipe = lowbit.get_recipe(method, **dict(s.split("=") for s in settings.split(",")))
        lowbit.quantize(model, recipe, progress=False, packed=True)
if not cuda:  # copy every tensor to anonymous memory: mmap'd and copied loads then compare alike
    for module in model.modules():
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                t.data = t.data.clone()
gc.collect()
with torch.no_grad():  # one short forward: the model runs, and its transient buffers exist
    model(torch.zeros(1, 16, dtype=torch.long, device=args["device"]))
gc.collect()
tensors = {t.data_ptr(): t.numel() * t.element_size()
           for t in list(model.parameters()) + list(model.buffers())}
result = {
    "held": (torch.cuda.memory_allocated() if cuda else rss("RssAnon")) - before,
    "peak": torch.cuda.max_memory_allocated() - before if cuda else rss("VmHWM"),
    "tensor_bytes": sum(tensors.values()),
    "model_bytes": memory_report(model, adapter_for(model)).model_bytes,
}
print("RESULT " + json.dumps(result))
"""


def run_child(args: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"row {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def save_checkpoint(recipe: str, directory: Path) -> None:
    """Quantize the embedded model (RTN, packed) and save it, in a child process."""
    code = (
        "import lowbit, sys\n"
        "from lowbit.api import load_model\n"
        "loaded = load_model(None)\n"
        "recipe = sys.argv[1]\n"
        "if ':' in recipe:\n"
        "    method, settings = recipe.split(':')\n"
        "    recipe = lowbit.get_recipe(method, **dict(s.split('=') for s in settings.split(',')))\n"
        "model = lowbit.quantize(loaded.model, recipe, progress=False, packed=True)\n"
        "lowbit.save(model, sys.argv[2], tokenizer=loaded.tokenizer)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, recipe, str(directory)], capture_output=True)
    if proc.returncode:
        raise SystemExit(proc.stderr.decode()[-3000:])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from common import command_line, markdown_table, stamp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="random-weight Llama of this shape (default: the embedded model on "
                        "CPU, 7b on CUDA)")  # fmt: skip
    parser.add_argument("--rows", nargs="+", default=None, choices=list(ROWS))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # what the stamp reports: each row's process sets it
    shape = args.shape or ("7b" if args.device == "cuda" else None)
    float_rows = ("fp16",) if args.device == "cuda" else ("fp32", "bf16")
    packed_rows = ["W8 per-channel", "W4 g64", *(["W4 g128"] if shape == "7b" else []), "W3 g64",
                   "W2 g64", *(["W4 g64, bf16 rest"] if shape is None else [])]  # fmt: skip
    rows = args.rows or [*float_rows, *packed_rows]

    table, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for label in rows:
            recipe, dtype = ROWS[label]
            if args.device == "cuda" and recipe is not None:
                dtype = "float16"
            child = dict(threads=args.threads, device=args.device, dtype=dtype, recipe=None,
                         checkpoint=None, shape=SHAPES.get(shape), source=shape or "embedded")  # fmt: skip
            if recipe is not None and shape is None:  # embedded model: load what lowbit saved
                directory = Path(tmp) / recipe.replace(":", "-").replace(",", "-")
                if not directory.exists():
                    save_checkpoint(recipe, directory)
                child["checkpoint"] = str(directory)
            elif recipe is not None:
                child["recipe"] = recipe
            result = run_child(child)
            reference = reference or result["held"]
            table.append([
                label, f"{result['held'] / 2**20:.1f}", f"{result['peak'] / 2**20:.1f}",
                f"{result['tensor_bytes'] / 2**20:.1f}", f"{result['model_bytes'] / 2**20:.1f}",
                f"{reference / result['held']:.2f}x",
            ])  # fmt: skip
            print(table[-1], flush=True)
    held, peak = (
        ("RssAnon", "peak RSS") if args.device == "cpu" else ("allocated", "peak allocated")
    )
    header = ["model", f"{held} MiB", f"{peak} MiB", "tensors MiB",
              "analytic MiB", f"{rows[0]} / row"]  # fmt: skip
    print()
    print(stamp(command_line()))
    print(f"Model: {shape or 'embedded SmolLM2-135M-Instruct'}; packed rows are RTN (codes and "
          "fp16 scales) with the unquantized parts (embeddings, norms) in fp32 unless the row "
          "says otherwise.")  # fmt: skip
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
