"""Distributed calibration (lowbit.calibrate.distributed): two gloo processes write the checkpoint
one process writes, bit for bit; what cannot be distributed is refused in one sentence."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lowbit.api import quantize, quantize_to_directory
from lowbit.calibrate.distributed import Group
from lowbit.errors import LowbitError
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

# 5 samples over 2 ranks: rank 1 runs a spare sample in the last step; the guard holds one out
CALIB = torch.randint(0, 256, (5, 24), generator=torch.Generator().manual_seed(5))
CHILD = """
import sys, torch
from lowbit.api import quantize_to_directory
from lowbit.recipes.registry import get_recipe
model, out, calib = sys.argv[1], sys.argv[2], torch.load(sys.argv[3])
recipe = get_recipe("gptq", w_bits=4, w_group=32)
quantize_to_directory(model, recipe, out, calibration=calib, stream=True, progress=False,
                      distributed=True)
assert not torch.distributed.is_initialized()  # the call ended the group it started
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_two_gloo_processes_write_one_process_checkpoint_bit_for_bit(tmp_path):
    """torchrun's environment by hand: two ranks on gloo, streamed (the in-memory path takes the
    same walk); rank 0's checkpoint holds exactly the tensors of one process's."""
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    torch.save(CALIB, tmp_path / "calib.pt")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    env["OMP_NUM_THREADS"] = "1"  # as torchrun sets it
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD,
                str(model_dir),
                str(tmp_path / "two"),
                str(tmp_path / "calib.pt"),
            ],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    quantize_to_directory(
        model_dir, get_recipe("gptq", w_bits=4, w_group=32), tmp_path / "one", calibration=CALIB,
        stream=True, progress=False,
    )  # fmt: skip
    for child in children:
        _, stderr = child.communicate(timeout=120)
        assert child.returncode == 0, stderr
    one, two = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    assert sorted(two) == sorted(one)
    for key, tensor in one.items():
        assert two[key].dtype == tensor.dtype, key
        assert torch.equal(two[key], tensor), key


def test_what_cannot_be_distributed_is_one_sentence():
    group = Group(rank=0, world_size=2)
    with pytest.raises(LowbitError, match="cannot share its calibration between processes"):
        quantize(tiny_model("llama"), get_recipe("rtn"), group=group, progress=False)
    with pytest.raises(LowbitError, match="1 calibration samples cannot be shared by 2 processes"):
        quantize(
            tiny_model("llama"), get_recipe("gptq"), calibration=CALIB[:1], group=group,
            progress=False,
        )  # fmt: skip
    with pytest.raises(LowbitError, match="cannot resume"):
        quantize(
            tiny_model("llama"), get_recipe("gptq"), calibration=CALIB, group=group,
            resume_dir="unused", progress=False,
        )  # fmt: skip


def test_without_torchrun_environment_distributed_is_refused(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(LowbitError, match="needs torchrun's environment"):
        quantize_to_directory(None, "gptq", tmp_path / "out", distributed=True)


def test_a_recipe_that_cannot_be_distributed_is_refused_before_joining_a_group(tmp_path):
    with pytest.raises(LowbitError, match="cannot share its calibration between processes"):
        quantize_to_directory(None, "rtn", tmp_path / "out", distributed=True)
