"""Function-preserving rewrites that prepare a model for rotation: RMSNorm fusion, untying.

An RMSNorm computes ``g ⊙ x / rms(x)``. Its scale ``g`` can move into every linear that reads
the norm's output (``W ← W diag(g)``, i.e. column j of W times g_j), after which the norm's
weight is all ones and ``x / rms(x)`` commutes with any orthogonal Q: ``rms(x Q) = rms(x)``.
That is what ``rotate.py`` needs. The RMSNorm modules stay (weight ones, eps from the config),
so the model is still an ordinary Hugging Face model.

Where each norm goes:

* ``input_layernorm`` → q_proj, k_proj, v_proj (their biases, Qwen2, are untouched: a column
  scaling changes only how the input is read);
* ``post_attention_layernorm`` → gate_proj, up_proj;
* final ``norm`` → lm_head (untied first, otherwise the embeddings would be scaled too).

Qwen3's ``q_norm``/``k_norm`` act per head on the q/k outputs before RoPE; no residual-stream
transform reaches them, so they are left alone.

All products are taken in float64 and cast back to each weight's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.models.adapter import DecoderAdapter, adapter_for

__all__ = ["fuse_norms", "norms_are_fused", "residual_norms", "untie_embeddings"]


def _set_weight(linear: nn.Module, value: torch.Tensor) -> None:
    """Copy a float64 result into ``linear.weight`` in place, in the weight's dtype."""
    with torch.no_grad():
        linear.weight.copy_(value.to(linear.weight.dtype))


def untie_embeddings(model: nn.Module) -> bool:
    """Give lm_head its own copy of the embedding matrix, in place.

    Also sets ``config.tie_word_embeddings = False`` and clears the model's recorded tying
    (``all_tied_weights_keys``), so a later ``tie_weights()``, ``save_pretrained`` or
    ``from_pretrained`` keeps the two apart.

    Returns:
        True if the embeddings were tied before the call.
    """
    adapter = adapter_for(model)
    was_tied = adapter.tied_embeddings
    if was_tied:
        source = adapter.embed_tokens.weight
        adapter.lm_head.weight = nn.Parameter(
            source.detach().clone(), requires_grad=source.requires_grad
        )
    model.config.tie_word_embeddings = False
    if hasattr(model, "get_expanded_tied_weights_keys"):
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return was_tied


def residual_norms(adapter: DecoderAdapter) -> list[tuple[str, nn.Module, list[nn.Module]]]:
    """Every RMSNorm on the residual stream with the linears that read its output.

    Returns:
        ``(label, norm, readers)`` in execution order; the final norm's reader is lm_head.
    """
    pairs = []
    for view in adapter.blocks():
        attn_readers = [view.q_proj, view.k_proj, view.v_proj]
        pairs.append((f"block {view.index} input norm", view.input_norm, attn_readers))
        mlp_readers = [view.gate_proj, view.up_proj]
        pairs.append(
            (f"block {view.index} post-attention norm", view.post_attention_norm, mlp_readers)
        )
    pairs.append(("final norm", adapter.final_norm, [adapter.lm_head]))
    return pairs


def norms_are_fused(model: nn.Module) -> bool:
    """True when every residual-stream RMSNorm weight is exactly one."""
    adapter = adapter_for(model)
    return all(bool((norm.weight == 1).all()) for _, norm, _ in residual_norms(adapter))


def fuse_norms(model: nn.Module) -> int:
    """Fold every residual-stream RMSNorm scale into the linears that read it, in place.

    Unties tied embeddings first (the final norm goes into lm_head only). Idempotent: norms
    that are already ones change nothing.

    Returns:
        Number of norms whose weight was not already all ones.

    Raises:
        LowbitError: if a reader's input width differs from the norm's width.
    """
    adapter = adapter_for(model)
    untie_embeddings(model)
    changed = 0
    for name, norm, readers in residual_norms(adapter):
        scale = norm.weight.detach().to(torch.float64)  # [hidden]
        if bool((scale == 1).all()):
            continue
        for linear in readers:
            if linear.weight.shape[-1] != scale.shape[0]:
                raise LowbitError(
                    f"{name} has width {scale.shape[0]} but a linear reading it expects "
                    f"{linear.weight.shape[-1]} inputs"
                )
            weight = linear.weight.detach().to(torch.float64)  # [out, hidden]
            _set_weight(linear, weight * scale)  # W diag(g): column j times g_j
        with torch.no_grad():
            norm.weight.fill_(1.0)
        changed += 1
    return changed
