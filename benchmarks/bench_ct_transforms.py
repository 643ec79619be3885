"""Rotated models exported to compressed-tensors, loaded back with their transforms applied.

Per row: the embedded SmolLM2-135M-Instruct quantized by lowbit (fp32), exported with
``export_compressed_tensors`` and loaded by transformers plus compressed-tensors' own
``apply_transform_config`` (``lowbit.models.loader``, the path ``lowbit eval --model EXPORT``
takes). Prints, on ``--windows`` windows of ``--seqlen`` tokens of the pydoc eval text: the mean
KL divergence of the export's next-token distributions from lowbit's model, the largest logit
difference, both perplexities, the float model's, the export's size; and how many of the first
``--new-tokens`` greedy tokens of the README's prompt the export generates as lowbit's model does.

Command::

    python benchmarks/bench_ct_transforms.py --rows quarot-w4a16 quarot-w8a8 --windows 4
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from common import fmt, markdown_table, stamp

PROMPT = "The capital of France is"
# row -> (recipe, settings); RTN weights (GPTQ's would change lowbit's model, not the match)
ROWS = {
    "quarot-w4a16": ("quarot", dict(w_algo="rtn", a_bits=16, kv_bits=16)),
    "quarot-w4a16-g64": ("quarot", dict(w_algo="rtn", a_bits=16, kv_bits=16, w_group=64)),
    "quarot-w8a8": ("quarot", dict(w_algo="rtn", w_bits=8, a_bits=8, kv_bits=16)),
    "quarot-w4a8": ("quarot", dict(w_algo="rtn", w_bits=4, a_bits=8, kv_bits=16)),
    "quarot-w4a16-block64": (
        "quarot",
        dict(w_algo="rtn", a_bits=16, kv_bits=16, hadamard_block=64),
    ),
    "rotate+gptq-w4a16": ("rotate+gptq", dict(w_bits=4)),
}


def _log_probs(model, windows: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(w[None]).logits[0, :-1].float().log_softmax(-1) for w in windows]


def _ppl(log_probs: list[torch.Tensor], windows: torch.Tensor) -> float:
    nll = [-lp.gather(-1, w[1:, None]).mean() for lp, w in zip(log_probs, windows, strict=True)]
    return math.exp(torch.stack(nll).mean().item())


def _greedy(model, tokenizer, new_tokens: int) -> list[int]:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids  # [1, S]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)  # [1, S + T]
    return out[0, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["quarot-w4a16", "quarot-w8a8"])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--workdir", default=None, help="keep the exports here")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from lowbit.api import load_model, quantize
    from lowbit.data import calibration_samples, eval_windows, load_corpus, tokenize
    from lowbit.io.compressed_tensors import export_compressed_tensors
    from lowbit.models.loader import load_model as load_float
    from lowbit.recipes.registry import get_recipe

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lowbit-ct-"))
    loaded = load_model(None)
    tokenizer = loaded.tokenizer
    windows = eval_windows(tokenize(tokenizer, load_corpus("pydoc").text), args.seqlen)
    windows = windows[: args.windows]  # [N, S]
    float_ppl = _ppl(_log_probs(loaded.model, windows), windows)
    rows = []
    for row in args.rows:
        method, settings = ROWS[row]
        recipe = get_recipe(method, **settings)
        calibration = None
        if recipe.needs_calibration:
            calib_text = load_corpus("pydoc", part="calibration").text
            calibration = calibration_samples(tokenize(tokenizer, calib_text), 16, 512, seed=0)
        model = load_model(None).model
        start = time.perf_counter()
        quantize(model, recipe, calibration=calibration, progress=False)
        out = workdir / row
        export_compressed_tensors(model, out, tokenizer=tokenizer)
        seconds = time.perf_counter() - start
        exported = load_float(out).model  # transformers + compressed-tensors' transforms
        mine, theirs = _log_probs(model, windows), _log_probs(exported, windows)
        kl = torch.stack(
            [(m.exp() * (m - t)).sum(-1).mean() for m, t in zip(mine, theirs, strict=True)]
        ).mean()
        diff = max((m - t).abs().max().item() for m, t in zip(mine, theirs, strict=True))
        a, b = (
            _greedy(model, tokenizer, args.new_tokens),
            _greedy(exported, tokenizer, args.new_tokens),
        )
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
        rows.append([
            row, fmt(_ppl(mine, windows), ".3f"), fmt(_ppl(theirs, windows), ".3f"),
            f"{kl.item():.2e}", f"{diff:.2e}", f"{same}/{len(a)}", fmt(size, ".1f"),
            fmt(seconds, ".0f"),
        ])  # fmt: skip
        print(f"{row}: lowbit {tokenizer.decode(a)!r} | export {tokenizer.decode(b)!r}", flush=True)
        del model, exported
    header = ["row", "lowbit ppl", "export ppl", "KL(lowbit‖export)", "max |Δ log p|",
              "greedy tokens equal", "MiB", "quantize+export s"]  # fmt: skip
    print(f"\nfloat ppl {float_ppl:.3f} on {len(windows)} pydoc windows of {args.seqlen} tokens")
    print(markdown_table(header, rows))
    print(stamp("python benchmarks/bench_ct_transforms.py"))


if __name__ == "__main__":
    main()
