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
        (["--kv-cache", "q4_0"], "--kv-cache is llama.cpp's cache type"),
        (["--engine", "llama.cpp", "--model", "m.gguf", "--kv-cache", "q3"], "--kv-cache must be"),
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
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the package reads the variable once, when it is first imported (before this test)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
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
    assert "rotate:" in out and "rotate+gptq+kvquant" in out


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


# -- integer options, --device, --json targets --------------------------------------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--kv-context", "0"], "--kv-context must be at least 1, not 0"),
        (["--calib-seqlen", "0"], "--calib-seqlen must be at least 1, not 0"),
        (["--calib-skip", "-1"], "--calib-skip must be at least 0, not -1"),
        (["--calib-samples", "0"], "--calib-samples must be at least 1, not 0"),
        (["--seqlen", "1"], "--seqlen must be at least 2, not 1"),
        (["--windows", "0"], "--windows must be at least 1, not 0"),
        (["--chunk", "-3"], "--chunk must be at least 1, not -3"),
        (["--seed", "-1"], "--seed must be at least 0, not -1"),
        (["--device", "tpu"], "unknown --device 'tpu'"),
        (["--json", "/dev/full"], "/dev/full: it is not a regular file"),
    ],
)
def test_bad_options_are_refused_before_the_model_loads(capsys, extra, message):
    # the model does not exist: each refusal must come before anything looks for it
    code, out, err = run(capsys, "eval", "--model", "/no/such/model", *extra)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and err.startswith("lowbit: error: ")


def test_device_cuda_without_cuda_is_a_sentence(capsys, tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for command in ("eval", "info", "generate"):
        argv = [command, "--model", str(tiny_model_dir), "--device", "cuda"]
        code, _, err = run(capsys, *argv, *(["--prompt", "x"] if command == "generate" else []))
        assert code == 2 and err.count("\n") == 1
        assert "--device cuda asks for a CUDA device, but torch finds none" in err


def test_json_to_a_directory_that_takes_no_files_is_refused_first(capsys, tiny_model_dir, corpus,
                                                                  tmp_path):  # fmt: skip
    import os

    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    elif os.path.isdir("/sys"):  # root writes anywhere but in sysfs
        locked = "/sys"
    else:
        pytest.skip("no directory this user cannot write to")
    code, out, err = run(
        capsys, "eval", "--model", str(tiny_model_dir), "--dataset", str(corpus), "--seqlen",
        "64", "--windows", "2", "--no-progress", "--json", f"{locked}/out.json",
    )  # fmt: skip
    assert code == 2 and out == ""  # refused before evaluating
    assert f"the directory {locked} does not take new files" in err


def test_json_never_replaces_a_device_file(tmp_path):
    import stat

    from lowbit.atomic import write_json
    from lowbit.errors import LowbitError

    for force in (False, True):
        with pytest.raises(LowbitError, match="not a regular file"):
            write_json("/dev/full", {"a": 1}, force=force)
        with pytest.raises(LowbitError, match="it is a directory"):
            write_json(str(tmp_path), {"a": 1}, force=force)
    assert stat.S_ISCHR(__import__("os").stat("/dev/full").st_mode)


def test_json_needs_force_to_replace_a_file_and_never_writes_through_a_link(
    capsys, tiny_model_dir, corpus, tmp_path
):
    import os

    real = tmp_path / "results" / "real.json"
    real.parent.mkdir()
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "results" / "new.json")
    argv = ["eval", "--model", str(tiny_model_dir), "--dataset", str(corpus), "--seqlen", "64",
            "--windows", "1", "--no-progress", "--json"]  # fmt: skip
    for target, force in ((real, []), (link, []), (link, ["--force"])):
        code, out, err = run(capsys, *argv, str(target), *force)
        assert code == 2 and out == "" and err.count("\n") == 1  # refused before evaluating
        assert ("never replaces what a link points to" if target == link else "--force") in err
        assert real.read_text() == "old"
    code, _, err = run(capsys, *argv, str(dangling))  # a link to nothing: written through
    assert code == 0, err
    assert dangling.is_symlink() and json.loads(dangling.read_text())["recipe"]["method"] == "fp"
    code, _, err = run(capsys, *argv, str(real), "--force")
    assert code == 0, err
    assert json.loads(real.read_text())["recipe"]["method"] == "fp"
    assert os.stat(real).st_mode & 0o777 == 0o640  # the replaced file keeps its permissions
    assert sorted(p.name for p in real.parent.iterdir()) == ["new.json", "real.json"]


@pytest.mark.parametrize(
    "write, message",
    [
        (lambda d: (d / "config.json").write_text("{oops"), "config.json is not valid JSON"),
        (lambda d: (d / "config.json").write_text("{}"), "has a config.json but no weight files"),
        (lambda d: (d / "m.gguf").write_bytes(b""), "m.gguf is empty: not a GGUF model"),
        (lambda d: (d / "m.gguf").write_text("text\n"), "does not start with the GGUF magic"),
    ],
)
def test_bad_model_files_are_one_sentence(capsys, monkeypatch, tmp_path, write, message):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    write(model)
    spec = model / "m.gguf" if (model / "m.gguf").exists() else model
    code, _, err = run(capsys, "info", "--model", str(spec))
    assert code == 2 and message in err and err.count("\n") == 1


# -- generate ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a chat template in its tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_model_dir, directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    tokenizer.save_pretrained(directory)
    return directory


def test_generate_streams_text_and_reports_speed(capsys, tiny_model_dir):
    from lowbit.generate import generate

    code, out, err = run(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "The module",
        "--max-new-tokens", "16", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    loaded = __import__("lowbit").load_model(str(tiny_model_dir))
    expected = generate(loaded.model, loaded.tokenizer, "The module", max_new_tokens=16)
    assert out == expected.text + "\n"
    assert "16 new tokens" in err and "tokens/s" in err and "KV cache: DynamicCache" in err
    assert "peak memory" in err and "process peak RSS" in err


def test_generate_with_a_kv_recipe_uses_the_quantized_cache(capsys, tiny_model_dir):
    code, out, err = run(
        capsys, "generate", "--model", str(tiny_model_dir), "--recipe", "kv-int", "--set",
        "k_bits=8", "--prompt", "The module", "--max-new-tokens", "8", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert out.strip() and "KV cache: QuantizedKVCache" in err


def test_chat_answers_each_line_of_stdin(capsys, monkeypatch, chat_model_dir):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("first question\n\nsecond question\n"))
    code, out, err = run(
        capsys, "generate", "--model", str(chat_model_dir), "--chat", "--max-new-tokens", "6"
    )
    assert code == 0, err
    turns = [line for line in err.splitlines() if "new tokens" in line]
    assert len(turns) == 2  # the empty line is no turn
    prompts = [int(line.split("(")[1].split()[0]) for line in turns]
    assert prompts[1] > prompts[0] + 6  # the second turn holds the first question and answer
    assert out.count("\n") >= 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, not 0"),
        (["--prompt", "x", "--chat"], "has no chat template, so --chat cannot"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature must be 0 (greedy) or a finite"),
        (["--prompt", "x", "--temperature", "nan"], "--temperature must be 0 (greedy) or a finite"),
        (["--prompt", "x", "--temperature", "inf"], "--temperature must be 0 (greedy) or a finite"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "nan"], "--top-p must be more than 0"),
        (["--prompt", "x", "--set", "w_bits=4"], "give it with --recipe"),
        (["--prompt", "  "], "--prompt is empty"),
        ([], "generate needs --prompt"),
        (["--prompt", "x", "--device", "cuda:x"], "unknown --device 'cuda:x'"),
    ],
)
def test_generate_bad_input(capsys, tiny_model_dir, extra, message):
    code, out, err = run(capsys, "generate", "--model", str(tiny_model_dir), *extra)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


# -- where quantize and export write, and what stops them -----------------------------------------
@pytest.fixture(scope="module")
def saved_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model quantized with rtn (group 32) and saved by `lowbit quantize`."""
    out = tmp_path_factory.mktemp("saved") / "q"
    argv = ["quantize", "--model", str(tiny_model_dir), "--recipe", "rtn", "--set", "w_group=32"]
    assert main([*argv, "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    return out


def _quantize_argv(tiny_model_dir, out):
    return ["quantize", "--model", str(tiny_model_dir), "--recipe", "rtn", "--out", str(out),
            "--no-progress"]  # fmt: skip


def _export_argv(saved_dir, out):
    return ["export", "--model", str(saved_dir), "--format", "compressed-tensors", "--out",
            str(out)]  # fmt: skip


@pytest.mark.parametrize("command", ["quantize", "export"])
def test_out_may_be_a_link_to_an_empty_directory_or_a_dangling_link(
    capsys, tiny_model_dir, saved_dir, tmp_path, command
):
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "new")
    for link in (tmp_path / "to-empty", tmp_path / "dangling"):
        argv = (_quantize_argv if command == "quantize" else _export_argv)(
            tiny_model_dir if command == "quantize" else saved_dir, link
        )
        code, out, err = run(capsys, *argv)
        assert code == 0, err
        assert link.is_symlink() and (link / "config.json").is_file()  # written through
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "empty", "new", "to-empty"]


def _full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("command", ["quantize", "export"])
@pytest.mark.parametrize("fault", ["full disk", "another writer"])
def test_a_fault_while_writing_is_a_sentence_and_leaves_nothing(
    capsys, monkeypatch, tiny_model_dir, saved_dir, tmp_path, command, fault
):
    out = tmp_path / "out"

    from safetensors.torch import save_file

    def another_writer(*args, **kwargs):  # creates the target while this one writes
        save_file(*args, **kwargs)
        out.mkdir()
        (out / "theirs").write_text("kept")

    monkeypatch.setattr(
        "safetensors.torch.save_file", _full_disk if fault == "full disk" else another_writer
    )
    argv = (
        _quantize_argv(tiny_model_dir, out)
        if command == "quantize"
        else _export_argv(saved_dir, out)
    )
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("lowbit: error: ")
    if fault == "full disk":
        assert "the disk is full (No space left on device); nothing was written" in err
        assert list(tmp_path.iterdir()) == []
    else:
        assert "it appeared while writing" in err
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
        assert [p.name for p in out.iterdir()] == ["theirs"]


def test_a_full_disk_while_writing_json_keeps_the_old_file(capsys, monkeypatch, tiny_model_dir,
                                                          corpus, tmp_path):  # fmt: skip
    target = tmp_path / "out.json"
    target.write_text("old")
    monkeypatch.setattr(json, "dump", _full_disk)
    code, _, err = run(
        capsys, "eval", "--model", str(tiny_model_dir), "--dataset", str(corpus), "--seqlen",
        "64", "--windows", "1", "--no-progress", "--json", str(target), "--force",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "the disk is full (No space left on device); nothing was written" in err
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"] and target.read_text() == "old"


def test_sigterm_is_a_sentence_and_exit_143(capsys, monkeypatch):
    import os
    import signal
    import time

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs before this ends

    monkeypatch.setattr("lowbit.cli.run_info", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    code, _, err = run(capsys, "info")
    assert code == 143 and err == "lowbit: terminated\n"
    assert signal.getsignal(signal.SIGTERM) is previous


# -- quantize --device, info of a packed model, a resumed run ------------------------------------
@pytest.mark.parametrize(
    "device, message",
    [
        ("tpu", "unknown --device 'tpu'"),
        ("cuda:x", "unknown --device 'cuda:x'"),
    ],
)
def test_quantize_device_is_checked_before_the_model_loads(capsys, tmp_path, device, message):
    argv = _quantize_argv("/no/such/model", tmp_path / "q")
    code, out, err = run(capsys, *argv, "--device", device)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_quantize_device_cuda_without_cuda_is_a_sentence(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run(
        capsys, *_quantize_argv("/no/such/model", tmp_path / "q"), "--device", "cuda"
    )
    assert code == 2 and "--device cuda asks for a CUDA device, but torch finds none" in err


def test_info_counts_the_weights_a_packed_model_stands_for(capsys, tiny_model_dir, saved_dir):
    def parameters(model_dir):
        code, out, err = run(capsys, "info", "--model", str(model_dir))
        assert code == 0, err
        return next(line for line in out.splitlines() if line.startswith("parameters: "))

    float_line, packed_line = parameters(tiny_model_dir), parameters(saved_dir)
    assert packed_line.startswith(float_line + " (packed linears count the weights")
    # 384 x 96 embeddings (tied) + 2 blocks of 70,656 linear weights and 2 norms of 96 + 96
    assert float_line == "parameters: 178,656"


def test_a_resumed_quantize_says_how_many_blocks_it_restored(capsys, tiny_model_dir, corpus,
                                                             tmp_path):  # fmt: skip
    argv = ["quantize", "--model", str(tiny_model_dir), "--recipe", "gptq", "--calib",
            str(corpus), "--calib-samples", "2", "--seqlen", "32", "--no-progress",
            "--resume-dir", str(tmp_path / "resume")]  # fmt: skip
    code, _, err = run(capsys, *argv, "--out", str(tmp_path / "first"))
    assert code == 0, err
    assert "resuming" not in err
    code, _, err = run(capsys, *argv, "--out", str(tmp_path / "second"))
    assert code == 0, err
    assert f"lowbit: resuming from {tmp_path / 'resume'}: 2 of 2 blocks were calibrated" in err


# -- model directories, prompts and chat lines that are not what they should be ------------------
@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "florble"}, "names the model_type 'florble'"),
        ({"model_type": None}, "names no model_type"),
        (None, "names no model_type"),  # config.json is {}
        ({"hidden_size": "96"}, "Field 'hidden_size' expected int, got str"),
    ],
)
def test_configs_of_plain_model_directories(capsys, tiny_model_dir, tmp_path, edit, message):
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text()) if edit is not None else {}
    for key, value in (edit or {}).items():
        config.pop(key) if value is None else config.update({key: value})
    (model / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "info", "--model", str(model))
    assert code == 2 and message in err and err.count("\n") == 1


def test_a_prompt_that_is_not_utf8_is_a_sentence(tiny_model_dir):
    """A real process: the bytes arrive in sys.argv as Python decodes them (surrogateescape)."""
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", "generate", "--model", str(tiny_model_dir), "--prompt",
         b"ab\xff\xfe binary"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "lowbit: error: --prompt is not valid UTF-8 text (the byte 0xff at character 3)\n"
    )


def test_a_prompt_of_control_characters_generates(capsys, tiny_model_dir):
    code, out, err = run(
        capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "\x01\x02\x1b[31m\x7f",
        "--max-new-tokens", "3",
    )  # fmt: skip
    assert code == 0, err
    assert "3 new tokens" in err


@pytest.mark.parametrize(
    "stdin, message",
    [
        (
            "first question\nab\udcff\n",
            "user turn 2 of the chat is not valid UTF-8 text (the byte 0xff at character 3)",
        ),
        (b"first question\n\xff\n", "a line of stdin is not valid UTF-8 text (the byte 0xff)"),
    ],
)
def test_a_chat_line_that_is_not_utf8_is_a_sentence(capsys, monkeypatch, chat_model_dir, stdin,
                                                    message):  # fmt: skip
    import io

    stream = (
        io.StringIO(stdin)
        if isinstance(stdin, str)  # decoded with surrogateescape, as Python's own stdin may be
        else io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")  # strict decoding
    )
    monkeypatch.setattr("sys.stdin", stream)
    code, _, err = run(
        capsys, "generate", "--model", str(chat_model_dir), "--chat", "--max-new-tokens", "2"
    )
    assert code == 2
    assert err.splitlines()[-1].startswith(f"lowbit: error: {message}")
    assert "Traceback" not in err


def test_the_quickstarts_outputs_are_ignored_by_git():
    """The README's quickstart writes its model directories into the working directory."""
    import re
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", (root / "README.md").read_text(), re.S)
    outputs = re.findall(r"--out (\S+)", "\n".join(blocks))  # what a user runs as written
    assert outputs
    for name in outputs:
        check = subprocess.run(["git", "check-ignore", "-q", name], cwd=root)
        assert check.returncode == 0, f"{name} is not ignored by git"
