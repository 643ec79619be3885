"""The lm-eval bridge: lm-eval's model type lowbit on the offline pydoc cloze task."""

import os
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from lowbit.eval.harness import TASK_NAME, cloze_items, register, write_cloze_task  # noqa: E402
from lowbit.models.tiny import save_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_cloze_items_hold_the_answer_once():
    items = cloze_items(30, seed=1)
    assert len(items) == 30 and items == cloze_items(30, seed=1)
    for item in items:
        assert len(set(item["choices"])) == 4 and 0 <= item["label"] < 4


def _loglikelihoods(model, model_args, manager):
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK_NAME], task_manager=manager,
        log_samples=True, device="cpu", batch_size=4,
    )  # fmt: skip
    samples = out["samples"][TASK_NAME]
    return [r[0][0] for s in sorted(samples, key=lambda s: s["doc_id"]) for r in s["resps"]]


def test_float_model_through_the_bridge_equals_lm_evals_hf(tmp_path):
    save_tiny_model(tmp_path / "model")
    manager = TaskManager(include_path=str(write_cloze_task(tmp_path / "task", n_items=12)))
    register()
    ours = _loglikelihoods("lowbit", f"path={tmp_path / 'model'}", manager)
    theirs = _loglikelihoods("hf", f"pretrained={tmp_path / 'model'},dtype=float32", manager)
    assert len(ours) == 48
    # measured: equal to the last bit (max difference 0.0)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-4


def test_cli_runs_the_local_task_and_refuses_an_unknown_one(tmp_path):
    save_tiny_model(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = [sys.executable, "-m", "lowbit", "lm-eval", "--model", str(tmp_path / "model")]
    done = subprocess.run([*run, "--items", "8"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{TASK_NAME}: acc,none " in done.stdout
    bad = subprocess.run([*run, "--tasks", "nosuch"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "lowbit: error: lm-eval has no task nosuch" in bad.stderr
