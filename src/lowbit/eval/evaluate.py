"""Perplexity, KL divergence and top-1 agreement over token windows.

For every window of S tokens the model predicts tokens 1..S-1 from the positions 0..S-2; those
S-1 next-token distributions per window are what all three measures use:
- perplexity = exp(mean next-token NLL over all windows and positions);
- KL = mean over the same positions of KL(p_ref || p_model), p_ref from the float model;
- top-1 = fraction of those positions where both models' most likely token agree.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from lowbit.models.compat import CACHE_KWARG


@dataclass
class EvalResult:
    ppl: float
    nll: float  # mean next-token negative log-likelihood (nats)
    kl: float | None  # mean KL(p_ref || p_model) in nats; None without a reference
    top1: float | None  # top-1 agreement with the reference; None without one
    windows: int
    tokens: int  # tokens evaluated (windows x seqlen)
    seconds: float


def window_logits(model: torch.nn.Module, window: torch.Tensor, chunk: int | None = None):
    """Logits of one window: [S] -> [S, V] in fp32, on the model's device (the token ids may
    be anywhere).

    With ``chunk`` the window is fed in pieces of that many tokens through the model's KV
    cache, so later tokens attend to cached (possibly quantized) earlier ones. A model run by
    another engine (:class:`lowbit.eval.llama_cpp.LlamaCppModel`) gives its own logits.
    """
    engine = getattr(model, "window_logits", None)
    if engine is not None:
        return engine(window)  # [S, V]
    ids = window.to(_input_device(model)).unsqueeze(0)  # [1, S]
    if chunk is None or chunk >= ids.shape[1]:
        return model(ids, use_cache=False).logits[0].float()
    from transformers import DynamicCache

    cache = getattr(model, "lowbit_make_cache", None)
    past = cache() if cache is not None else DynamicCache()
    pieces = []
    for start in range(0, ids.shape[1], chunk):
        out = model(ids[:, start : start + chunk], use_cache=True, **{CACHE_KWARG: past})
        past = getattr(out, CACHE_KWARG)
        pieces.append(out.logits[0].float())
    return torch.cat(pieces, dim=0)


def _input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's token embeddings are, so where its input ids go."""
    return model.get_input_embeddings().weight.device


class FloatReference:
    """Next-token log-probabilities of the unquantized model, computed once per window.

    Caches fp32 log-probs [S-1, V] per window up to ``max_cache_bytes``; windows past the
    budget are recomputed when asked for again.
    """

    def __init__(self, model: torch.nn.Module, max_cache_bytes: int = 4 << 30):
        self.model = model
        self.max_cache_bytes = max_cache_bytes
        self._cache: dict[bytes, torch.Tensor] = {}
        self._cached_bytes = 0

    def logprobs(self, window: torch.Tensor) -> torch.Tensor:
        key = window.cpu().numpy().tobytes()  # keyed by content: 8 bytes per token
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        with torch.no_grad():
            logprobs = F.log_softmax(window_logits(self.model, window)[:-1], dim=-1)
        size = logprobs.numel() * logprobs.element_size()
        if self._cached_bytes + size <= self.max_cache_bytes:
            self._cache[key] = logprobs
            self._cached_bytes += size
        return logprobs


def evaluate(
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    reference: FloatReference | None = None,
    chunk: int | None = None,
    progress: bool = True,
    desc: str = "eval",
) -> EvalResult:
    """Evaluate ``model`` on token windows.

    Args:
        model: causal LM.
        windows: [N, S] token ids.
        reference: the float model's log-probs, for KL and top-1.
        chunk: feed each window in chunks of this many tokens through the KV cache.
        progress: show a progress bar.
    """
    start = time.perf_counter()
    totals = Totals()
    with torch.no_grad():
        for window in tqdm(windows, desc=desc, disable=not progress, leave=False):
            if reference is not None and reference.model is model and chunk is None:
                logprobs = reference.logprobs(window)  # the reference itself: one pass, not two
            else:
                logits = window_logits(model, window, chunk)  # [S, V]
                logprobs = F.log_softmax(logits[:-1], dim=-1)  # [S-1, V]
            targets = window[1:].to(logprobs.device)  # [S-1]
            ref = None
            if reference is not None:
                ref = reference.logprobs(window).to(logprobs.device)  # [S-1, V]
            totals.add(logprobs, targets, ref)
    return totals.result(windows, start, with_reference=reference is not None)


class Totals:
    """Sums of negative log-likelihood, KL to a reference and top-1 agreements over the tokens
    seen, chunk by chunk: what :func:`evaluate` and the streamed evaluation both report."""

    def __init__(self) -> None:
        self.nll = self.kl = 0.0
        self.agree = self.count = 0

    def add(self, logprobs: Tensor, targets: Tensor, ref: Tensor | None = None) -> None:
        """``logprobs`` [C, V] of the model, ``targets`` [C], ``ref`` [C, V] or None."""
        self.nll -= logprobs.gather(1, targets[:, None]).sum().item()
        self.count += targets.numel()
        if ref is not None:
            self.kl += F.kl_div(logprobs, ref, log_target=True, reduction="sum").item()
            self.agree += (logprobs.argmax(-1) == ref.argmax(-1)).sum().item()

    def result(self, windows: Tensor, start: float, *, with_reference: bool) -> EvalResult:
        """The :class:`EvalResult` of ``windows`` [N, S], timed from ``start``."""
        nll = self.nll / self.count
        return EvalResult(
            ppl=math.exp(nll),
            nll=nll,
            kl=self.kl / self.count if with_reference else None,
            top1=self.agree / self.count if with_reference else None,
            windows=windows.shape[0],
            tokens=windows.numel(),
            seconds=time.perf_counter() - start,
        )
