"""Where QuaRot's 4-bit round-to-nearest weights lose accuracy: fusion, rotation, clip search.

    python benchmarks/bench_fusion.py --windows 1 --seqlen 512

W4A16 per-output-channel RTN (symmetric, fp16 scales) on the embedded model after each
function-preserving step that QuaRot applies (none; RMSNorm scales fused into the linears;
fused + randomized-Hadamard rotation; fused + random orthogonal rotation), each with and without
the MSE clip search. WikiText-2 test windows; ppl and KL to the fp model. Also prints, every
5 layers, max/mean of the RMSNorm gains that fusion folds into the weight columns.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_window_arguments, command_line, markdown_table, stamp  # noqa: E402

from lowbit.algorithms.int_spec import IntWeightSpec  # noqa: E402
from lowbit.algorithms.weights import quantize_linears  # noqa: E402
from lowbit.api import load_model  # noqa: E402
from lowbit.data import eval_windows, load_corpus, tokenize  # noqa: E402
from lowbit.eval.evaluate import FloatReference, evaluate  # noqa: E402
from lowbit.models.adapter import adapter_for  # noqa: E402
from lowbit.transforms.fuse import fuse_norms  # noqa: E402
from lowbit.transforms.rotate import rotate_model  # noqa: E402

STEPS = {
    "none": lambda model: None,
    "norms fused": fuse_norms,
    "fused + Hadamard rotation": lambda model: rotate_model(model, rotation="hadamard"),
    "fused + random orthogonal": lambda model: rotate_model(model, rotation="random"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser, windows=1, seqlen=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(None)
    model = loaded.model
    windows = eval_windows(
        tokenize(loaded.tokenizer, load_corpus(args.dataset).text), args.seqlen, args.windows
    )
    reference = FloatReference(model)
    print(stamp(command_line()))
    print(f"{windows.shape[0]} windows x {args.seqlen} tokens; W4A16 per-channel RTN.\n")

    adapter = adapter_for(model)
    gains = [
        f"{i}: {(b.input_norm.weight.abs().max() / b.input_norm.weight.abs().mean()).item():.1f}"
        for i, b in enumerate(adapter.blocks())
        if i % 5 == 0
    ]
    print("input RMSNorm gain max/mean by layer:", ", ".join(gains), "\n")

    rows = [
        ["fp (no quantization)", "—", f"{evaluate(model, windows, progress=False).ppl:.2f}", "0"]
    ]
    for name, step in STEPS.items():
        for mse in (False, True):
            candidate = copy.deepcopy(model)
            step(candidate)
            quantize_linears(
                candidate,
                adapter_for(candidate),
                spec_for=lambda fqn, mse=mse: IntWeightSpec(4, None, True, mse),
                algo="rtn",
                progress=False,
            )
            result = evaluate(candidate, windows, reference=reference, progress=False)
            rows.append([name, "yes" if mse else "no", f"{result.ppl:.2f}", f"{result.kl:.4f}"])
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(markdown_table(["before W4A16 RTN", "MSE clip", "ppl", "KL"], rows))


if __name__ == "__main__":
    main()
