"""What the load-anywhere test compares: logits of a fixed batch, in one pass and through the
model's own KV cache (a prefill, then one token at a time). It imports only torch, so a fresh
process can use it before anything of lowbit is imported but the package itself."""

from __future__ import annotations

import torch
from torch import Tensor

PREFILL = 16


def probe_ids(vocab_size: int) -> Tensor:
    """A fixed [2, 24] batch of token ids."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab_size, (2, PREFILL + 8), generator=generator)


def probe(model: torch.nn.Module) -> dict[str, Tensor]:
    """``one_pass`` [2, 24, V] without a cache and ``decoded`` [2, 24, V] through the model's
    cache (lowbit's quantized one when the recipe has one, else transformers' default)."""
    ids = probe_ids(model.config.vocab_size)
    make_cache = getattr(model, "lowbit_make_cache", None)
    with torch.no_grad():
        one_pass = model(ids, use_cache=False).logits
        out = model(ids[:, :PREFILL], past_key_values=make_cache() if make_cache else None)
        steps, cache = [out.logits], out.past_key_values
        for t in range(PREFILL, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache)
            steps.append(out.logits)
            cache = out.past_key_values
    return {"one_pass": one_pass.contiguous(), "decoded": torch.cat(steps, 1).contiguous()}
