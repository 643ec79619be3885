"""Resumable GPTQ calibration: block checkpoints give the weights of an uninterrupted run."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit.algorithms.int_spec import IntWeightSpec
from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.registry import get_recipe

LAYERS = 4
LINEARS_PER_BLOCK = 7  # q, k, v, o, gate, up, down
GPTQ = ("gptq", {"w_bits": "4", "w_group": "32"})
QUAROT = ("quarot", {"w_bits": "4", "w_group": "32", "a_bits": "16", "kv_bits": "16"})


def calibration(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (8, 32), generator=torch.Generator().manual_seed(seed))


def run(recipe=GPTQ, resume_dir=None, calib_seed=0, **settings):
    name, base = recipe
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    return quantize(
        model,
        get_recipe(name, **{**base, **settings}),
        calibration=calibration(calib_seed),
        progress=False,
        resume_dir=resume_dir,
    )


def assert_same_weights(model, reference) -> None:
    """Every block linear: same codes, scales, zeros, dequantized weight and choice."""
    count = 0
    for name, module in reference.named_modules():
        if not isinstance(module, FakeQuantLinear):
            continue
        other = model.get_submodule(name)
        assert torch.equal(other.weight, module.weight), name
        assert (
            other.weight.dtype == module.weight.dtype
            and other.weight_format == module.weight_format
        )
        q, r = other.quantized_weight, module.quantized_weight
        assert (q is None) == (r is None), name
        if r is not None:
            assert torch.equal(q.qdata, r.qdata) and torch.equal(q.scale, r.scale), name
            assert (q.zero is None) == (r.zero is None)
            assert r.zero is None or torch.equal(q.zero, r.zero)
            assert (q.bits, q.group_size, q.symmetric, q.shape, q.dtype, q.scale_dtype) == (
                r.bits, r.group_size, r.symmetric, r.shape, r.dtype, r.scale_dtype
            )  # fmt: skip
            assert torch.equal(q.dequantize(), r.dequantize())
        count += 1
    assert count == LAYERS * LINEARS_PER_BLOCK
    assert model.lowbit_weight_report.layers == reference.lowbit_weight_report.layers


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread here and in the killed child, so both compute alike (and fast)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def count_gptq(monkeypatch):
    """Counts the calls of GPTQ made by the weight driver."""
    calls = []
    original = IntWeightSpec.gptq

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(IntWeightSpec, "gptq", counted)
    return calls


@pytest.fixture(scope="module")
def uninterrupted():
    return run()


@pytest.fixture(scope="module")
def finished_dir(tmp_path_factory):
    """A resume directory holding every block of the GPTQ run, and that run's model."""
    directory = tmp_path_factory.mktemp("resume") / "run"
    return directory, run(resume_dir=directory)


@pytest.fixture
def resume_copy(finished_dir, tmp_path):
    directory = tmp_path / "run"
    shutil.copytree(finished_dir[0], directory)
    return directory


def test_resume_dir_gives_the_weights_of_a_run_without_it(finished_dir, uninterrupted):
    directory, model = finished_dir
    assert_same_weights(model, uninterrupted)
    names = sorted(p.name for p in directory.iterdir())
    blocks = [f"block-{i:04d}.{ext}" for i in range(LAYERS) for ext in ("json", "safetensors")]
    assert names == sorted(blocks + ["run.json"])


def test_a_finished_run_restores_every_block_without_gptq(resume_copy, uninterrupted, count_gptq):
    assert_same_weights(run(resume_dir=resume_copy), uninterrupted)
    assert not count_gptq


def test_a_block_without_its_json_is_redone(resume_copy, uninterrupted, count_gptq):
    (resume_copy / "block-0002.json").unlink()
    (resume_copy / "block-0002.safetensors").write_bytes(b"half")  # a write the kill cut short
    (resume_copy / ".block-0003.json.abc.tmp").write_text("{")  # a temporary file left behind
    assert_same_weights(run(resume_dir=resume_copy), uninterrupted)
    assert len(count_gptq) == LINEARS_PER_BLOCK
    assert json.loads((resume_copy / "block-0002.json").read_text())["block"] == 2
    assert not list(resume_copy.glob(".*.tmp"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"w_bits": "3"}, r"the recipe changed \(recipe\.settings\.w_bits: 4 there, 3 here\)"),
        ({"calib_seed": 1}, "the calibration tokens changed"),
        ({"sequential": "false"}, "the recipe changed"),
    ],
)
def test_a_directory_of_another_run_is_refused(resume_copy, change, message):
    with pytest.raises(LowbitError, match=f"written by a different run: {message}.*--resume-dir"):
        run(resume_dir=resume_copy, **change)


def test_other_model_weights_and_foreign_directories_are_refused(resume_copy, tmp_path):
    model = tiny_model("llama", seed=1, num_hidden_layers=LAYERS)
    with pytest.raises(LowbitError, match="the model's float weights changed; delete it"):
        quantize(
            model, get_recipe("gptq", **GPTQ[1]), calibration=calibration(), progress=False,
            resume_dir=resume_copy,
        )  # fmt: skip
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(LowbitError, match="not empty and has no run.json"):
        run(resume_dir=tmp_path)
    with pytest.raises(LowbitError, match="is a file, not a directory"):
        run(resume_dir=tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "json"])
def test_a_damaged_block_is_a_sentence(resume_copy, damage):
    tensors, record = resume_copy / "block-0001.safetensors", resume_copy / "block-0001.json"
    data = tensors.read_bytes()
    if damage == "truncate":
        tensors.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        tensors.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        tensors.unlink()
    else:
        record.write_text(record.read_text()[:40])
    expected = "not valid JSON" if damage == "json" else "block 1 of resume directory .* is damaged"
    with pytest.raises(LowbitError, match=expected):
        run(resume_dir=resume_copy)


def test_non_sequential_resume_propagates_float_outputs(tmp_path, count_gptq):
    reference = run(sequential="false")
    first = run(resume_dir=tmp_path, sequential="false")
    assert_same_weights(first, reference)
    for index in (1, 3):  # an interrupted run; block 3 also restored after the last redone one
        (tmp_path / f"block-{index:04d}.json").unlink()
    count_gptq.clear()
    assert_same_weights(run(resume_dir=tmp_path, sequential="false"), reference)
    assert len(count_gptq) == 2 * LINEARS_PER_BLOCK


CHILD = """
import json, os, signal, sys
import torch
from lowbit.calibrate.resume import BlockCheckpoints
from lowbit.models.tiny import tiny_model
from lowbit.api import quantize
from lowbit.recipes.registry import get_recipe

torch.set_num_threads(1)  # as the test process (the one_thread fixture)
name, settings, directory, layers = json.loads(sys.argv[1])
save = BlockCheckpoints.save

def save_then_die(self, index, *args):
    save(self, index, *args)
    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)

BlockCheckpoints.save = save_then_die
tokens = torch.randint(3, 256, (8, 32), generator=torch.Generator().manual_seed(0))
model = tiny_model("llama", num_hidden_layers=layers)
quantize(model, get_recipe(name, **settings), calibration=tokens, progress=False,
         resume_dir=directory)
"""


@pytest.mark.parametrize("recipe", [GPTQ, QUAROT], ids=["gptq", "quarot"])
def test_killed_run_resumes_to_the_uninterrupted_weights(recipe, tmp_path, count_gptq, request):
    directory = tmp_path / "run"
    argument = json.dumps([recipe[0], recipe[1], str(directory), LAYERS])
    child = subprocess.run(
        [sys.executable, "-c", CHILD, argument],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    done = sorted(p.name for p in directory.glob("block-*.json"))
    assert done == ["block-0000.json", "block-0001.json"]
    resumed = run(recipe, resume_dir=directory)
    assert len(count_gptq) == (LAYERS - 2) * LINEARS_PER_BLOCK  # blocks 0 and 1 not redone
    reference = request.getfixturevalue("uninterrupted") if recipe is GPTQ else run(recipe)
    assert_same_weights(resumed, reference)


def test_cli_quantize_resumes_from_its_directory(tiny_model_dir, tmp_path, capsys, count_gptq):
    from safetensors.torch import load_file

    from lowbit.cli import main

    resume = tmp_path / "resume"
    args = ["quantize", "--model", str(tiny_model_dir), "--recipe", "w4a16-g64-gptq",
            "--set", "w_group=32", "--calib-samples", "4", "--seqlen", "64", "--no-progress",
            "--resume-dir", str(resume)]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert sorted(p.name for p in resume.glob("*.json")) == [
        "block-0000.json", "block-0001.json", "run.json"
    ]  # fmt: skip
    count_gptq.clear()
    assert main([*args, "--out", str(tmp_path / "b")]) == 0  # every block restored
    assert not count_gptq
    first = load_file(tmp_path / "a" / "model.safetensors")
    second = load_file(tmp_path / "b" / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)

    capsys.readouterr()
    assert main([*args, "--set", "w_bits=3", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was written by a different run: the recipe changed" in err
    assert main(["eval", "--model", str(tiny_model_dir), "--recipe", "gptq", "--recipe", "quarot",
                 "--resume-dir", str(resume), "--no-progress"]) == 2  # fmt: skip
    assert "2 recipes calibrate with GPTQ" in capsys.readouterr().err
    same = ["--resume-dir", str(tmp_path / "d"), "--out", str(tmp_path / "d")]
    assert main([*args, *same]) == 2
    assert "another directory than --out" in capsys.readouterr().err
