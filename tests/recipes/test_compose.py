"""Composed recipes (``rotate+gptq+kvquant``) apply their parts in order, as one recipe."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.cli import main
from lowbit.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.base import ROLES
from lowbit.recipes.compose import ComposedRecipe
from lowbit.recipes.quarot import QuaRotRecipe
from lowbit.recipes.registry import PRESETS, get_recipe, list_recipes, recipe_from_dict


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
    loaded = lowbit.load(tmp_path / "composed", dtype=torch.float32)
    assert isinstance(loaded.lowbit_recipe, ComposedRecipe)
    cache, loaded_cache = model.lowbit_make_cache(), loaded.lowbit_make_cache()
    with torch.no_grad():
        expected = model(ids, past_key_values=cache).logits
        assert torch.equal(loaded(ids, past_key_values=loaded_cache).logits, expected)


def test_bad_compositions_are_sentences():
    with pytest.raises(LowbitError, match="unknown recipe 'nope'"):
        get_recipe("rotate+nope")
    with pytest.raises(LowbitError, match="at least two parts"):
        ComposedRecipe([get_recipe("rtn")]).validate()
    with pytest.raises(LowbitError, match="version 9"):
        recipe_from_dict({"method": "compose", "version": 9, "parts": []})


# -- what may compose: each part's roles ------------------------------------------------------

TWICE = [
    # (composition, the role both parts play, as the sentence says it)
    ("gptq+gptq", "both quantize the weights"),
    ("rtn+gptq", "both quantize the weights"),  # gptq would find no float weight
    ("w4a16-g64+w8a16", "both quantize the weights"),
    ("rotate+spqr+mixed", "both quantize the weights"),
    ("kivi+kvquant", "both quantize the KV cache"),
    ("kv-int+kivi", "both quantize the KV cache"),
    ("gptq+kvquant+ksort-bfp", "both quantize the KV cache"),
    ("rotate+rotate", "both rotate the model"),
    ("quarot+rotate", "both rotate the model"),  # quarot holds a rotation, weights and a cache
    ("quarot+gptq", "both quantize the weights"),
    ("quarot+kivi", "both quantize the KV cache"),
]
OUT_OF_ORDER = [
    # (composition, the part that must come first, the part it must come before)
    ("gptq+rotate", "'rotate' (part 2)", "'gptq' (part 1)"),
    ("kivi+rotate", "'rotate' (part 2)", "'kivi' (part 1)"),
    ("kvquant+gptq", "'gptq' (part 2)", "'kvquant' (part 1)"),
    ("rtn+kivi+rotate", "'rotate' (part 3)", "'rtn' (part 1)"),
]


@pytest.mark.parametrize("name, sentence", TWICE)
def test_a_role_played_twice_is_refused_when_the_recipe_is_built(name, sentence):
    with pytest.raises(LowbitError, match=sentence):
        get_recipe(name)


@pytest.mark.parametrize("name, first, second", OUT_OF_ORDER)
def test_a_role_out_of_order_is_refused_when_the_recipe_is_built(name, first, second):
    with pytest.raises(LowbitError, match=re.escape(f"{first} must come before {second}")):
        get_recipe(name)


def test_saved_data_of_a_composition_that_cannot_mean_anything_is_refused():
    data = {"method": "compose", "version": 1, "parts": [get_recipe("gptq").to_dict()] * 2}
    with pytest.raises(LowbitError, match="both quantize the weights"):
        recipe_from_dict(data)


def test_a_bad_composition_is_refused_before_the_model_changes():
    """From Python, a composition built part by part is refused by lowbit.quantize before the
    first part runs (it used to install kivi's cache, then fail on the second)."""
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = ComposedRecipe([get_recipe("kivi"), get_recipe("kvquant")])
    with pytest.raises(LowbitError, match="both quantize the KV cache"):
        lowbit.quantize(model, recipe, calibration=_ids(), progress=False)
    assert getattr(model, "lowbit_kv", None) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_cli_refuses_a_bad_composition_at_once_without_loading_the_model(tmp_path, capsys):
    missing = tmp_path / "no-such-model"  # loading it first would say it does not exist
    argv = ["quantize", "--model", str(missing), "--recipe", "kivi+kvquant"]
    start = time.perf_counter()
    code = main([*argv, "--out", str(tmp_path / "out"), "--no-progress"])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and "both quantize the KV cache" in err and err.count("\n") == 1
    assert seconds < 1.0  # measured 0.001 s; the refusal came after 5-36 s of work before
    assert not (tmp_path / "out").exists()


def test_a_kv_setting_that_does_not_fit_the_model_is_refused_before_the_weights_are_done():
    """kv-int's key groups must divide head_dim (32 here); the composition checks every part
    against the model before GPTQ calibrates, not when the cache is installed after it."""
    model = tiny_model("llama")
    recipe = get_recipe("gptq+kv-int", k_group=24)
    with pytest.raises(LowbitError, match="KV group size 24 does not divide head_dim"):
        lowbit.quantize(model, recipe, calibration=_ids(), progress=False)
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())


ROOT = Path(__file__).resolve().parents[2]


def _documented_compositions() -> set[str]:
    """Every ``a+b[+c]`` whose parts are all recipe names in the README, the docs, the
    benchmarks, the package's docstrings (but compose.py's, which names refused ones) and the
    load-anywhere matrix."""
    known = set(list_recipes()) | set(PRESETS)
    paths = [
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("benchmarks/*.py"),
        *(p for p in ROOT.glob("src/lowbit/**/*.py") if p.name != "compose.py"),
        ROOT / "tests/io/test_load_anywhere.py",
    ]
    found = set()
    for path in paths:
        for name in re.findall(r"[a-z0-9][a-z0-9.-]*(?:\+[a-z0-9][a-z0-9.-]*)+", path.read_text()):
            if all(part in known for part in name.split("+")):
                found.add(name)
    return found


DOCUMENTED = sorted(_documented_compositions())


def test_the_docs_use_compositions():
    assert {"rotate+gptq+kvquant", "rotate+spqr+kv-int", "rotate+mixed+kivi"} <= set(DOCUMENTED)


@pytest.mark.parametrize(
    "name",
    sorted({*DOCUMENTED, "gptq+kvquant", "rtn+kivi", "w4a16-g64+ksort-bfp", "rotate+w4a16+kv-int",
            "rtn+fp", "fp+rotate+fp"}),
)  # fmt: skip
def test_every_composition_users_write_is_accepted(name):
    assert get_recipe(name).method.count("+") == name.count("+")


def test_a_part_whose_settings_turn_a_role_off_leaves_it_to_another_part():
    # quarot-w4a16 keeps its cache in float: a KV recipe may follow it
    assert get_recipe("quarot-w4a16+kivi").played_roles() == {
        "rotation", "weights", "activations", "kv",
    }  # fmt: skip
    with pytest.raises(LowbitError, match="both quantize the KV cache"):
        get_recipe("quarot-w4a16+kivi", kv_bits=4)  # ... unless its cache is on
    unrotated = ComposedRecipe([get_recipe("rotate"), QuaRotRecipe(rotation="none")])
    unrotated.validate()  # quarot without its rotation after a rotation
    with pytest.raises(LowbitError, match="both rotate the model"):
        ComposedRecipe([get_recipe("rotate"), QuaRotRecipe()]).validate()


@pytest.mark.parametrize(
    "name, roles",
    [
        ("fp", set()),
        ("rotate", {"rotation"}),
        ("rtn", {"weights", "activations"}),
        ("gptq", {"weights", "activations"}),
        ("spqr", {"weights"}),
        ("mixed", {"weights"}),
        ("kv-int", {"kv"}),
        ("kivi", {"kv"}),
        ("kvquant", {"kv"}),
        ("ksort-bfp", {"kv"}),
        ("quarot", {"rotation", "weights", "activations", "kv"}),
    ],
)
def test_each_method_declares_the_roles_it_plays(name, roles):
    assert get_recipe(name).roles == roles and set(ROLES) >= roles
