"""Activation outliers of q_proj and down_proj inputs before and after QuaRot's rotation.

Run: ``python benchmarks/bench_outliers.py [--windows 4] [--seqlen 512] [--every 1]``
Loads the embedded model (or ``--model``), feeds ``--windows`` pydoc evaluation windows through
the float model and through a rotated copy (``rotate_model``), and prints per layer, for the
input each linear multiplies (after its online transform, if any):

* kurt: Pearson kurtosis over all token × channel values (a Gaussian gives 3); a few
  tokens of huge norm (attention sinks) keep it high even when every token is flat;
* tok kurt: kurtosis over the channels of each token, averaged over tokens;
* max/RMS: largest |x| over the RMS of all values;
* tok max/RMS: the same ratio per token, averaged over tokens (the range a per-token int
  grid must cover).

It also prints the largest |Δlogit| between the two models on the same windows.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import time

import torch

from lowbit.api import load_model
from lowbit.data import eval_windows, load_corpus, tokenize
from lowbit.models.adapter import adapter_for
from lowbit.transforms.rotate import rotate_model


class InputMoments:
    """Running moments of the input a linear multiplies, in float64."""

    def __init__(self):
        self.count = 0
        self.tokens = 0
        self.sums = torch.zeros(4, dtype=torch.float64)  # Σx, Σx², Σx³, Σx⁴
        self.peak = 0.0
        self.token_ratio_sum = 0.0
        self.token_kurtosis_sum = 0.0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)  # [T, n]
        self.count += x.numel()
        self.tokens += x.shape[0]
        self.sums += torch.stack([x.sum(), (x**2).sum(), (x**3).sum(), (x**4).sum()])
        self.peak = max(self.peak, x.abs().max().item())
        token_rms = x.pow(2).mean(dim=-1).sqrt().clamp_min(1e-30)  # [T]
        self.token_ratio_sum += (x.abs().amax(dim=-1) / token_rms).sum().item()
        centered = x - x.mean(dim=-1, keepdim=True)  # [T, n]
        variance = centered.pow(2).mean(dim=-1).clamp_min(1e-30)  # [T]
        self.token_kurtosis_sum += (centered.pow(4).mean(dim=-1) / variance**2).sum().item()

    def kurtosis(self) -> float:
        m1, m2, m3, m4 = (self.sums / self.count).tolist()
        variance = m2 - m1 * m1
        fourth = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
        return fourth / variance**2

    def max_over_rms(self) -> float:
        return self.peak / (self.sums[1].item() / self.count) ** 0.5

    def token_kurtosis(self) -> float:
        return self.token_kurtosis_sum / self.tokens

    def token_max_over_rms(self) -> float:
        return self.token_ratio_sum / self.tokens


def measure(model, windows: torch.Tensor, layers: list[int]):
    """Moments of q_proj and down_proj inputs per layer, and the logits: ({...}, [N, S, V])."""
    adapter = adapter_for(model)
    stats, handles = {}, []
    for index in layers:
        view = adapter.block(index)
        for name in ("q_proj", "down_proj"):
            linear = getattr(view, name)
            moments = stats[index, name] = InputMoments()

            def hook(module, args, moments=moments):
                x = args[0]
                transform = getattr(module, "input_transform", None)
                moments.add(x if transform is None else transform(x))

            handles.append(linear.register_forward_pre_hook(hook))
    logits = []
    try:
        with torch.no_grad():
            for window in windows:
                logits.append(model(window[None]).logits[0])  # [S, V]
    finally:
        for handle in handles:
            handle.remove()
    return stats, torch.stack(logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model spec (default: embedded)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--every", type=int, default=1, help="report every k-th layer")
    parser.add_argument("--rotation", default="hadamard", choices=["hadamard", "random", "none"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    loaded = load_model(args.model)
    model = loaded.model.float().eval()
    corpus = load_corpus("pydoc", part="eval")
    windows = eval_windows(tokenize(loaded.tokenizer, corpus.text), args.seqlen, args.windows)
    layers = list(range(0, adapter_for(model).num_layers, args.every))

    before, logits_before = measure(model, windows, layers)
    rotated = copy.deepcopy(model)
    start = time.perf_counter()
    report = rotate_model(rotated, rotation=args.rotation, seed=args.seed)
    rotate_s = time.perf_counter() - start
    after, logits_after = measure(rotated, windows, layers)

    print(f"{loaded.name}; {corpus.name}; {args.windows} x {args.seqlen} tokens")
    print(f"{datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, fp32")
    print(report.summary())
    delta = (logits_after - logits_before).abs().max().item()
    print(f"rotate_model: {rotate_s:.1f} s; max |Δlogit| rotated vs float: {delta:.2e}")
    print()
    columns = ("kurt", "tok kurt", "max/RMS", "tok max/RMS")
    title = ("q_proj input (before -> after)", "down_proj input (before -> after)")
    print(f"{'':>5} | {title[0]:^63} | {title[1]:^63}")
    print(f"{'layer':>5} | " + " | ".join(" ".join(f"{c:>15}" for c in columns) for _ in range(2)))
    for index in layers:
        cells = []
        for name in ("q_proj", "down_proj"):
            old, new = before[index, name], after[index, name]
            pairs = (
                (old.kurtosis(), new.kurtosis()),
                (old.token_kurtosis(), new.token_kurtosis()),
                (old.max_over_rms(), new.max_over_rms()),
                (old.token_max_over_rms(), new.token_max_over_rms()),
            )
            cells.append(" ".join(f"{f'{a:.1f} -> {b:.1f}':>15}" for a, b in pairs))
        print(f"{index:>5} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
