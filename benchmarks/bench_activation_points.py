"""Where QuaRot's 4-bit activations lose accuracy on the embedded model, and what clipping gives.

    python benchmarks/bench_activation_points.py --windows 4 --seqlen 512 --clip-steps 50

The embedded model in float32 with QuaRot's rotation (``rotate+rtn`` with ``w_bits=16
a_bits=4``: weights float, every block linear's input quantized per token, symmetric), KL to the
float model per token on the first WikiText-2 test windows. Two tables:

* **Points**: the activation quantizers of one kind of point on at a time (the inputs of q/k/v,
  of gate/up, of o_proj, of down_proj), then all of them, at QuaRot's clip 0.9.
* **Clip**: all points on, with one clip ratio everywhere, and with one ratio learned per layer
  and kind of point: a sigmoid of a free parameter in a straight-through quantizer, trained by
  Adam on the KL to the float model over ``--clip-steps`` calibration pieces of
  ``--clip-seqlen`` tokens (WikiText-2 windows >= 16, never the evaluated ones), then written
  into each linear's ``ActivationQuantizer.clip_ratio``: the deployed model, no cost at
  inference. An experiment for learned rotations (docs/results/rotations.md), not a recipe.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_window_arguments, command_line, markdown_table, stamp  # noqa: E402

from lowbit.algorithms.rotation_training import LearnedClips, ste_fake_quant  # noqa: E402
from lowbit.api import load_model, quantize  # noqa: E402
from lowbit.data import calibration_samples, eval_windows, load_corpus, tokenize  # noqa: E402
from lowbit.models.adapter import adapter_for  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402
from lowbit.transforms.learned_rotate import ACTIVATION_POINTS  # noqa: E402

#: label of each kind of point (lowbit.transforms.learned_rotate.ACTIVATION_POINTS)
LABELS = {"qkv": "q/k/v input", "gate_up": "gate/up input", "o_proj": "o_proj input",
          "down_proj": "down_proj input"}  # fmt: skip


class _LearnedClip(nn.Module):
    """A per-token quantizer clipped at one point's learned ratio, trainable."""

    def __init__(self, clips: LearnedClips, layer: int, point: str, bits: int):
        super().__init__()
        self.clips, self.layer, self.point, self.bits = clips, layer, point, bits

    def forward(self, x):
        ratio = self.clips.ratio(self.layer, self.point)
        return ste_fake_quant(x, self.bits, symmetric=True, clip_ratio=ratio)


def _quantizers(model) -> dict[tuple[int, str], list[nn.Module]]:
    """``{(layer, kind of point): [linears]}`` of the quantized model."""
    return {
        (view.index, kind): [getattr(view, name) for name in names]
        for view in adapter_for(model).blocks()
        for kind, names in ACTIVATION_POINTS.items()
    }


@torch.no_grad()
def _mean_kl(model, windows, references) -> float:
    total = 0.0
    for ids, ref in zip(windows, references, strict=True):
        log_probs = F.log_softmax(model(input_ids=ids[None]).logits.float(), -1)
        total += float(F.kl_div(log_probs, ref, log_target=True, reduction="none").sum(-1).mean())
    return total / len(windows)


def _learn_clips(model, points, pieces, bits: int, start: float, lr: float):
    """Per (layer, kind of point) clip ratios trained on the KL to the float model."""
    saved = {linear: linear.act_quantizer for linears in points.values() for linear in linears}
    clips = LearnedClips(adapter_for(model).num_layers, start)
    optimizer = torch.optim.Adam(clips.parameters(), lr=lr)
    try:
        for ids in pieces:
            for linear in saved:
                linear.act_quantizer = None
            with torch.no_grad():  # W16: without its quantizers the model is the float model
                target = F.log_softmax(model(input_ids=ids[None]).logits.float(), -1)
            for (layer, point), linears in points.items():
                for linear in linears:
                    linear.act_quantizer = _LearnedClip(clips, layer, point, bits)
            log_probs = F.log_softmax(model(input_ids=ids[None]).logits.float(), -1)
            loss = F.kl_div(log_probs, target, log_target=True, reduction="none").sum(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for linear, quantizer in saved.items():
            linear.act_quantizer = quantizer
    return {(layer, point): ratio for layer, ratios in enumerate(clips.ratios())
            for point, ratio in ratios.items()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser, windows=4, seqlen=512)
    parser.add_argument("--clips", type=float, nargs="+", default=[0.75, 0.8, 0.85, 0.9])
    parser.add_argument("--clip-steps", type=int, default=50)
    parser.add_argument("--clip-seqlen", type=int, default=256)
    parser.add_argument("--clip-lr", type=float, default=3e-2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(None, dtype=torch.float32)
    model, tokenizer = loaded.model, loaded.tokenizer
    tokens = tokenize(tokenizer, load_corpus(args.dataset).text)
    windows = eval_windows(tokens, args.seqlen, args.windows)  # [W, S]
    pieces = calibration_samples(tokens, args.clip_steps, args.clip_seqlen, seed=0,
                                 skip_windows=16)  # fmt: skip
    with torch.no_grad():
        references = [F.log_softmax(model(input_ids=w[None]).logits.float(), -1) for w in windows]
    recipe = get_recipe("rotate+rtn").with_settings(w_bits=16, a_bits=4, a_clip_ratio=0.9)
    quantize(model, recipe, progress=False)
    model.requires_grad_(False)
    points = _quantizers(model)
    quantizers = {linear: linear.act_quantizer for ls in points.values() for linear in ls}

    print(stamp(command_line()))
    print(f"\n{loaded.name}; KL to float over WikiText-2 {len(windows)} x {args.seqlen}.\n")
    rows = []
    for kind in [*ACTIVATION_POINTS, "all"]:
        for (_, point), linears in points.items():
            for linear in linears:
                linear.act_quantizer = quantizers[linear] if kind in (point, "all") else None
        rows.append([LABELS.get(kind, kind), f"{_mean_kl(model, windows, references):.4f}"])
    print(markdown_table(["4-bit activations at (clip 0.9)", "KL"], rows) + "\n")

    rows = []
    for clip in args.clips:
        for quantizer in quantizers.values():
            quantizer.clip_ratio = clip
        rows.append([f"{clip} everywhere", f"{_mean_kl(model, windows, references):.4f}"])
    start = time.perf_counter()
    learned = _learn_clips(model, points, pieces, 4, 0.9, args.clip_lr)
    seconds = time.perf_counter() - start
    for key, linears in points.items():
        for linear in linears:
            linear.act_quantizer.clip_ratio = learned[key]
    means = " / ".join(
        f"{sum(c for (_, p), c in learned.items() if p == kind) / len(learned) * len(LABELS):.2f}"
        for kind in ACTIVATION_POINTS
    )
    rows.append([
        f"learned per layer and point ({args.clip_steps} steps, {seconds:.0f} s; means by point "
        f"{means}, range {min(learned.values()):.2f}-{max(learned.values()):.2f})",
        f"{_mean_kl(model, windows, references):.4f}",
    ])  # fmt: skip
    print(markdown_table(["activation clip (all points)", "KL"], rows))


if __name__ == "__main__":
    main()
