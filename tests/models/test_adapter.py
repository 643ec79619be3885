import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for, supported_families
from lowbit.models.tiny import tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_finds_every_part(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    assert adapter.family == family
    assert (adapter.hidden_size, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim) == (
        96,
        6,
        2,
        16,
    )
    assert adapter.gqa_group == 3
    assert adapter.tied_embeddings
    names = adapter.linear_names()
    assert len(names) == 7 * adapter.num_layers
    for name in names:
        assert isinstance(model.get_submodule(name), torch.nn.Linear)
    block = adapter.block(1)
    assert block.q_proj is model.get_submodule("model.layers.1.self_attn.q_proj")
    assert block.down_proj.in_features == adapter.intermediate_size
    assert (block.q_norm is not None) == (family == "qwen3")
    assert (block.q_proj.bias is not None) == (family == "qwen2")


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_rope_matches_transformers(family):
    import importlib

    model = tiny_model(family)
    adapter = adapter_for(model)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    q = torch.randn(3, adapter.num_heads, 7, adapter.head_dim)
    positions = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 1, 2, 3, 4]]
    )
    cos, sin = model.model.rotary_emb(q, positions)
    expected, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(adapter.apply_rope(q, positions), expected, rtol=0, atol=1e-6)


def test_rope_pair_partner_is_rotate_half():
    adapter = adapter_for(tiny_model("llama"))
    partner = adapter.rope_pair_partner()
    assert partner.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7]


def test_untied_embeddings_detected():
    adapter = adapter_for(tiny_model("llama", tie_word_embeddings=False))
    assert not adapter.tied_embeddings


def test_unsupported_family_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(LowbitError, match="'gpt2'") as err:
        adapter_for(model)
    for family in supported_families():
        assert family in str(err.value)
