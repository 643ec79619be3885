import pytest

from lowbit.errors import LowbitError
from lowbit.recipes.registry import PRESETS, get_recipe, list_recipes, recipe_from_dict


def test_builtin_methods_registered():
    assert {"fp", "rtn"} <= set(list_recipes())


@pytest.mark.parametrize("name", ["fp", "rtn", *PRESETS])
def test_recipe_round_trips_through_json(name):
    import json

    recipe = get_recipe(name)
    data = json.loads(json.dumps(recipe.to_dict()))
    assert data["version"] == recipe.version
    assert recipe_from_dict(data) == recipe


def test_settings_are_read_with_their_types():
    recipe = get_recipe("rtn", w_bits="3", w_group="64", w_symmetric="false", a_clip_ratio="0.9")
    assert (recipe.w_bits, recipe.w_group, recipe.w_symmetric, recipe.a_clip_ratio) == (
        3,
        64,
        False,
        0.9,
    )
    assert get_recipe("w4a16-g64", w_group="none").w_group is None


def test_preset_applies_its_settings():
    recipe = get_recipe("w8a4")
    assert (recipe.method, recipe.w_bits, recipe.a_bits) == ("rtn", 8, 4)


@pytest.mark.parametrize(
    "name, settings, message",
    [
        ("nope", {}, "unknown recipe 'nope'"),
        ("rtn", {"w_bits": "9"}, "w_bits must be between 2 and 8 or 16 for off, not 9"),
        ("rtn", {"a_bits": "1"}, "a_bits must be between 2 and 8"),
        ("rtn", {"w_bits": "four"}, "setting w_bits='four'"),
        ("rtn", {"w_group": "0"}, "w_group must be a positive integer"),
        ("rtn", {"colour": "red"}, "has no setting 'colour'"),
        ("rtn", {"w_symmetric": "maybe"}, "not a boolean"),
        ("rtn", {"a_clip_ratio": "1.5"}, "a_clip_ratio must be in"),
    ],
)
def test_bad_settings_are_one_clear_error(name, settings, message):
    with pytest.raises(LowbitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        get_recipe(name, **settings)


def test_saved_recipe_of_another_version_is_refused():
    data = get_recipe("rtn").to_dict()
    data["version"] = 99
    with pytest.raises(LowbitError, match="version 99"):
        recipe_from_dict(data)


def test_saved_recipe_settings_are_checked_by_their_annotations():
    """A checkpoint's recipe JSON goes through lowbit.settings like module specs do."""
    data = get_recipe("w4a16-g64").to_dict()
    assert recipe_from_dict(data).to_dict() == data
    for change, message in [
        ({"w_bits": "4"}, "invalid w_bits"),
        ({"w_group": True}, "invalid w_group"),
        ({"nope": 1}, "unknown nope"),
    ]:
        bad = {**data, "settings": {**data["settings"], **change}}
        with pytest.raises(LowbitError, match=message):
            recipe_from_dict(bad)
    rotate = get_recipe("rotate").to_dict()
    assert recipe_from_dict(rotate).seed == 0  # a Count: 0 is a valid seed


def test_every_preset_is_found_in_a_new_process():
    """Presets a recipe module defines (SpQR's, 2/4/16's, KVQuant's ladder) register when that
    module is imported; get_recipe finds them in a process that has imported nothing else."""
    import subprocess
    import sys

    list_recipes()  # here: every recipe module, so every preset
    names = sorted(PRESETS)
    code = (
        "import sys; from lowbit.recipes.registry import get_recipe\n"
        "for name in sys.argv[1:]: get_recipe(name)\n"
    )
    assert {"mixed-2-4-16", "spqr-w3-1pct", "kvquant-ladder-nuq"} <= set(names)
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
