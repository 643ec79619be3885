"""The README's GGUF block runs as written: the export, and llama.cpp's evaluation of the file
where llama.cpp is installed (`make gguf`; without it the file is still written and checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from readme_blocks import blocks, commands, run_as_written  # noqa: E402


@pytest.mark.slow
def test_the_gguf_block_runs_as_written(tmp_path):
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    for command in commands(blocks("bash")[1]):
        if "--engine" in command and not has_llama_cpp:
            continue
        run_as_written(command, tmp_path)
    assert (tmp_path / "smollm2-q4_k_m.gguf").read_bytes()[:4] == b"GGUF"
