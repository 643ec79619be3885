"""Corpora for calibration and evaluation, and the windowing protocol.

Corpora:
- ``pydoc``: the English documentation text that ships with every CPython
  (``pydoc_data.topics``). Fixed split rule: the topic names are sorted; topic number i
  (0-based) belongs to the *evaluation* part when ``i % 4 == 3`` and to the *calibration* part
  otherwise. The two parts never share a topic. Topics are joined with a blank line. The text
  differs slightly between CPython versions, so numbers on it name the Python version.
- ``wikitext2``: the WikiText-2 raw test split through the ``datasets`` library (online or from
  its cache); rows joined with ``"\\n\\n"`` as in the GPTQ evaluation code. For a local file such
  as ``wiki.test.raw`` pass its path instead.
- any local text file (UTF-8). ``\\r\\n`` is read as ``\\n``.

Protocol: join, tokenize once (no BOS or other special tokens added), cut into
non-overlapping windows of ``seqlen`` tokens, optionally keep only the first N. Calibration
samples are windows of ``seqlen`` tokens starting at random offsets drawn with a fixed seed,
after skipping the first ``skip_windows`` windows of the corpus (so they never overlap
evaluated windows of the same text).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.files import is_dir, is_file, read_bytes

PYDOC_EVAL_EVERY = 4  # topic i is evaluation text when i % 4 == 3
CORPUS_NAMES = ("pydoc", "wikitext2")


@dataclass(frozen=True)
class Corpus:
    name: str  # what to print: "pydoc/eval (CPython 3.11.7)", a file path, ...
    text: str


def pydoc_text(part: str) -> str:
    """The calibration or evaluation part of CPython's pydoc topics (see module docstring)."""
    from pydoc_data.topics import topics

    if part not in ("calibration", "eval"):
        raise LowbitError(f"pydoc part must be 'calibration' or 'eval', not {part!r}")
    names = sorted(topics)
    keep_eval = part == "eval"
    chosen = [
        topics[name]
        for i, name in enumerate(names)
        if (i % PYDOC_EVAL_EVERY == PYDOC_EVAL_EVERY - 1) == keep_eval
    ]
    return "\n\n".join(chosen)


def _read_text_file(path: Path) -> str:
    if not is_file(path, "dataset file") and not is_dir(path, "dataset file"):
        raise LowbitError(f"dataset file {path} does not exist")
    if not is_file(path):
        raise LowbitError(f"dataset {path} is not a file")
    raw = read_bytes(path, "dataset file")
    if b"\x00" in raw[:65536]:
        raise LowbitError(f"dataset file {path} is not text (it contains NUL bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LowbitError(f"dataset file {path} is not UTF-8 text ({err.reason})") from err
    return text.replace("\r\n", "\n")


def _wikitext2_from_datasets() -> str:
    try:
        import datasets
    except ImportError as err:
        raise LowbitError(
            "the wikitext2 corpus needs the `datasets` package (pip install datasets), "
            "or pass the path of a local wiki.test.raw file instead"
        ) from err
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    except Exception as err:  # offline and uncached: datasets raises several types
        raise LowbitError(
            "could not load wikitext2 through `datasets` (offline and not cached?); "
            "pass the path of a local wiki.test.raw file instead"
        ) from err
    return "\n\n".join(rows)


def load_corpus(spec: str, part: str = "eval") -> Corpus:
    """Load a corpus by name or path.

    Args:
        spec: "pydoc", "wikitext2" or a path to a UTF-8 text file.
        part: for pydoc, "eval" or "calibration"; ignored otherwise (files are used whole and
            the caller keeps calibration and evaluation apart with ``skip_windows``).
    """
    if spec == "pydoc":
        version = ".".join(map(str, sys.version_info[:3]))
        corpus = Corpus(f"pydoc/{part} (CPython {version})", pydoc_text(part))
    elif spec == "wikitext2":
        corpus = Corpus("wikitext2 (datasets, test)", _wikitext2_from_datasets())
    else:
        corpus = Corpus(str(spec), _read_text_file(Path(spec).expanduser()))
    if not corpus.text.strip():
        raise LowbitError(f"corpus {corpus.name} is empty")
    return corpus


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Tokenize a whole text once, without special tokens: [n_tokens] long."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids[0]


def eval_windows(tokens: torch.Tensor, seqlen: int, n_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows: [n_tokens] -> [N, seqlen]; the tail shorter than seqlen is dropped."""
    if seqlen < 2:
        raise LowbitError(f"--seqlen must be at least 2, not {seqlen}")
    available = tokens.numel() // seqlen
    if available == 0:
        raise LowbitError(f"--seqlen {seqlen} is longer than the corpus ({tokens.numel()} tokens)")
    if n_windows is not None:
        if n_windows < 1:
            raise LowbitError(f"--windows must be at least 1, not {n_windows}")
        if n_windows > available:
            raise LowbitError(
                f"--windows {n_windows} asks for more than the corpus holds "
                f"({available} windows of {seqlen} tokens)"
            )
        available = n_windows
    return tokens[: available * seqlen].view(available, seqlen)


def calibration_samples(
    tokens: torch.Tensor,
    n_samples: int,
    seqlen: int,
    *,
    seed: int = 0,
    skip_windows: int = 0,
) -> torch.Tensor:
    """Random windows for calibration: [n_tokens] -> [n_samples, seqlen].

    Offsets are drawn uniformly (fixed ``seed``) from the part of the stream after the first
    ``skip_windows * seqlen`` tokens, so they never touch the evaluated windows of that text.
    """
    start = skip_windows * seqlen
    usable = tokens.numel() - start
    if n_samples < 1:
        raise LowbitError(f"the number of calibration samples must be at least 1, not {n_samples}")
    if usable < seqlen:
        raise LowbitError(
            f"the calibration corpus is too short: {tokens.numel()} tokens, {start} skipped, "
            f"need at least {seqlen} more for one sample of {seqlen} tokens"
        )
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, usable - seqlen + 1, (n_samples,), generator=generator) + start
    return torch.stack([tokens[o : o + seqlen] for o in offsets.tolist()])
