"""The kv-int and kivi recipes: settings, analytic bytes == measured bytes, bad settings."""

import copy

import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe, recipe_from_dict

RECIPES = [
    ("kv-int", {"bits": 4}),
    ("kv-int", {"k_bits": 3, "v_bits": 2, "rotate_qk": "hadamard"}),
    ("kv-int", {"bits": 3, "pre_rope": True, "per_channel_keys": True, "key_token_group": 8}),
    ("kv-int", {"v_bits": 16, "k_group": 8, "sink_tokens": 2}),
    ("kivi", {"bits": 2, "group": 8, "residual": 16}),
]


@pytest.fixture(scope="module")
def stock():
    return tiny_model("llama")


@pytest.mark.parametrize("name, settings", RECIPES)
def test_analytic_bytes_equal_measured(stock, name, settings):
    recipe = get_recipe(name, **settings)
    assert recipe_from_dict(recipe.to_dict()) == recipe
    model = copy.deepcopy(stock)
    quantize(model, recipe, progress=False)
    cache = model.lowbit_make_cache()
    with torch.no_grad():
        for _ in range(5):  # a 45-token window in chunks
            model(torch.randint(3, 256, (1, 9)), past_key_values=cache)
    analytic = recipe.kv_bytes_per_token(adapter_for(model), 45)
    assert cache.bytes_per_token() == pytest.approx(analytic, rel=1e-12)
    assert analytic < 2 * 2 * 2 * 16 * 2  # below an fp16 cache


def test_quarot_defaults():
    recipe = get_recipe("kv-int", rotate_qk="hadamard")
    k, v = recipe.key_quantizer(), recipe.value_quantizer()
    assert (k.bits, k.group_size, k.symmetric, k.clip_ratio) == (4, None, False, 0.95)
    assert v.to_dict() == k.to_dict()
    # 4-bit codes + fp16 scale + 8-bit zero per head_dim=64 group
    assert k.bits_per_element(64) == 4 + 24 / 64


@pytest.mark.parametrize(
    "name, settings, message",
    [
        ("kv-int", {"bits": 9}, "bits must be between 2 and 8"),
        ("kv-int", {"k_bits": 1}, "k_bits must be between 2 and 8"),
        ("kv-int", {"clip_ratio": 0.0}, "clip_ratio"),
        ("kv-int", {"rotate_qk": "random"}, "rotate_qk"),
        ("kv-int", {"pre_rope": True, "rotate_qk": "hadamard"}, "pre_rope"),
        ("kivi", {"bits": 16}, "bits must be between 2 and 8"),
        ("kivi", {"group": 0}, "group"),
    ],
)
def test_bad_settings(name, settings, message):
    with pytest.raises(LowbitError, match=message):
        get_recipe(name, **settings)


def test_group_not_dividing_head_dim(stock):
    with pytest.raises(LowbitError, match="does not divide head_dim 16"):
        quantize(copy.deepcopy(stock), get_recipe("kv-int", v_group=5), progress=False)


@pytest.mark.slow
def test_quarot_cache_on_embedded(embedded, wikitext_path):
    """QuaRot's cache K4V4 on the real model: close to fp, measured bytes == analytic."""
    from lowbit.data import eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import FloatReference, evaluate

    tokens = tokenize(embedded.tokenizer, load_corpus(str(wikitext_path)).text[:20000])
    windows = eval_windows(tokens, 256, 1)
    model = copy.deepcopy(embedded.model)
    recipe = get_recipe("kv-int", bits=4, rotate_qk="hadamard")
    quantize(model, recipe, progress=False)
    result = evaluate(
        model, windows, reference=FloatReference(embedded.model), chunk=64, progress=False
    )
    assert result.kl < 0.08  # measured 0.0414 (first 256 tokens, chunks of 64)
    cache = model.lowbit_make_cache()
    with torch.no_grad():
        model(windows, past_key_values=cache)
    adapter = adapter_for(model)
    assert cache.bytes_per_token() == pytest.approx(recipe.kv_bytes_per_token(adapter, 256))
