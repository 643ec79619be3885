"""Composed recipes (``rotate+gptq+kvquant``) apply their parts in order, as one recipe."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.compose import ComposedRecipe
from lowbit.recipes.registry import get_recipe, recipe_from_dict


def _ids(n=4, seqlen=24, seed=0):
    return torch.randint(3, 256, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_rotate_then_gptq_equals_quarot_with_the_same_weights():
    # quarot-w4a16 is the rotation plus GPTQ weights with quarot's weight settings
    quarot = get_recipe("quarot-w4a16")
    composed = get_recipe(
        "rotate+gptq", w_bits=4, w_mse_clip=True, w_scale_rule=quarot.w_scale_rule,
        guard=quarot.guard, damp=quarot.damp,
    )  # fmt: skip
    calibration, ids = _ids(8, 32), _ids(seed=1)
    expected = _logits(lowbit.quantize(tiny_model("llama"), quarot, calibration=calibration,
                                       progress=False), ids)  # fmt: skip
    model = lowbit.quantize(tiny_model("llama"), composed, calibration=calibration, progress=False)
    assert torch.equal(_logits(model, ids), expected)
    assert model.lowbit_recipe.method == "rotate+gptq"


def test_parts_apply_in_order_and_the_cache_comes_from_the_kv_part():
    model = lowbit.quantize(tiny_model("qwen2"), "rotate+w4a16+kv-int", progress=False)
    linears = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    assert all(m.quantized_weight is not None for m in linears) and len(linears) == 14
    assert model.get_submodule("model.layers.0.mlp.down_proj").input_transform is not None
    assert model.lowbit_kv is not None
    adapter = lowbit.models.adapter.adapter_for(model)
    kv_alone = get_recipe("kv-int").kv_bytes_per_token(adapter, 128)
    assert model.lowbit_recipe.kv_bytes_per_token(adapter, 128) == kv_alone


def test_settings_and_overrides_reach_only_the_parts_that_have_them():
    recipe = get_recipe("rotate+rtn", seed=3, w_bits=3)
    assert [p.method for p in recipe.parts] == ["rotate", "rtn"]
    assert recipe.parts[0].seed == 3 and recipe.parts[1].w_bits == 3
    with pytest.raises(LowbitError, match="has no setting 'k_bits'"):
        recipe.with_settings(k_bits=4)
    model = lowbit.quantize(
        tiny_model("llama"), recipe, overrides={"model.layers.0.*": {"w_bits": 8}},
        progress=False,
    )  # fmt: skip
    bits = {n: m.quantized_weight.bits for n, m in model.named_modules()
            if isinstance(m, FakeQuantLinear)}  # fmt: skip
    assert {b for n, b in bits.items() if n.startswith("model.layers.0.")} == {8}
    assert {b for n, b in bits.items() if n.startswith("model.layers.1.")} == {3}


def test_a_composed_recipe_round_trips_as_data_and_as_a_checkpoint(tmp_path):
    recipe = get_recipe("rotate+w4a16+kv-int")
    data = recipe.to_dict()
    assert data["method"] == "compose" and [p["method"] for p in data["parts"]] == [
        "rotate", "rtn", "kv-int",
    ]  # fmt: skip
    assert recipe_from_dict(data).to_dict() == data
    model, ids = lowbit.quantize(tiny_model("llama"), recipe, progress=False), _ids()
    lowbit.save(model, tmp_path / "composed")
    loaded = lowbit.load(tmp_path / "composed")
    assert isinstance(loaded.lowbit_recipe, ComposedRecipe)
    cache, loaded_cache = model.lowbit_make_cache(), loaded.lowbit_make_cache()
    with torch.no_grad():
        expected = model(ids, past_key_values=cache).logits
        assert torch.equal(loaded(ids, past_key_values=loaded_cache).logits, expected)


def test_bad_compositions_are_sentences():
    with pytest.raises(LowbitError, match="unknown recipe 'nope'"):
        get_recipe("rotate+nope")
    with pytest.raises(LowbitError, match="already has a quantized KV cache"):
        lowbit.quantize(tiny_model("llama"), "kv-int+kivi", progress=False)
    with pytest.raises(LowbitError, match="at least two parts"):
        ComposedRecipe([get_recipe("rtn")]).validate()
    with pytest.raises(LowbitError, match="version 9"):
        recipe_from_dict({"method": "compose", "version": 9, "parts": []})
