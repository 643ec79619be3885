"""What block-diagonal online Hadamards (``hadamard_block``) cost in accuracy against full ones.

A tensor-parallel shard can apply a block-diagonal Hadamard ``I ⊗ H_b`` alone when ``b`` divides
its share of the channels; a full-width one needs every shard's. Per corpus, the embedded
SmolLM2-135M-Instruct under QuaRot W4A16 and W4A4KV4 with the online Hadamards full-width and
in blocks (``--blocks``; each must divide 576 and 1536: 64 and 192 do, 128 does not), one
``evaluate_recipes`` table each (the float model runs once per corpus).

Command::

    python benchmarks/bench_hadamard_blocks.py --windows 8 --seqlen 512 \\
        --corpora pydoc /work/shared/data/wikitext-2-raw/wiki.test.raw
"""

from __future__ import annotations

import argparse

from common import fmt, markdown_table, stamp

# row -> quarot settings; RTN weights (--w-algo gptq for the paper's GPTQ)
ROWS = {
    "W4A16": dict(a_bits=16, kv_bits=16),
    "W4A4KV4": dict(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", nargs="+", default=["pydoc"])
    parser.add_argument("--blocks", nargs="+", default=["full", "64", "192"])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--w-algo", default="rtn", choices=["rtn", "gptq"])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=512)
    args = parser.parse_args()

    from lowbit.eval.run import evaluate_recipes
    from lowbit.recipes.registry import get_recipe

    recipes = []
    for row in args.rows:
        for block in args.blocks:
            settings = dict(ROWS[row], w_algo=args.w_algo)
            if block != "full":
                settings["hadamard_block"] = int(block)
            recipes.append((f"{row} block {block}", get_recipe("quarot", **settings)))
    table = []
    for corpus in args.corpora:
        results = evaluate_recipes(
            None, recipes, dataset=corpus, seqlen=args.seqlen, windows=args.windows,
            calib_seqlen=args.seqlen, progress=False,
        )  # fmt: skip
        for result in results:
            table.append([
                corpus.rsplit("/", 1)[-1], result["label"], fmt(result["ppl"], ".3f"),
                fmt(result["kl"], ".4f"), fmt(result["top1"], ".3f"),
            ])  # fmt: skip
            print(" | ".join(table[-1]), flush=True)
    print(markdown_table(["corpus", "recipe (quarot, " + args.w_algo + ")", "ppl", "KL", "top-1"],
                         table))  # fmt: skip
    print(stamp("python benchmarks/bench_hadamard_blocks.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
    )))  # fmt: skip


if __name__ == "__main__":
    main()
