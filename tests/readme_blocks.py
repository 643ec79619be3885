"""The README's code blocks, as the tests that run them read them."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of ``language``, in order."""
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def commands(block: str) -> list[list[str]]:
    """The ``lowbit ...`` lines of a bash block, comments stripped."""
    found = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("lowbit "):
            found.append(shlex.split(line))
    return found


def run_as_written(command: list[str], cwd: Path) -> None:
    """Run a README line (``lowbit`` as ``python -m lowbit`` of this checkout) in ``cwd``; fail
    with its stderr's tail unless it exits 0."""
    env = {**os.environ, "PYTHONPATH": str(README.parent / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "lowbit", *command[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stderr[-2000:]}"
