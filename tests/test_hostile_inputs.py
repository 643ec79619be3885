"""Issue 50's hostile cases: nothing a user owns is overwritten, every input gets a sentence.

Each test names the case it checks. Refusals come before any model loads, so most run in a
moment; the cases whose path crosses processes (unreadable files, a saved model loaded by
another process) run there.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lowbit.cli import main
from lowbit.errors import LowbitError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_sentence(code, err):
    return code == 2 and err.count("\n") == 1 and "Traceback" not in err


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """The tiny model quantized with rtn and saved (a lowbit checkpoint)."""
    out = tmp_path_factory.mktemp("saved") / "q"
    argv = ["quantize", "--model", str(tiny_model_dir), "--recipe", "rtn", "--set", "w_group=32"]
    assert main([*argv, "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    return out


# -- data lost: the one writing rule ---------------------------------------------------------------
def _gguf_argv(tiny_model_dir, out, *extra):
    return ["export", "--format", "gguf", "--recipe", "gguf", "--set", "gguf_type=Q8_0", "--set",
            "w_algo=rtn", "--model", str(tiny_model_dir), "--out", str(out), "--no-progress",
            *extra]  # fmt: skip


def test_gguf_export_never_replaces_a_file_without_force_nor_through_a_link(
    capsys, monkeypatch, tiny_model_dir, tmp_path
):
    """`export --format gguf --out PATH` on an existing GGUF, a text file, a link to a text
    file: refused before the model loads, each file as it was; "a link" only for the link."""
    existing = tmp_path / "old.gguf"
    existing.write_bytes(b"GGUF" + bytes(100))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n" * 2000)
    notes2 = tmp_path / "notes2.txt"
    notes2.write_text("other notes\n")
    link = tmp_path / "link.gguf"
    link.symlink_to(notes2)
    before = {p: p.read_bytes() for p in (existing, notes, notes2)}
    monkeypatch.chdir(tmp_path)  # a relative path is no link either
    for out, force in ((existing, []), ("notes.txt", []), (link, []), (link, ["--force"])):
        code, stdout, err = run(capsys, *_gguf_argv(tiny_model_dir, out, *force))
        assert one_sentence(code, err) and stdout == "", err
        if out == link:
            assert "(a link to" in err and "never replaces what a link points to" in err
        else:
            assert "a link" not in err and "pass --force to replace it" in err
    assert {p: p.read_bytes() for p in before} == before and link.is_symlink()


def test_gguf_export_with_force_replaces_a_regular_file_and_states_llama_cpp_kv_bytes(
    capsys, tiny_model_dir, tmp_path
):
    """--force replaces a regular file (the new GGUF, written whole); the llama.cpp row's KV
    bytes per token come from the file (before: NaN)."""
    from lowbit.eval.llama_cpp import gguf_kv_bytes_per_token
    from lowbit.eval.memory import float_kv_bytes_per_token
    from lowbit.models.adapter import adapter_for
    from lowbit.models.loader import load_model

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    notes.chmod(0o640)
    code, _, err = run(capsys, *_gguf_argv(tiny_model_dir, notes, "--force"))
    assert code == 0, err
    assert notes.read_bytes()[:4] == b"GGUF" and notes.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no temporary left
    adapter = adapter_for(load_model(str(tiny_model_dir)).model)
    assert gguf_kv_bytes_per_token(notes) == float_kv_bytes_per_token(adapter) > 0


def test_gguf_type_and_set_gguf_type_that_disagree_are_refused(capsys, tiny_model_dir, tmp_path):
    """`--set gguf_type=Q8_0 --type Q4_0`: before, --type won without a word."""
    argv = _gguf_argv(tiny_model_dir, tmp_path / "m.gguf", "--type", "Q4_0")
    code, _, err = run(capsys, *argv)
    assert one_sentence(code, err) and "--type Q4_0 and --set gguf_type=Q8_0" in err
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("command", ["quantize", "compressed-tensors", "report", "eval", "lm-eval"])
def test_every_writer_refuses_an_existing_target_before_any_work(
    capsys, tiny_model_dir, tmp_path, command
):
    """The same rule (lowbit.atomic.check_target) for quantize, both exports, report, eval's
    and lm-eval's --json: a file needs --force; a directory with files is never replaced."""
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep me too\n")
    model = ["--model", "/no/such/model"]  # every refusal comes before the model is looked for
    argv = {
        "quantize": ["quantize", *model, "--recipe", "rtn", "--out"],
        "compressed-tensors": [
            "export",
            *model,
            "--recipe",
            "rtn",
            "--format",
            "compressed-tensors",
            "--out",
        ],  # fmt: skip
        "report": ["report", str(tmp_path / "rows.json"), "--out"],
        "eval": ["eval", *model, "--json"],
        "lm-eval": ["lm-eval", *model, "--json"],
    }[command]
    code, _, err = run(capsys, *argv, str(notes))
    assert one_sentence(code, err) and "it exists (a file of 8 bytes); pass --force" in err
    code, _, err = run(capsys, *argv, str(full), "--force")
    assert one_sentence(code, err)
    assert (
        "it is a directory" if command in ("eval", "lm-eval") else "not even with --force"
    ) in err
    assert notes.read_text() == "keep me\n" and (full / "mine.txt").read_text() == "keep me too\n"


def test_force_never_replaces_what_the_command_reads(capsys, tmp_path):
    """Added case: --force with the output on one of the command's own inputs."""
    rows = tmp_path / "rows.json"
    rows.write_text("[]")
    text = tmp_path / "text.txt"
    text.write_text("some text\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    for argv in (
        ["report", str(rows), "--out", str(rows)],
        ["eval", "--model", "/no/such/model", "--dataset", str(text), "--json", str(text)],
        ["export", "--format", "gguf", "--model", str(model), "--out", str(model)],
    ):
        code, _, err = run(capsys, *argv, "--force")
        assert one_sentence(code, err) and "it is also what this command reads" in err, err
    assert rows.read_text() == "[]" and text.read_text() == "some text\n"
    assert model.read_bytes() == b"GGUF"


def test_quantize_with_force_replaces_a_file_by_the_checkpoint(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    out.write_text("old\n")
    argv = ["quantize", "--model", str(tiny_model_dir), "--recipe", "rtn", "--out", str(out),
            "--no-progress", "--force"]  # fmt: skip
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert (out / "config.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- tracebacks ------------------------------------------------------------------------------------
def _unprivileged_prefix() -> list[str]:
    """A command prefix under which chmod 000 really denies reading (root overrides modes)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: cannot drop the override of file modes")
    probe = subprocess.run(
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "true"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr.decode().strip()}")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def test_unreadable_files_are_one_sentence_in_a_process_without_root_override(
    saved, tiny_model_dir, tmp_path
):
    """A checkpoint's model.safetensors, its config.json, the checkpoint directory, a --dataset
    file: each unreadable (mode 000, in a process that cannot override it) is one sentence
    naming the path (before: PermissionError in checksum / format / data)."""
    prefix = _unprivileged_prefix()
    cases = {}
    for name, unreadable in (("weights", "model.safetensors"), ("config", "config.json"),
                             ("directory", "")):  # fmt: skip
        copy = tmp_path / name
        shutil.copytree(saved, copy)
        (copy / unreadable).chmod(0o000)
        cases[name] = (["eval", "--model", str(copy), "--seqlen", "32", "--windows", "1",
                        "--no-progress"], str(copy / unreadable).rstrip("/"))  # fmt: skip
    text = tmp_path / "text.txt"
    text.write_text("some text " * 200)
    text.chmod(0o000)
    cases["dataset"] = (["eval", "--model", str(tiny_model_dir), "--dataset", str(text),
                         "--no-progress"], str(text))  # fmt: skip
    script = textwrap.dedent(f"""
        import contextlib, io, json
        from lowbit.cli import main
        results = {{}}
        for name, (argv, _) in json.loads({json.dumps(json.dumps(cases))}).items():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            results[name] = [code, err.getvalue()]
        print(json.dumps(results))
    """)
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    for path in (tmp_path / "directory", *tmp_path.glob("*/*"), text):
        path.chmod(0o755)  # so that pytest can remove them
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    for name, (code, err) in results.items():
        path = cases[name][1]
        assert one_sentence(code, err), (name, err)
        assert f"cannot read {'dataset file ' if name == 'dataset' else ''}{path}" in err, err
        assert "permission denied" in err


def test_the_reader_names_directories_and_missing_files(tmp_path):
    from lowbit.checksum import file_sha256
    from lowbit.files import read_text

    with pytest.raises(LowbitError, match=f"cannot read {tmp_path}: it is a directory"):
        file_sha256(tmp_path)
    with pytest.raises(LowbitError, match="cannot read .*nothing.txt: it does not exist"):
        read_text(tmp_path / "nothing.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(LowbitError, match="latin1.txt is not UTF-8 text"):
        read_text(tmp_path / "latin1.txt")


def test_lm_eval_refuses_bad_options_before_any_work(capsys, tmp_path):
    """`lm-eval --items -3` (before: ValueError from random.sample), a --json directory and a
    bad --model: refused before lm-eval is imported or a model loads (before: after 25-29 s)."""
    import time

    for argv, message in (
        (["--items", "-3"], "at least 1 item, not -3 (--items)"),
        (["--json", str(tmp_path)], "it is a directory"),
        (["--model", str(tmp_path / "nope")], "not found: no such file or directory"),
        (["--limit", "0"], "--limit must be at least 1, not 0"),
    ):
        start = time.perf_counter()
        code, _, err = run(capsys, "lm-eval", *argv)
        assert one_sentence(code, err) and message in err, err
        assert time.perf_counter() - start < 5


def test_llama_cpp_engine_compares_vocabularies_before_any_window(
    monkeypatch, tiny_model_dir, tmp_path
):
    """A GGUF whose vocabulary is not the reference's (before: llama_decode returned -1)."""
    from lowbit.eval import llama_cpp
    from lowbit.eval.evaluate import FloatReference
    from lowbit.models.loader import load_model

    loaded = load_model(str(tiny_model_dir))
    vocab = int(loaded.model.get_output_embeddings().weight.shape[0])
    tokenizer = loaded.tokenizer

    class FakeLlama:  # llama-cpp-python's Llama, as far as the check reads it
        def __init__(self, n_vocab, spell=None):
            self._n_vocab, self.spell = n_vocab, spell
            self.evaluated = 0

        def n_vocab(self):
            return self._n_vocab

        def detokenize(self, ids):
            text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            return (self.spell or text).encode()

        def reset(self):
            pass

        def eval(self, ids):
            self.evaluated += 1

    corpus = tmp_path / "text.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 100)
    reference = FloatReference(loaded.model)
    reference.tokenizer = tokenizer
    for fake, message in (
        (FakeLlama(vocab + 17), f"a vocabulary of {vocab + 17} tokens and the reference"),
        (FakeLlama(vocab, spell="other text"), "spells the reference model's tokens otherwise"),
    ):
        monkeypatch.setattr(llama_cpp, "_llama", lambda *a, fake=fake, **k: fake)
        with pytest.raises(LowbitError, match=message):
            llama_cpp.evaluate_gguf(tmp_path / "x.gguf", dataset=str(corpus), seqlen=16,
                                    windows=2, progress=False, float_reference=reference)  # fmt: skip
        assert fake.evaluated == 0  # refused before any window ran
    same = llama_cpp.LlamaCppModel.__new__(llama_cpp.LlamaCppModel)
    same.path, same.llm = tmp_path / "x.gguf", FakeLlama(vocab)
    same.check_vocabulary(vocab, tokenizer, torch.arange(3, 40))  # the same vocabulary passes


# -- report rows that are not finite ---------------------------------------------------------------
def _row(label, ppl, kl, method="rtn"):
    return {"label": label, "ppl": ppl, "kl": kl, "bits_per_weight": 4.5,
            "kv_bytes_per_token": 1024.0, "recipe": {"method": method}}  # fmt: skip


def test_report_draws_non_finite_rows_with_a_note(monkeypatch, tmp_path):
    """`ppl: Infinity` (before: matplotlib's "Data cannot be log-scaled") and `ppl: NaN, kl:
    Infinity` (before: an empty KL plot with a legend and no note)."""
    import matplotlib.axes

    from lowbit.eval.report import write_report

    notes = []
    real_text = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text",
                        lambda self, x, y, s, *a, **k: notes.append(s) or real_text(
                            self, x, y, s, *a, **k))  # fmt: skip
    rows = tmp_path / "rows.json"
    # what eval --json writes for such rows: JSON's NaN and Infinity
    rows.write_text(json.dumps([_row("fp", 10.0, 0.0, "fp"), _row("w2", float("inf"), 3.0),
                                _row("w1", float("nan"), float("inf"))]))  # fmt: skip
    assert "Infinity" in rows.read_text() and "NaN" in rows.read_text()
    page = write_report([rows], tmp_path / "out")
    html = page.read_text()
    assert "<td>inf</td>" in html and "<td>nan</td>" in html
    assert any("not drawn, ppl not a finite number: w2 (inf), w1 (nan)" in n for n in notes)
    assert any("not drawn, kl not a finite number: w1 (inf)" in n for n in notes)


def test_report_refuses_a_row_whose_numbers_are_not_numbers(capsys, tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([_row("w4", "12.5", 0.1)]))
    code, _, err = run(capsys, "report", str(rows), "--out", str(tmp_path / "out"))
    assert one_sentence(code, err) and "has ppl '12.5', not a number" in err


# -- silently wrong --------------------------------------------------------------------------------
def _with_nan_scale(saved: Path, directory: Path) -> Path:
    """A copy of ``saved`` with one scale NaN and its checksums recomputed to match."""
    from safetensors.torch import load_file, save_file

    from lowbit.checksum import file_sha256
    from lowbit.io.format import config_checksum

    shutil.copytree(saved, directory)
    tensors = load_file(directory / "model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith(".scale"))
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    checksums = config["quantization_config"]["checksums"]
    checksums["model.safetensors"] = file_sha256(directory / "model.safetensors")
    checksums["config.json"] = config_checksum(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_nan_scale_is_refused_on_every_load_path(capsys, saved, tmp_path):
    """lowbit.load, from_pretrained and `lowbit eval` (before: ppl nan, exit 0, NaN logits)."""
    from transformers import AutoModelForCausalLM

    import lowbit

    damaged = _with_nan_scale(saved, tmp_path / "nan")
    for load in (lowbit.load, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(LowbitError, match=r"\.scale' holds 1 value\(s\) that are not finite"):
            load(damaged)
    code, out, err = run(capsys, "eval", "--model", str(damaged), "--seqlen", "32", "--windows",
                         "1", "--no-progress")  # fmt: skip
    assert one_sentence(code, err) and "not finite" in err and "nan" not in out


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_non_finite_settings_are_refused_where_they_enter(capsys, value):
    """`--set weight_lr=inf` (before: accepted, 300 steps trained) and every float setting."""
    from lowbit.recipes.registry import get_recipe

    code, _, err = run(capsys, "eval", "--model", "/no/such/model", "--recipe", "learn-rotate",
                       "--set", f"weight_lr={value}")  # fmt: skip
    assert one_sentence(code, err) and "not a finite number" in err and "weight_lr" in err
    with pytest.raises(LowbitError, match="not a finite number"):
        get_recipe("learn-rotate").with_settings(lr=float(value))
    with pytest.raises(LowbitError, match="not a finite number"):
        get_recipe("rtn").with_settings(a_clip_ratio=value)


# -- papercuts -------------------------------------------------------------------------------------
def test_info_needs_no_tokenizer(capsys, saved, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(saved, bare)
    for path in bare.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            path.unlink()
    from transformers import AutoTokenizer

    with pytest.raises(Exception):  # noqa: B017 (transformers' error types vary)
        AutoTokenizer.from_pretrained(bare)
    code, out, err = run(capsys, "info", "--model", str(bare))
    assert code == 0, err
    assert "hidden_size" in out and "quantized: rtn" in out


def test_quantize_states_the_bits_and_bytes_eval_of_the_saved_model_states(
    capsys, tiny_model_dir, tmp_path
):
    """A KV-only recipe leaves the weights in float: quantize measured them in float32 (32.000
    bits, 0.7 MB) where eval of the saved model (bf16) said 16.000 and 0.4."""
    out = tmp_path / "kv"
    code, stdout, err = run(capsys, "quantize", "--model", str(tiny_model_dir), "--recipe",
                            "kv-int", "--out", str(out), "--no-progress")  # fmt: skip
    assert code == 0, err
    stated = stdout.split(": ", 1)[1].split(", ")
    bits, megabytes = stated[1], stated[2]
    code, _, err = run(capsys, "eval", "--model", str(out), "--seqlen", "32", "--windows", "1",
                       "--no-progress", "--json", str(tmp_path / "row.json"))  # fmt: skip
    assert code == 0, err
    row = json.loads((tmp_path / "row.json").read_text())
    assert bits == f"{row['bits_per_weight']:.3f} bits per weight" and bits.startswith("16.000")
    assert megabytes == f"{row['model_bytes'] / 1e6:.1f} MB"
