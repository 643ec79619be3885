"""Passkey retrieval with quantized KV caches: does the model still find a number in long context?

    python benchmarks/bench_passkey.py --contexts 2048 4096 8192 --depths 0 0.25 0.5 0.75 1 \\
        --trials 3 --caches fp kv-int quarot-kv kivi kvquant ksort-bfp

A five-digit number is hidden at a relative depth of filler text, after an intro that says
something is hidden (the task of Mohtashami & Jaggi's landmark-attention paper); the prompt
ends by asking for it; the model (embedded SmolLM2-135M-Instruct) greedily generates 8 tokens
through the row's cache, and the trial counts as found when the number appears in them. The
prompt is prefilled through the quantized cache (lowbit's caches quantize the prefill's keys
and values too), then decoding reads the cached, quantized context. Accuracy per depth, over
``--trials`` numbers. KVQuant calibrates on 4 x 512 tokens of the pydoc calibration text.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, markdown_table, stamp  # noqa: E402

from lowbit.api import (
    load_model,  # noqa: E402
    quantize,  # noqa: E402
)
from lowbit.data import calibration_samples, load_corpus, tokenize  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402

# the passkey task of Mohtashami & Jaggi (2023, "Landmark Attention"): intro, filler, needle
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about the important information there.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "\nWhat is the pass key? The pass key is"

# cache name -> (method, settings)
CACHES = {
    "fp": None,
    "kv-int": ("kv-int", {"bits": 4}),  # per-token int4, keys after RoPE
    "quarot-kv": ("quarot", {"w_bits": 16, "a_bits": 16, "kv_bits": 4}),  # + Hadamard on q/k
    "kivi": ("kivi", {"bits": 2}),
    "kvquant": ("kvquant", {"bits": 3}),
    "ksort-bfp": ("ksort-bfp", {}),
}


def passkey_prompt(tokenizer, context: int, depth: float, key: int) -> torch.Tensor:
    """Token ids [1, ~context]: the intro, then filler with the key sentence inserted at
    ``depth`` of it, then the question."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = INTRO + needle + QUESTION
    budget = context - len(tokenizer(fixed, add_special_tokens=False).input_ids)
    filler_ids = tokenizer(FILLER, add_special_tokens=False).input_ids
    repeats = max(1, budget // len(filler_ids))
    cut = round(depth * repeats)
    text = INTRO + FILLER * cut + needle + FILLER * (repeats - cut) + QUESTION
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(None)
    tokenizer = loaded.tokenizer
    calibration = calibration_samples(
        tokenize(tokenizer, load_corpus("pydoc", part="calibration").text), 4, 512, seed=0
    )
    keys = random.Random(0).sample(range(10000, 100000), args.trials)
    print(stamp(command_line()))
    print(f"{loaded.name}; greedy 8 new tokens; {args.trials} pass keys per cell.\n")
    header = ["cache", "context"] + [f"depth {d:g}" for d in args.depths] + ["all"]
    rows = []
    for name in args.caches:
        model = loaded.model
        if CACHES[name] is not None:
            method, settings = CACHES[name]
            model = copy.deepcopy(loaded.model)
            quantize(model, get_recipe(method, **settings), calibration=calibration, progress=False)
        for context in args.contexts:
            found = []
            for depth in args.depths:
                hits = 0
                for key in keys:
                    ids = passkey_prompt(tokenizer, context, depth, key)
                    with torch.no_grad():
                        kwargs = {}
                        if hasattr(model, "lowbit_make_cache"):
                            kwargs["past_key_values"] = model.lowbit_make_cache()
                        out = model.generate(
                            ids,
                            attention_mask=torch.ones_like(ids),
                            max_new_tokens=8,
                            do_sample=False,
                            pad_token_id=tokenizer.eos_token_id,
                            **kwargs,
                        )
                    hits += str(key) in tokenizer.decode(out[0, ids.shape[1] :])
                found.append(hits)
            total = len(keys) * len(args.depths)
            rows.append(
                [name, str(context)]
                + [f"{h}/{len(keys)}" for h in found]
                + [f"{sum(found) / total:.0%}"]
            )
            print(" | ".join(rows[-1]), flush=True)
        if model is not loaded.model:
            del model
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
