"""The README's quickstart and Python example run as written (on the embedded model)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _quickstart_commands() -> list[list[str]]:
    """The ``lowbit ...`` lines of the README's bash blocks, comments stripped."""
    commands = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("lowbit "):
                commands.append(shlex.split(line))
    return commands


def test_the_readme_has_a_quickstart_and_a_python_example():
    commands = [c[1] for c in _quickstart_commands()]
    assert commands[:4] == ["quantize", "eval", "generate", "export"]
    assert len(_blocks("python")) == 1


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path):
    lowbit = [sys.executable, "-m", "lowbit"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None  # `make gguf`
    for command in _quickstart_commands():
        if "--engine" in command and not has_llama_cpp:
            continue  # the GGUF file is still written (checked below)
        result = subprocess.run(
            lowbit + command[1:], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stderr[-2000:]}"
    assert (tmp_path / "smollm2-w4" / "config.json").is_file()
    assert (tmp_path / "smollm2-w4-ct" / "config.json").is_file()
    assert (tmp_path / "smollm2-q4_k_m.gguf").read_bytes()[:4] == b"GGUF"


@pytest.mark.slow
def test_the_python_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(_blocks("python")[0], str(README), "exec"), namespace)
    model = namespace["model"]
    assert model.lowbit_recipe.method == "rtn"
    assert (tmp_path / "smollm2-w4-rtn" / "config.json").is_file()
