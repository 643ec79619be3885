"""GPTQ's settings, declared once (``lowbit.recipes.linear_settings.GPTQRecipeSettings``) for
the four recipes that calibrate weights with GPTQ: their saved JSON keeps its keys, and each
hands the driver the same :class:`~lowbit.algorithms.gptq.GPTQSettings` as before."""

import pytest
import torch

import lowbit
from lowbit.algorithms.gptq import GPTQSettings
from lowbit.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe, recipe_from_dict

_W = ["w_bits", "w_group", "w_symmetric", "w_mse_clip", "w_scale_rule"]
_A = ["a_bits", "a_symmetric", "a_clip_ratio", "a_group"]
_GPTQ = ["act_order", "block_size", "damp", "guard", "heldout_fraction", "sequential"]

# the settings every saved checkpoint of these recipes records (as before GPTQRecipeSettings)
SAVED_KEYS = {
    "gptq": _W + _A + _GPTQ,
    "quarot": _W + _A + ["act_order", "damp", "guard", "w_algo", "kv_bits", "k_bits", "v_bits",
                         "kv_clip_ratio", "rotation", "seed", "online_fp16", "hadamard_block"],
    "spqr": _GPTQ + ["w_bits", "beta1", "beta2", "stat_bits", "outlier_fraction", "tau",
                     "simplified", "sparse_format"],
    "mixed": ["act_order", "block_size", "damp", "sequential", "frac_4bit", "outlier_fraction",
              "g2", "mse_clip", "w_algo", "qat_steps", "qat_lr", "qat_seqlen"],
}  # fmt: skip

# what each recipe's defaults hand quantize_linears (quarot and mixed fix what they do not offer)
DEFAULT_SETTINGS = {
    "gptq": GPTQSettings(),
    "quarot": GPTQSettings(),
    "spqr": GPTQSettings(guard=False),
    "mixed": GPTQSettings(guard=False),
}


@pytest.mark.parametrize("method", sorted(SAVED_KEYS))
def test_saved_settings_keep_their_keys_and_round_trip(method):
    recipe = get_recipe(method)
    assert sorted(recipe.to_dict()["settings"]) == sorted(SAVED_KEYS[method])
    assert recipe_from_dict(recipe.to_dict()) == recipe
    assert recipe.gptq_settings() == DEFAULT_SETTINGS[method]


def test_each_offered_setting_reaches_the_driver():
    recipe = get_recipe(
        "gptq", act_order="false", block_size="32", damp="0.05", guard="false",
        heldout_fraction="0.25", sequential="false",
    )  # fmt: skip
    assert recipe.gptq_settings() == GPTQSettings(
        act_order=False, block_size=32, damp=0.05, guard=False, heldout_fraction=0.25,
        sequential=False,
    )  # fmt: skip
    mixed = get_recipe("mixed", block_size="64", damp="0.1")
    assert mixed.gptq_settings() == GPTQSettings(block_size=64, damp=0.1, guard=False)


@pytest.mark.parametrize("method, setting", [("quarot", "block_size"), ("mixed", "guard")])
def test_a_fixed_gptq_setting_is_no_setting(method, setting):
    with pytest.raises(LowbitError, match=f"has no setting '{setting}'"):
        get_recipe(method, **{setting: "1"})


@pytest.mark.parametrize("method", sorted(SAVED_KEYS))
def test_gptq_settings_cannot_be_overridden_per_layer(method):
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(LowbitError, match="damp apply to the whole model"):
        lowbit.quantize(
            model, method, calibration=ids, progress=False,
            overrides={"model.layers.0.*": {"damp": 0.1}},
        )  # fmt: skip
