"""Helpers shared by the benchmark scripts: machine description, markdown tables, data paths."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

#: the WikiText-2 raw test split beside the repository (``../shared/data``)
WIKITEXT = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"


def add_window_arguments(parser, *, windows: int = 8, seqlen: int = 2048):
    """The evaluation arguments most benchmarks share: ``--dataset`` (WikiText-2 test beside the
    repository), ``--windows``, ``--seqlen`` and ``--threads`` (2, this machine's cores)."""
    parser.add_argument("--dataset", default=str(WIKITEXT))
    parser.add_argument("--windows", type=int, default=windows)
    parser.add_argument("--seqlen", type=int, default=seqlen)
    parser.add_argument("--threads", type=int, default=2)


def weight_calibrations(tokenizer, wiki_tokens, samples: int, seqlen: int) -> dict:
    """``{"wiki", "pydoc": [samples, seqlen] token ids}``: the weight-calibration sets of the GPTQ
    and QuaRot tables, from WikiText-2 windows >= 16 (never the evaluated ones) and from the
    pydoc calibration text, both drawn with seed 0."""
    from lowbit.data import calibration_samples, load_corpus, tokenize

    pydoc = tokenize(tokenizer, load_corpus("pydoc", part="calibration").text)
    return {
        "wiki": calibration_samples(wiki_tokens, samples, seqlen, seed=0, skip_windows=16),
        "pydoc": calibration_samples(pydoc, samples, seqlen, seed=0),
    }


def machine() -> str:
    """'<CPU model>, <n> threads used of <m> cores, torch <version>'."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {torch.get_num_threads()} threads of {os.cpu_count()} cores, "
        f"torch {torch.__version__}"
    )


def command_line() -> str:
    """How this script was run, quoted so it can be pasted back into a shell."""
    import shlex
    import sys

    return "python " + shlex.join(sys.argv)


def stamp(command: str) -> str:
    """The line printed above every table: date, machine, and the command that made it."""
    return f"Measured {datetime.date.today().isoformat()} on {machine()} with `{command}`."


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


class PeakRSS:
    """Peak resident memory of this process while the block runs (Linux), sampled every 20 ms.

    ``with PeakRSS() as peak: ...`` then ``peak.mb`` (whole process, model included) and
    ``peak.extra_mb`` (above what was resident when the block started).
    """

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.mb = self.start_mb = 0.0

    @staticmethod
    def _rss_mb() -> float:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def __enter__(self):
        import threading

        self.start_mb = self.mb = self._rss_mb()
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(self.interval):
                self.mb = max(self.mb, self._rss_mb())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.mb = max(self.mb, self._rss_mb())

    @property
    def extra_mb(self) -> float:
        return self.mb - self.start_mb
