"""The README's quickstart and Python example run as written (on the embedded model); its GGUF
block runs in tests/test_readme_gguf.py, a file of its own so that the two run side by side."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from readme_blocks import blocks, commands, run_as_written  # noqa: E402


def test_the_readme_has_a_quickstart_a_gguf_block_and_a_python_example():
    quickstart, gguf = (commands(block) for block in blocks("bash"))
    assert [c[1] for c in quickstart] == ["quantize", "eval", "generate", "export"]
    assert [c[1] for c in gguf] == ["export", "eval"] and "gguf" in gguf[0]
    assert len(blocks("python")) == 1


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path):
    for command in commands(blocks("bash")[0]):
        run_as_written(command, tmp_path)
    assert (tmp_path / "smollm2-w4" / "config.json").is_file()
    assert (tmp_path / "smollm2-w4-ct" / "config.json").is_file()


@pytest.mark.slow
def test_the_python_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks("python")[0], "README.md", "exec"), namespace)
    model = namespace["model"]
    assert model.lowbit_recipe.method == "rtn"
    assert (tmp_path / "smollm2-w4-rtn" / "config.json").is_file()
