"""``lowbit eval --engine llama.cpp``: llama.cpp's own logits on lowbit's windows."""

import math
import subprocess
import sys

import pytest
import torch

from lowbit.api import quantize
from lowbit.eval.evaluate import FloatReference, evaluate
from lowbit.io.gguf import export_gguf
from lowbit.models.tiny import save_tiny_model
from lowbit.recipes.registry import get_recipe

pytest.importorskip("llama_cpp")

SHAPE = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny llama directory, and its float and Q4_0 files."""
    from lowbit.models.loader import load_model

    root = tmp_path_factory.mktemp("engine")
    save_tiny_model(root / "tiny", "llama", **SHAPE)
    loaded = load_model(str(root / "tiny"))
    export_gguf(loaded.model, root / "float.gguf", tokenizer=loaded.tokenizer)
    quantize(loaded.model, get_recipe("gguf", gguf_type="Q4_0", w_algo="rtn"), progress=False)
    export_gguf(loaded.model, root / "q4_0.gguf", tokenizer=loaded.tokenizer)
    return root


def test_llama_cpp_float_file_matches_the_float_model(exported):
    from lowbit.eval.llama_cpp import LlamaCppModel
    from lowbit.models.loader import load_model

    model = load_model(str(exported / "tiny")).model
    windows = torch.randint(3, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = FloatReference(model)
    result = evaluate(LlamaCppModel(exported / "float.gguf", n_ctx=32, threads=1), windows,
                      reference=reference, progress=False)  # fmt: skip
    assert result.kl < 1e-6 and result.top1 == 1.0  # F32 weights: rounding differences only
    quantized = evaluate(LlamaCppModel(exported / "q4_0.gguf", n_ctx=32, threads=1), windows,
                         reference=reference, progress=False)  # fmt: skip
    assert quantized.kl > 100 * result.kl  # the Q4_0 file is really another model


def test_cli_evaluates_a_gguf_file_against_its_float_model(exported):
    command = [sys.executable, "-m", "lowbit", "eval", "--engine", "llama.cpp", "--model",
               str(exported / "q4_0.gguf"), "--reference", str(exported / "tiny"),
               "--seqlen", "32", "--windows", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "(llama.cpp)" in x)
    ppl, kl = float(line.split()[2]), float(line.split()[3])
    assert math.isfinite(ppl) and kl > 0


def test_cli_refuses_a_recipe_with_the_llama_cpp_engine(exported):
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", "eval", "--engine", "llama.cpp", "--model",
         str(exported / "q4_0.gguf"), "--recipe", "rtn"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert (
        proc.returncode == 2 and "drop --recipe" in proc.stderr and "Traceback" not in proc.stderr
    )


@pytest.mark.slow
def test_cli_refuses_a_file_of_another_vocabulary_than_the_reference(exported):
    """Issue 50: the tiny file against the default reference (the embedded model, another
    vocabulary) was `RuntimeError: llama_decode returned -1`; now one sentence, before any
    window runs."""
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit", "eval", "--engine", "llama.cpp", "--model",
         str(exported / "q4_0.gguf"), "--seqlen", "32", "--windows", "1", "--no-progress"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "has a vocabulary of" in proc.stderr and "pass --reference" in proc.stderr
