"""lowbit.eval.streamed: a saved model against its float model layer-major, the in-memory
numbers (bit for bit when a window's head runs in one chunk), one float block in memory."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.eval import streamed as eval_streamed
from lowbit.eval.evaluate import FloatReference, evaluate
from lowbit.eval.run import evaluate_recipes, use_backend
from lowbit.eval.streamed import evaluate_streamed
from lowbit.io.checkpoint import load, save
from lowbit.models.run import prepare_run
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
IDS = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(1))  # [N, S]


def _pair(root, family, recipe="rtn", **config):
    """A tiny float directory and its saved quantized checkpoint (run in bf16)."""
    (root / "float").mkdir(parents=True)
    tiny_model(family, **config).save_pretrained(root / "float")
    model = quantize(tiny_model(family, **config), recipe, packed=True, progress=False)
    save(model, root / "q")
    return root / "q", root / "float"


def _in_memory(checkpoint, reference):
    """What `lowbit eval` computes in memory: lowbit.eval.evaluate on the loaded models."""
    float_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    model = load(checkpoint)
    use_backend(model, "auto")
    prepare_run(model)
    return evaluate(model, IDS, reference=FloatReference(float_model), progress=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_equals_in_memory_bit_for_bit_with_whole_window_heads(tmp_path, family):
    checkpoint, reference = _pair(tmp_path, family)
    expected = _in_memory(checkpoint, reference)
    got, _ = evaluate_streamed(checkpoint, reference, IDS, chunk=IDS.shape[1], progress=False)
    assert (got.ppl, got.kl, got.top1) == (expected.ppl, expected.kl, expected.top1)


def test_chunked_heads_agree_to_rounding_and_one_float_block_is_in_memory(tmp_path, monkeypatch):
    """Chunks of 7 tokens: the same log-probabilities, summed in another order."""
    checkpoint, reference = _pair(tmp_path, "qwen2", num_hidden_layers=3)
    loads = []
    load_block = eval_streamed._FloatBlocks.load

    def load_one(self, index):
        for block in self.streamed.blocks:
            assert {t.device.type for t in block.parameters()} == {"meta"}
        loads.append(index)
        load_block(self, index)

    monkeypatch.setattr(eval_streamed._FloatBlocks, "load", load_one)
    expected = _in_memory(checkpoint, reference)
    got, _ = evaluate_streamed(checkpoint, reference, IDS, chunk=7, progress=False)
    assert loads == [0, 1, 2]
    assert got.ppl == pytest.approx(expected.ppl, rel=1e-6)
    # KL sums small terms of both signs in float32 (as in memory): measured 1.4e-5 relative
    assert got.kl == pytest.approx(expected.kl, rel=1e-4)
    assert got.top1 == expected.top1


@pytest.fixture(scope="module")
def saved_tiny(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a tokenizer, quantized and saved."""
    from lowbit.models.tiny import tiny_tokenizer

    out = tmp_path_factory.mktemp("saved") / "q"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    save(quantize(model, get_recipe("rtn", w_group=32), packed=True, progress=False), out,
         tokenizer=tiny_tokenizer())  # fmt: skip
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lowbit.data import pydoc_text

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(pydoc_text("eval")[:8000])
    return str(path)


def test_evaluate_recipes_streams_to_the_in_memory_row(saved_tiny, tiny_model_dir, corpus):
    common = dict(reference=tiny_model_dir, dataset=corpus, seqlen=64, windows=2, progress=False)
    (memory,) = evaluate_recipes(saved_tiny, ["fp"], stream=False, **common)
    (streamed,) = evaluate_recipes(saved_tiny, ["fp"], stream=True, **common)
    assert not memory["streamed"] and streamed["streamed"]
    for key in ("tokens", "top1", "bits_per_weight", "model_bytes", "kv_bytes_per_token", "dtype"):
        assert streamed[key] == memory[key], key
    assert streamed["ppl"] == pytest.approx(memory["ppl"], rel=1e-6)
    assert streamed["kl"] == pytest.approx(memory["kl"], rel=1e-4)


def test_the_command_streams_in_a_real_process(saved_tiny, tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", "eval", "--model", str(saved_tiny), "--reference",
         str(tiny_model_dir), "--stream", "--dataset", corpus, "--seqlen", "64", "--windows",
         "2", "--no-progress", "--json", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())  # one row: an object
    assert row["streamed"] and row["label"] == "rtn (saved, streamed)" and 0 < row["kl"]
    assert "rtn (saved, streamed)" in proc.stdout


def test_what_cannot_stream_is_one_sentence(saved_tiny, tiny_model_dir, corpus, tmp_path):
    common = dict(dataset=corpus, seqlen=64, windows=1, progress=False, stream=True)
    with pytest.raises(LowbitError, match=r"^--stream evaluates a lowbit checkpoint"):
        evaluate_recipes(tiny_model_dir, ["fp"], reference=tiny_model_dir, **common)
    with pytest.raises(LowbitError, match=r"^--chunk feeds a KV cache"):
        evaluate_recipes(saved_tiny, ["fp"], reference=tiny_model_dir, chunk=16, **common)
    kv = tmp_path / "kv"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    save(quantize(model, get_recipe("kv-int"), progress=False), kv)
    with pytest.raises(LowbitError, match=r"^streamed evaluation .* quantized KV cache") as err:
        evaluate_recipes(kv, ["fp"], reference=tiny_model_dir, **common)
    assert "\n" not in str(err.value)


def test_eval_streams_by_itself_when_both_models_would_not_fit(
    saved_tiny, tiny_model_dir, corpus, monkeypatch
):
    from lowbit.eval.streamed import EvalMemoryEstimate, eval_memory_estimate
    from lowbit.io import stream as io_stream

    estimate = eval_memory_estimate(tiny_model_dir, saved_tiny, 1, 64)
    assert 0 < estimate.streamed and 0 < estimate.in_memory
    monkeypatch.setattr(eval_streamed, "eval_memory_estimate", lambda *a: EvalMemoryEstimate(10, 5))
    common = dict(reference=tiny_model_dir, dataset=corpus, seqlen=64, windows=1, progress=False)
    for available, streamed in ((10, False), (9, True)):
        monkeypatch.setattr(io_stream, "available_memory", lambda a=available: a)
        (row,) = evaluate_recipes(saved_tiny, ["fp"], **common)
        assert row["streamed"] is streamed
    monkeypatch.setattr(io_stream, "available_memory", lambda: 4)
    with pytest.raises(LowbitError, match=r"^evaluating this model streamed needs about"):
        evaluate_recipes(saved_tiny, ["fp"], **common)
