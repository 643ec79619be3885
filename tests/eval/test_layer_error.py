"""Per-block and per-linear error against float, and channel magnitudes, on tiny models."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.eval.distributions import channel_magnitudes
from lowbit.eval.layer_error import layer_error
from lowbit.models.adapter import BlockView, adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe


def _ids(model, n=2, seqlen=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n, seqlen), generator=generator)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_rotation_alone_has_no_error_against_its_own_reference(family):
    """The reference of a rotated model is the float model in the rotated bases: the rotation
    alone then measures (almost) nothing; against the unrotated float model every block would
    differ by the whole residual stream."""
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    error = layer_error(model, "rotate", _ids(model))
    assert len(error.blocks) == adapter_for(model).num_layers
    assert max(error.blocks) < 1e-9  # measured 0.0: nothing was quantized
    assert all(max(v) < 1e-9 for v in error.linears.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


def test_fewer_bits_give_more_error_at_every_block_and_linear():
    model = tiny_model("llama")
    ids = _ids(model)
    w8 = layer_error(model, get_recipe("rtn").with_settings(w_bits=8), ids)
    w3 = layer_error(model, get_recipe("rtn").with_settings(w_bits=3), ids, label="w3")
    assert w3.label == "w3" and w8.label == "rtn"
    assert list(w8.linears) == list(BlockView.LINEAR_NAMES)
    assert all(0 < a < b for a, b in zip(w8.blocks, w3.blocks, strict=True))
    for name in BlockView.LINEAR_NAMES:
        assert all(0 < a < b for a, b in zip(w8.linears[name], w3.linears[name], strict=True))


def test_rotated_quantized_model_is_compared_in_its_own_bases():
    """quarot at 8 bits everywhere: small errors (the unrotated float model as the reference
    would give relative errors near 2, a rotated stream against an unrotated one)."""
    model = tiny_model("llama")
    recipe = get_recipe("quarot").with_settings(w_algo="rtn", w_bits=8, a_bits=8, kv_bits=8)
    error = layer_error(model, recipe, _ids(model))
    assert max(error.blocks) < 0.05  # measured 9e-5 to 1.7e-4


def test_rotation_flattens_an_outlier_channel_and_ksort_sorts_keys_per_head():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    layer = 1
    with torch.no_grad():  # an outlier channel in the q/k/v input, as real models have
        adapter.block(layer).input_norm.weight[5] *= 40.0
    m = channel_magnitudes(model, _ids(model), layer)
    assert m.layer == layer and m.activations.shape == (adapter.hidden_size,)
    assert int(m.activations.argmax()) == 5
    peak = m.activations.max() / m.activations.median()
    peak_rotated = m.activations_rotated.max() / m.activations_rotated.median()
    assert peak > 10 * peak_rotated  # measured 36 against 1.6
    # K-sort reorders each head's channels, nothing else: same multiset per head, and the order
    # is the W_k row norms' (descending)
    heads, dim = adapter.num_kv_heads, adapter.head_dim
    assert torch.equal(
        m.keys.view(heads, dim).sort(1).values, m.keys_sorted.view(heads, dim).sort(1).values
    )
    norms = adapter.block(layer).k_proj.weight.norm(dim=1).view(heads, dim)
    order = norms.argsort(dim=1, descending=True, stable=True)
    assert torch.equal(m.keys_sorted.view(heads, dim), m.keys.view(heads, dim).gather(1, order))


def test_a_layer_outside_the_model_is_a_sentence():
    model = tiny_model("llama")
    with pytest.raises(LowbitError, match="layer must be 0 to 1"):
        channel_magnitudes(model, _ids(model), 2)
