"""RMSNorm fusion and untying keep the model's function (fp32 tiny models of every family)."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.transforms.fuse import fuse_norms, norms_are_fused, residual_norms, untie_embeddings

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _tokens(vocab=256, batch=2, seqlen=19):
    return torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_fuse_preserves_logits_and_sets_norms_to_one(family, tied):
    model = tiny_model(family, tie_word_embeddings=tied)
    ids = _tokens()
    before = _logits(model, ids)
    adapter = adapter_for(model)
    q_norm_before = (
        None if adapter.block(0).q_norm is None else adapter.block(0).q_norm.weight.clone()
    )

    changed = fuse_norms(model)

    assert changed == 2 * adapter.num_layers + 1  # tiny_model randomizes every norm
    assert norms_are_fused(model)
    for _, norm, _ in residual_norms(adapter):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    if q_norm_before is not None:  # Qwen3's per-head q/k norms are not residual norms
        assert torch.equal(adapter.block(0).q_norm.weight, q_norm_before)
    assert not adapter.tied_embeddings
    # measured: max |Δlogit| 3.0e-7 .. 3.9e-7 over families x tying (|logit| up to 1.7)
    assert (_logits(model, ids) - before).abs().max().item() < 1e-5


def test_fuse_is_idempotent_and_bit_exact_the_second_time():
    model = tiny_model("qwen2")
    fuse_norms(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_norms(model) == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_fuse_scales_columns_by_the_norm_weight():
    model = tiny_model("llama")
    view = adapter_for(model).block(1)
    scale = view.post_attention_norm.weight.detach().clone().double()
    expected = (view.up_proj.weight.detach().double() * scale).float()
    fuse_norms(model)
    assert torch.equal(view.up_proj.weight, expected)


def test_untie_gives_lm_head_its_own_tensor_and_survives_tie_weights():
    model = tiny_model("llama", tie_word_embeddings=True)
    adapter = adapter_for(model)
    assert adapter.tied_embeddings
    assert untie_embeddings(model) is True
    embed, head = adapter.embed_tokens.weight, adapter.lm_head.weight
    assert head is not embed and head.data_ptr() != embed.data_ptr()
    assert torch.equal(head, embed)
    assert model.config.tie_word_embeddings is False
    model.tie_weights()  # recomputes the mapping from the config: must not re-tie
    assert adapter.lm_head.weight is not adapter.embed_tokens.weight
    assert untie_embeddings(model) is False


def test_fused_model_round_trips_through_save_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("mistral", tie_word_embeddings=True)
    fuse_norms(model)
    ids = _tokens()
    expected = _logits(model, ids)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded_adapter = adapter_for(loaded)
    assert not loaded_adapter.tied_embeddings
    assert torch.equal(loaded_adapter.lm_head.weight, adapter_for(model).lm_head.weight)
    assert torch.equal(_logits(loaded, ids), expected)


def test_fuse_rejects_unsupported_models():
    with pytest.raises(LowbitError, match="no adapter"):
        fuse_norms(torch.nn.Linear(3, 3))
