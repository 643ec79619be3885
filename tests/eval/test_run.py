"""lowbit.eval.run: recipes evaluated from plain arguments, as `lowbit eval` does."""

import pytest

from lowbit.errors import LowbitError
from lowbit.eval.run import evaluate_recipes
from lowbit.recipes.registry import get_recipe


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lowbit.data import pydoc_text

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(pydoc_text("eval")[:20000])
    return str(path)


def test_rows_of_names_recipes_and_labelled_recipes(tiny_model_dir, corpus):
    rows = evaluate_recipes(
        tiny_model_dir,
        ["fp", get_recipe("rtn", w_bits=8), ("rtn g32", get_recipe("rtn", w_group=32))],
        dataset=corpus,
        seqlen=64,
        windows=2,
        progress=False,
    )
    assert [r["label"] for r in rows] == ["fp", "rtn", "rtn g32"]
    assert rows[0]["kl"] == 0.0 and rows[0]["top1"] == 1.0 and rows[0]["bits_per_weight"] == 32
    # an fp16 scale per output row: 672 rows over 70,656 weights in each block
    assert rows[1]["bits_per_weight"] == pytest.approx(8 + 16 * 672 / 70656)
    assert rows[2]["bits_per_weight"] == pytest.approx(4.5)  # an fp16 scale per 32 weights
    assert 0 < rows[1]["kl"] < rows[2]["kl"]  # 8 bits stay closer to the float model than 4
    assert all(r["tokens"] == 2 * 64 and r["calibration"] is None for r in rows)


def test_rows_state_kv_bytes_at_every_plotted_context(tiny_model_dir, corpus):
    """A cache with a float window (KIVI's 128 residual tokens) costs more per token at short
    contexts; an unquantized cache costs the same at every context."""
    from lowbit.eval.memory import KV_CONTEXTS

    fp, kivi = evaluate_recipes(
        tiny_model_dir,
        ["fp", get_recipe("kivi", group=16)],
        dataset=corpus,
        seqlen=64,
        windows=1,
        progress=False,
    )
    for row in (fp, kivi):
        assert list(row["kv_bytes_by_context"]) == [str(c) for c in KV_CONTEXTS]
        assert row["kv_bytes_by_context"][str(row["kv_context"])] == row["kv_bytes_per_token"]
    assert len(set(fp["kv_bytes_by_context"].values())) == 1
    curve = list(kivi["kv_bytes_by_context"].values())
    assert all(a > b for a, b in zip(curve, curve[1:], strict=False))
    assert curve[0] < fp["kv_bytes_per_token"]


def test_the_same_rows_as_the_command_line(tiny_model_dir, corpus, tmp_path):
    """`lowbit eval` prints what evaluate_recipes returns (times apart)."""
    import json

    from lowbit.cli import main

    out = tmp_path / "rows.json"
    argv = ["eval", "--model", str(tiny_model_dir), "--dataset", corpus, "--seqlen", "64",
            "--windows", "2", "--recipe", "w4a16", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert main([*argv, "--json", str(out)]) == 0
    (row,) = evaluate_recipes(
        tiny_model_dir, ["w4a16"], dataset=corpus, seqlen=64, windows=2, progress=False
    )
    cli_row = json.loads(out.read_text())
    for key in ("quantize_seconds", "eval_seconds", "seconds"):
        del row[key], cli_row[key]
    assert cli_row == row


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recipes=["gptq", "w4a16-gptq"], resume_dir="r"), "2 recipes calibrate with GPTQ"),
        (dict(recipes=["fp"], backend="abacus"), "unknown backend 'abacus'"),
        (dict(recipes=["fp"], dataset="/no/such/text.txt"), "does not exist"),
        (dict(recipes=[]), "no recipe to evaluate"),
        (dict(recipes=["fp"], chunk=0), "--chunk must be at least 1, not 0"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_loads(kwargs, message):
    # the model does not exist: each refusal must come before anything looks for it
    with pytest.raises(LowbitError, match=message):
        evaluate_recipes("/no/such/model", **kwargs)
