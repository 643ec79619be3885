"""The ``gptq`` recipe (lives here with its algorithm; tests/recipes/ holds the registry's tests)."""

import pytest
import torch

from lowbit.algorithms.int_spec import IntWeightSpec
from lowbit.algorithms.rtn import rtn_quantize
from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def calibration(n: int = 4, seqlen: int = 32) -> torch.Tensor:
    return torch.randint(3, 256, (n, seqlen), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_runs_on_every_family(family):
    model, reference = tiny_model(family), tiny_model(family)
    recipe = get_recipe("gptq", w_bits="4", w_group="32", a_bits="8")
    quantize(model, recipe, calibration=calibration(), progress=False)
    report = model.lowbit_weight_report
    assert sum(report.wins().values()) == 14 and set(report.wins()) <= {"gptq", "rtn"}
    name = "model.layers.1.mlp.down_proj"
    layer, original = model.get_submodule(name), reference.get_submodule(name)
    spec = IntWeightSpec(4, 32)
    assert (
        layer.quantized_weight.storage_bits()
        == rtn_quantize(original.weight.detach(), spec).storage_bits()
    )
    assert layer.act_quantizer is not None and layer.act_quantizer.bits == 8
    tokens = calibration(2, 16)
    with torch.no_grad():
        diff = (model(tokens).logits - reference(tokens).logits).abs().max().item()
    assert 0 < diff < 1.0  # quantized, but close: measured 0.07-0.17 over the families


def test_recipe_settings_and_overrides():
    recipe = get_recipe("gptq", w_group="none", act_order="false", guard="false")
    assert recipe.w_group is None and not recipe.act_order and not recipe.guard
    assert recipe.needs_calibration
    for bad in ({"damp": "0"}, {"block_size": "0"}, {"heldout_fraction": "1"}, {"w_bits": "9"}):
        with pytest.raises(LowbitError):
            get_recipe("gptq", **bad)
    model = tiny_model("llama")
    with pytest.raises(LowbitError, match="needs calibration"):
        quantize(model, "gptq", progress=False)
    with pytest.raises(LowbitError, match="whole model"):
        quantize(
            model, "gptq", calibration=calibration(),
            overrides={"model.layers.0.*": {"act_order": False}}, progress=False,
        )  # fmt: skip


def test_per_layer_bits_override_and_w16_keeps_float():
    model, reference = tiny_model("qwen3"), tiny_model("qwen3")
    quantize(
        model, get_recipe("gptq", w_bits="8"), calibration=calibration(),
        overrides={"model.layers.0.*": {"w_bits": 16}, "model.layers.1.mlp.*": {"w_bits": 16}},
        progress=False,
    )  # fmt: skip
    wins = model.lowbit_weight_report.wins()
    assert wins["float"] == 10 and wins.get("gptq", 0) + wins.get("rtn", 0) == 4
    name = "model.layers.0.mlp.up_proj"
    assert torch.equal(model.get_submodule(name).weight, reference.get_submodule(name).weight)


def test_unset_scale_rule_follows_the_weight_algorithm():
    rules = {
        (name, tuple(settings.items())): get_recipe(name, **settings).weight_spec().scale_rule
        for name, settings in (
            ("rtn", {}), ("gptq", {}), ("quarot", {}), ("quarot", {"w_algo": "rtn"}),
            ("gptq", {"w_scale_rule": "absmax"}), ("gptq", {"w_symmetric": "false"}),
        )
    }  # fmt: skip
    assert list(rules.values()) == [
        "absmax", "absmax_half", "absmax_half", "absmax", "absmax", "absmax"
    ]  # fmt: skip
    with pytest.raises(LowbitError, match="symmetric"):
        get_recipe("rtn", w_symmetric="false", w_scale_rule="absmax_half")
