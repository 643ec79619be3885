"""Settings that cannot mean anything are refused with one sentence when the recipe is built,
and every setting of every recipe is described (``lowbit recipes`` prints them)."""

from __future__ import annotations

import dataclasses
import re

import pytest

import lowbit
from lowbit.cli import main
from lowbit.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.registry import get_recipe, list_recipes
from lowbit.recipes.rtn import RTNRecipe
from lowbit.recipes.settings_help import RECIPE_SETTINGS, SETTINGS, describe_setting

DOES_NOTHING = [
    ("rtn", {"w_bits": "16"}, "w_bits=16 and a_bits=16 leave weights and activations in float"),
    ("w4a16", {"w_bits": "16"}, "w_bits=16 and a_bits=16"),
    ("gptq", {"w_bits": "16", "a_bits": "8"}, "GPTQ has nothing to calibrate"),
    ("kv-int", {"bits": "16"}, "keys and values both at 16 bits"),
    ("kv-int", {"k_bits": "16", "v_bits": "16"}, "keys and values both at 16 bits"),
    ("kvquant", {"k_bits": "16", "v_bits": "16"}, "k_bits=16 and v_bits=16"),
    ("ksort-bfp", {"k_mantissa_bits": "16", "q_mantissa_bits": "16"}, "all at 16 bits"),
    ("quarot", {"rotation": "none", "w_bits": "16", "a_bits": "16", "kv_bits": "16"}, "none"),
]


@pytest.mark.parametrize("name, settings, reason", DOES_NOTHING)
def test_settings_that_leave_a_recipe_nothing_to_do_are_refused(name, settings, reason):
    with pytest.raises(LowbitError, match="does nothing: .*" + re.escape(reason)):
        get_recipe(name, **settings)


def test_a_part_of_a_composition_that_does_nothing_is_refused():
    with pytest.raises(LowbitError, match=r"'rtn' \(part 2\) of 'rotate\+rtn' .* does nothing"):
        get_recipe("rotate+rtn", w_bits="16")


@pytest.mark.parametrize(
    "name, settings",
    [
        ("rtn", {"w_bits": "16", "a_bits": "8"}),  # W16A8: activations alone
        ("quarot", {"w_bits": "16", "a_bits": "16", "kv_bits": "16"}),  # the rotation alone
        ("quarot", {"w_bits": "16", "a_bits": "16", "kv_bits": "4"}),  # QuaRot's cache alone
        ("kv-int", {"k_bits": "16"}),  # values alone
        ("ksort-bfp", {"k_mantissa_bits": "16"}),  # BFP16 queries alone
    ],
)
def test_settings_that_turn_one_part_off_still_mean_something(name, settings):
    get_recipe(name, **settings)


def test_a_per_layer_override_may_leave_a_layer_in_float():
    """16 bits in an override means "this layer stays float" (the whole-model check does not
    apply to one layer)."""
    model = lowbit.quantize(
        tiny_model("llama"), "rtn", overrides={"model.layers.0.*": {"w_bits": 16}},
        progress=False,
    )  # fmt: skip
    bits = {n: m.quantized_weight for n, m in model.named_modules()
            if isinstance(m, FakeQuantLinear)}  # fmt: skip
    assert all(q is None for n, q in bits.items() if n.startswith("model.layers.0."))
    assert all(q is not None for n, q in bits.items() if n.startswith("model.layers.1."))


@pytest.mark.parametrize(
    "name, settings, sentence",
    [
        ("rtn", {"w_bits": "17"}, "w_bits must be between 2 and 8 or 16 for off, not 17"),
        ("rtn", {"w_bits": "1"}, "w_bits must be between 2 and 8"),
        ("quarot", {"kv_bits": "9"}, "kv_bits must be between 2 and 8"),
        ("kivi", {"bits": "16"}, "bits must be between 2 and 8, not 16"),
        ("kivi", {"group": "0"}, "group must be a positive integer"),
        ("kv-int", {"k_group": "-1"}, "k_group must be a positive integer"),
        ("kvquant", {"outlier_fraction": "nan"}, "'nan' is not a finite number"),
        ("mixed", {"frac_4bit": "1.5"}, "frac_4bit must be in [0, 1]"),
        ("mixed", {"qat_lr": "inf"}, "qat_lr='inf' of recipe 'mixed': 'inf' is not a finite"),
        ("mixed", {"qat_lr": "1e400"}, "'1e400' is not a finite number"),  # overflows to inf
        ("spqr", {"outlier_fraction": "0.2"}, "outlier fraction must be between 0 and 0.1"),
        ("rotate", {"seed": str(2**64)}, "seed must be an integer from 0 to 2**64 - 1"),
        ("quarot", {"seed": "-1"}, "seed must be an integer from 0 to 2**64 - 1"),
        ("ksort-bfp", {"permute_v": "true"}, "permute_v sorts the channels of quantized values"),
        ("ksort-bfp", {"block": "0"}, "block must be a positive integer"),
    ],
)
def test_settings_out_of_range_are_one_sentence(name, settings, sentence):
    with pytest.raises(LowbitError, match=re.escape(sentence)):
        get_recipe(name, **settings)


def test_the_cli_refuses_w_bits_16_before_loading_the_model(tmp_path, capsys):
    argv = ["quantize", "--model", str(tmp_path / "missing"), "--recipe", "rtn"]
    code = main([*argv, "--set", "w_bits=16", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "does nothing" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# -- every setting described ------------------------------------------------------------------


def _fields():
    return [
        (method, field.name)
        for method, cls in list_recipes().items()
        for field in dataclasses.fields(cls)
    ]


@pytest.mark.parametrize("method, name", _fields())
def test_every_setting_of_every_recipe_is_described(method, name):
    text = describe_setting(method, name)
    assert text and "\n" not in text and "seed 00" not in text


def test_no_description_is_of_a_setting_no_recipe_has():
    fields = set(_fields())
    assert set(SETTINGS) <= {name for _, name in fields}
    assert set(RECIPE_SETTINGS) <= fields
    # an override differs from the shared description (else it belongs in SETTINGS alone)
    assert all(SETTINGS.get(name) != text for (_, name), text in RECIPE_SETTINGS.items())


def test_lowbit_recipes_prints_each_method_its_paper_and_every_setting(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "seed 00" not in out
    assert "mixed: 2/4/16-bit intra-matrix mixed-precision weights" in out
    assert "    from: 2/4/16 mixed precision (Li et al., 2024)\n" in out
    assert "    from: KIVI (Liu et al., 2024)\n" in out
    assert "    plays: rotation, weights, activations, kv\n" in out  # quarot
    assert (
        "    w_group (int | none, default none): input channels per weight scale; none = one "
        "scale per output channel\n"
    ) in out
    assert "    sparse_format (csr | ptcsr, default csr): stored outlier layout" in out
    assert "    outlier_fraction (float, default 0.01): share of the cached elements" in out
    assert "w4a16-g64: rtn w_bits=4 w_group=64" in out
    blocks = re.split(r"\n(?=\S)", out)  # a method's lines, then the presets, ...
    settings = {b.split(":")[0]: re.findall(r"^    (\w+) \(", b, re.M) for b in blocks}
    for method, cls in list_recipes().items():  # every setting, under its own method
        assert settings[method] == [field.name for field in dataclasses.fields(cls)]


def test_a_recipe_built_in_python_that_does_nothing_is_refused_by_quantize():
    model = tiny_model("llama")
    with pytest.raises(LowbitError, match="does nothing"):
        lowbit.quantize(model, RTNRecipe(w_bits=16, a_bits=16), progress=False)
    assert getattr(model, "lowbit_recipe", None) is None
