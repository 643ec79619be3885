import json
import subprocess
import sys

import pytest

from lowbit.cli import factor_pow2, main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    from lowbit.data import pydoc_text

    path.write_text(pydoc_text("eval")[:20000])
    return path


def test_eval_prints_a_table_and_writes_json(capsys, tiny_model_dir, corpus, tmp_path):
    out_file = tmp_path / "out.json"
    code, out, err = run(
        capsys,
        "eval", "--model", str(tiny_model_dir), "--dataset", str(corpus),
        "--seqlen", "64", "--windows", "3", "--recipe", "fp", "--recipe", "rtn",
        "--set", "w_group=32", "--json", str(out_file), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "fp" in out and "rtn (w_group=32)" in out
    rows = json.loads(out_file.read_text())
    keys = {"model", "recipe", "dataset", "seqlen", "windows", "tokens", "ppl", "kl", "top1",
            "bits_per_weight", "model_bytes", "kv_bytes_per_token", "seconds"}  # fmt: skip
    assert keys <= set(rows[0]) and keys <= set(rows[1])
    assert rows[0]["kl"] == 0.0 and rows[0]["top1"] == 1.0
    assert rows[1]["recipe"]["settings"]["w_group"] == 32
    assert rows[1]["bits_per_weight"] == pytest.approx(4.5)
    assert rows[1]["tokens"] == 3 * 64
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_single_recipe_json_is_one_object(capsys, tiny_model_dir, corpus, tmp_path):
    out_file = tmp_path / "one.json"
    code, _, err = run(
        capsys, "eval", "--model", str(tiny_model_dir), "--dataset", str(corpus),
        "--seqlen", "64", "--windows", "2", "--json", str(out_file), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out_file.read_text())["recipe"]["method"] == "fp"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "/no/such/dir"], "not found"),
        (["--dataset", "/no/such/file.txt"], "does not exist"),
        (["--seqlen", "100000"], "larger than the model's context"),
        (["--windows", "1000"], "more than the corpus holds"),
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--recipe", "rtn", "--set", "w_bits=9"], "w_bits must be between 2 and 8"),
        (["--recipe", "rtn", "--set", "a_bits=1"], "a_bits must be between 2 and 8"),
        (["--recipe", "rtn", "--set", "w_group=64"], "does not divide the input width 96"),
        (["--recipe", "rtn", "--set", "colour=red"], "no listed recipe has a setting 'colour'"),
        (["--recipe", "rtn", "--set", "w_bits"], "--set takes KEY=VALUE"),
        (["--json", "/no/such/dir/out.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(capsys, tiny_model_dir, corpus, extra, message):
    argv = ["eval", "--model", str(tiny_model_dir), "--dataset", str(corpus), "--seqlen", "64",
            "--windows", "2", "--no-progress", *extra]  # fmt: skip
    # a later --model/--dataset overrides the defaults above (argparse keeps the last)
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("lowbit: error: ")


def test_bad_corpus_files(capsys, tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)))
    for path, message in ((empty, "is empty"), (binary, "is not text")):
        code, _, err = run(
            capsys, "eval", "--model", str(tiny_model_dir), "--dataset", str(path), "--seqlen", "64"
        )
        assert code == 2 and message in err


def test_seqlen_longer_than_the_corpus(capsys, tiny_model_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("a short text of a few tokens")
    code, _, err = run(
        capsys, "eval", "--model", str(tiny_model_dir), "--dataset", str(short), "--seqlen", "500"
    )
    assert code == 2 and "longer than the corpus" in err


def test_model_file_that_is_not_gguf(capsys, tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    code, _, err = run(capsys, "info", "--model", str(path))
    assert code == 2 and "not a .gguf model" in err


def test_hub_id_offline_names_the_id(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    code, _, err = run(capsys, "info", "--model", "nobody-here/no-such-model")
    assert code == 2 and "'nobody-here/no-such-model'" in err


def test_info_reports_dimensions(capsys, tiny_model_dir):
    code, out, _ = run(capsys, "info", "--model", str(tiny_model_dir))
    assert code == 0
    assert "family: llama" in out
    assert "hidden_size: 96 = 2^5 x 3" in out
    assert "KV heads: 2 (GQA group 3)" in out
    assert "tied embeddings: yes" in out


def test_factor_pow2():
    assert factor_pow2(576) == "2^6 x 9"
    assert factor_pow2(1536) == "2^9 x 3"
    assert factor_pow2(4096) == "2^12 x 1"


def test_recipes_lists_methods_and_presets(capsys):
    code, out, _ = run(capsys, "recipes")
    assert code == 0 and "rtn:" in out and "w4a16-g64: rtn" in out


def test_no_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", "eval", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("lowbit: error: model")


def test_help_explains_every_option():
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", "eval", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    for option in ("--model", "--dataset", "--seqlen", "--windows", "--recipe", "--set", "--json",
                   "--calib", "--calib-samples", "--calib-skip", "--chunk"):  # fmt: skip
        assert option in proc.stdout
