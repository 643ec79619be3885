import pytest
import torch

from lowbit.data import (
    calibration_samples,
    eval_windows,
    load_corpus,
    pydoc_text,
    tokenize,
)
from lowbit.errors import LowbitError


def test_pydoc_split_is_disjoint_and_complete():
    from pydoc_data.topics import topics

    calibration, evaluation = pydoc_text("calibration"), pydoc_text("eval")
    names = sorted(topics)
    for i, name in enumerate(names):
        in_eval = topics[name] in evaluation
        assert in_eval == (i % 4 == 3), name
        if not in_eval:
            assert topics[name] in calibration
    # every topic's text is in exactly one part: lengths add up (parts joined by blank lines)
    n_eval = len(names) // 4
    n_calibration = len(names) - n_eval
    total = sum(len(t) for t in topics.values())
    assert len(calibration) + len(evaluation) == total + 2 * (n_calibration - 1 + n_eval - 1)


def test_eval_windows_cut_non_overlapping():
    tokens = torch.arange(103)
    windows = eval_windows(tokens, 10)
    assert windows.shape == (10, 10)
    assert windows[3].tolist() == list(range(30, 40))
    assert eval_windows(tokens, 10, 2).shape == (2, 10)


def test_calibration_samples_are_seeded_and_skip_evaluated_windows():
    tokens = torch.arange(1000)
    a = calibration_samples(tokens, 8, 50, seed=3, skip_windows=4)
    b = calibration_samples(tokens, 8, 50, seed=3, skip_windows=4)
    c = calibration_samples(tokens, 8, 50, seed=4, skip_windows=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= 200  # the first 4 windows of 50 tokens are never touched
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(8, 49, dtype=torch.long))  # contiguous


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: eval_windows(torch.arange(10), 20), "longer than the corpus"),
        (lambda: eval_windows(torch.arange(100), 10, 11), "more than the corpus holds"),
        (lambda: eval_windows(torch.arange(100), 10, 0), "at least 1"),
        (lambda: calibration_samples(torch.arange(100), 2, 50, skip_windows=2), "too short"),
    ],
)
def test_window_errors(call, message):
    with pytest.raises(LowbitError, match=message):
        call()


def test_corpus_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(b"line one\r\nline two\r\n")
    assert load_corpus(str(text)).text == "line one\nline two\n"
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(LowbitError, match="empty"):
        load_corpus(str(empty))
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\x00\x01\x02")
    with pytest.raises(LowbitError, match="not text"):
        load_corpus(str(binary))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(LowbitError, match="not UTF-8"):
        load_corpus(str(latin))
    with pytest.raises(LowbitError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))


def test_tokenize_adds_no_special_tokens():
    from lowbit.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    ids = tokenize(tokenizer, "hello world")
    assert ids.ndim == 1
    assert tokenizer.bos_token_id not in ids.tolist()
    assert tokenizer.decode(ids) == "hello world"
