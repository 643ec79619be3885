"""GPTQ calibration of a 7B-shaped random Llama held on the CPU, computed block by block on a GPU.

    python benchmarks/bench_gptq_gpu.py --device cuda --samples 128 --seqlen 2048 --threads 16

(32 layers; ``--layers 4`` measures the same per-block figures in an eighth of the time). It
builds a random-weight Llama of Llama-2-7B's shape (hidden 4096, 32 layers, intermediate 11008,
32 heads, vocabulary 32000) on the CPU in bf16, and quantizes it with ``gptq`` (W4, groups of
128, act-order, RTN guard) on random calibration token ids with
``lowbit.quantize(..., device=--device)``: the model stays on the CPU and each block goes to the
device with one calibration sample's activations at a time (the captured hidden states of all
samples stay on the CPU). Checked on the CPU here with a small shape:

    python benchmarks/bench_gptq_gpu.py --device cpu --layers 2 --hidden 256 \\
        --intermediate 512 --heads 4 --vocab 1000 --samples 8 --seqlen 128

The table has one row per block: wall seconds (Hessian pass, GPTQ of its seven linears, the
pass that propagates the quantized block's outputs), the peak of
``torch.cuda.max_memory_allocated`` while it was on the device, and the analytic bytes the
device must hold for it: the block's parameters, one sample's activations through the block,
the Hessian sums (fp32, q/k/v and gate/up sharing theirs, the guard's held-out split apart),
and GPTQ's transient workspace for the widest linear (the float64 Hessian, its Cholesky and
inverse factors, fp32 copies of the weight). Block 0's row includes the capture of its inputs
(the embeddings on the device); ``setup`` is what precedes it (checks, the recipe).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, fmt, markdown_table, stamp  # noqa: E402

from lowbit.api import quantize  # noqa: E402
from lowbit.models.adapter import adapter_for  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402

GIB = 1 << 30


def build_model(args) -> torch.nn.Module:
    """A random-weight Llama of the requested shape on the CPU (HF's own initialization)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=max(4096, args.seqlen),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    return model.eval()


def analytic_bytes(block: torch.nn.Module, adapter, seqlen: int, guard: bool) -> dict[str, int]:
    """Bytes the compute device holds for one block (see the module docstring)."""
    hidden, inter = adapter.hidden_size, adapter.intermediate_size
    element = next(block.parameters()).element_size()
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    # in and out hidden states, q/k/v/attention output, gate/up/act products, fp32 rows of the
    # widest input for the Hessian update
    activations = (6 * seqlen * hidden + 3 * seqlen * inter) * element + 4 * seqlen * inter
    splits = 2 if guard else 1
    hessians = 4 * splits * (3 * hidden * hidden + inter * inter)  # q/k/v, o, gate/up, down
    widest = max(adapter.block(0).linears().values(), key=lambda m: m.weight.shape[1])
    out_features, n = widest.weight.shape
    # float64 H, eye, H + λI, L, U (5 n²) and U in fp32; W, Wᵀ, codes, values, RTN candidate
    workspace = 5 * 8 * n * n + 4 * n * n + 6 * 4 * out_features * n
    return dict(params=params, activations=activations, hessians=hessians, workspace=workspace)


class BlockClock:
    """Wall time and device peak memory between the first calls of consecutive blocks."""

    def __init__(self, blocks: torch.nn.ModuleList, device: torch.device):
        self.device = device
        self.rows: list[tuple[str, float, int | None]] = []  # (label, seconds, peak bytes)
        self._handles = [
            block.register_forward_pre_hook(self._hook(i)) for i, block in enumerate(blocks)
        ]
        self._seen: set[int] = set()
        self._label, self._start = "setup", self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _close(self, label: str) -> None:
        now = self._now()
        peak = None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.rows.append((self._label, now - self._start, peak))
        self._label, self._start = label, self._now()

    def _hook(self, index: int):
        def hook(_module, _args):
            if index not in self._seen:
                self._seen.add(index)
                self._close("0 + capture" if index == 0 else str(index))

        return hook

    def finish(self) -> None:
        self._close("")
        for handle in self._handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="compute device (cuda, cuda:1, cpu)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--w-bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=128, help="0 = per output channel")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA")

    start = time.perf_counter()
    model = build_model(args)
    built = time.perf_counter() - start
    adapter = adapter_for(model)
    generator = torch.Generator(device="cpu").manual_seed(0)
    calibration = torch.randint(
        0, args.vocab, (args.samples, args.seqlen), generator=generator, device="cpu"
    )  # [N, S] on the CPU: quantize moves one sample at a time
    recipe = get_recipe("gptq").with_settings(w_bits=args.w_bits, w_group=args.group or None)
    figures = analytic_bytes(adapter.block(0).block, adapter, args.seqlen, recipe.guard)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = BlockClock(adapter.blocks_module, device)
    quantize(model, recipe, calibration=calibration, device=device, progress=False)
    clock.finish()
    total = sum(seconds for _, seconds, _ in clock.rows)

    analytic = sum(figures.values())
    header = ["block", "wall s", "peak GiB", "analytic GiB", "peak / analytic"]
    rows = []
    for label, seconds, peak in clock.rows:
        expected = analytic if label != "setup" else None
        ratio = None if peak is None or expected is None else peak / expected
        rows.append(
            [
                label,
                f"{seconds:.2f}",
                fmt(None if peak is None else peak / GIB, ".2f"),
                fmt(None if expected is None else expected / GIB, ".2f"),
                fmt(ratio, ".2f"),
            ]
        )
    print(stamp(command_line()))
    print(
        f"Model: random Llama, hidden {args.hidden}, {args.layers} layers, intermediate "
        f"{args.intermediate}, {args.heads} heads, vocabulary {args.vocab}, {args.dtype}, on the "
        f"CPU (built in {built:.1f} s); gptq W{args.w_bits} "
        f"{'g' + str(args.group) if args.group else 'per channel'}, act-order, guard; "
        f"{args.samples} x {args.seqlen} random token ids; compute device {device}."
    )
    print(
        "Analytic per block: "
        + ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in figures.items())
        + f"; total {analytic / GIB:.2f} GiB."
    )
    print()
    print(markdown_table(header, rows))
    print()
    print(f"Total calibration: {total:.1f} s ({total / max(args.layers, 1):.2f} s per block).")


if __name__ == "__main__":
    main()
