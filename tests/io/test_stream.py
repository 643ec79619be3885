"""Streamed quantization (lowbit.io.stream, lowbit.quantize_to_directory): the same packed bits
as the in-memory path, never more than one block in memory, refusals before any work."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import lowbit
from lowbit.api import _prepare, quantize, quantize_to_directory
from lowbit.errors import LowbitError
from lowbit.io import stream as io_stream
from lowbit.io.checkpoint import checkpoint_tensors, describe, stored_form
from lowbit.io.stream import open_streamed, quantize_blocks
from lowbit.models.float_weights import FloatWeights
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

CALIB = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(5))
IDS = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(6))
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
RECIPES = {
    "rtn-w4a8": ("rtn", dict(w_bits=4, w_group=32, a_bits=8)),
    "gptq": ("gptq", dict(w_bits=4, w_group=32)),
}


def _save(directory: Path, family: str, dtype=torch.float32, **config) -> Path:
    tiny_model(family, **config).to(dtype).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {f: _save(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def _both_paths(directory: Path, recipe, calibration=CALIB, run=torch.bfloat16):
    """(in-memory checkpoint tensors and specs, the streamed ones), saved to run in ``run``."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = quantize(model, copy.deepcopy(recipe), calibration=calibration, packed=True,
                     progress=False)  # fmt: skip
    streamed = open_streamed(directory, torch.float32)
    prepared, context = _prepare(
        streamed.model, copy.deepcopy(recipe), calibration, None, None, False, None, None, None
    )
    written: dict[str, torch.Tensor] = {}

    def add(tensors):
        assert not set(tensors) & set(written), "a tensor written twice"
        written.update(tensors)

    loaded = []
    load = streamed.load

    def load_one(index):  # every other block stays on the meta device: one block in memory
        for block in streamed.blocks:
            assert {t.device.type for t in [*block.parameters(), *block.buffers()]} == {"meta"}
        loaded.append(index)
        load(index)

    streamed.load = load_one
    quantize_blocks(streamed, prepared, context, add, run)
    assert loaded == list(range(streamed.adapter.num_layers))
    in_memory = (checkpoint_tensors(model, run=run), describe(model)["modules"])
    return in_memory, (written, streamed.specs)


def _assert_identical(expected, got):
    (ref_tensors, ref_specs), (tensors, specs) = expected, got
    assert sorted(tensors) == sorted(ref_tensors)
    for key, tensor in ref_tensors.items():
        assert tensors[key].dtype == tensor.dtype, key
        assert torch.equal(tensors[key], tensor), key
    assert specs == ref_specs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_streamed_checkpoint_tensors_equal_the_in_memory_ones_bit_for_bit(model_dirs, family, name):
    method, settings = RECIPES[name]
    _assert_identical(*_both_paths(model_dirs[family], get_recipe(method, **settings)))


@pytest.mark.parametrize(
    "method, settings",
    [("spqr", {}), ("mixed", {"w_algo": "rtn"}), ("gptq", {"w_bits": 3, "act_order": False})],
)
def test_other_weight_formats_stream_to_the_same_bits(tmp_path, method, settings):
    directory = _save(tmp_path / "m", "llama", num_hidden_layers=1)
    _assert_identical(*_both_paths(directory, get_recipe(method, **settings)))


def test_a_bf16_source_calibrated_in_float32_streams_to_the_same_bits(tmp_path):
    directory = _save(tmp_path / "m", "qwen3", dtype=torch.bfloat16, num_hidden_layers=1)
    expected, got = _both_paths(directory, get_recipe("gptq", w_group=32))
    _assert_identical(expected, got)
    # its untouched float parameters are stored in bf16, the dtype it runs in (exactly its
    # source's numbers), not in the float32 they were calibrated in
    source = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    for key in ("model.embed_tokens.weight", "model.norm.weight",
                "model.layers.0.input_layernorm.weight"):  # fmt: skip
        assert got[0][key].dtype == torch.bfloat16, key
        assert torch.equal(got[0][key], source.state_dict()[key]), key
    # saved to run in float32, every float tensor stays float32
    expected, got = _both_paths(directory, get_recipe("gptq", w_group=32), run=torch.float32)
    _assert_identical(expected, got)
    assert got[0]["model.embed_tokens.weight"].dtype == torch.float32


def test_a_float_parameter_is_stored_in_the_run_dtype_only_where_that_loses_nothing():
    exact = torch.randn(5, 7).bfloat16().float()  # float32 holding bf16 values
    assert stored_form(exact, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(stored_form(exact, torch.bfloat16).float(), exact)
    inexact = exact.clone()
    inexact[4, 6] += 2**-20  # one value bf16 cannot hold
    assert stored_form(inexact, torch.bfloat16) is inexact
    assert stored_form(exact, torch.float32) is exact and stored_form(exact, None) is exact
    assert stored_form(exact.bfloat16(), torch.float16).dtype == torch.bfloat16  # not float32
    big = torch.full((1 << 23,), 1.5)  # compared in chunks of 4M values; the last one is off
    big[-1] = 1.0 + 2**-20
    assert stored_form(big, torch.bfloat16) is big


def test_a_sharded_source_reads_as_the_single_file(tmp_path):
    single = _save(tmp_path / "single", "llama")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    a, b = (
        open_streamed(single, torch.float32).weights,
        open_streamed(sharded, torch.float32).weights,
    )
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
        assert torch.equal(a.get(key), b.get(key)), key
    _assert_identical(*_both_paths(sharded, get_recipe("rtn", w_group=32)))


def test_a_tied_tensor_stored_under_its_other_key_streams(tmp_path):
    """lowbit's GGUF cache (the embedded model) holds the tied embedding as lm_head.weight."""
    from safetensors.torch import load_file

    directory = _save(tmp_path / "m", "llama")
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _assert_identical(*_both_paths(directory, get_recipe("gptq", w_group=32)))


def test_damaged_sources_are_one_sentence(tmp_path):
    directory = _save(tmp_path / "m", "llama")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(LowbitError, match="does not fit the file"):
        open_streamed(directory, torch.float32)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(weights))
    with pytest.raises(LowbitError, match="shape|lack"):
        open_streamed(directory, torch.float32)


def test_recipes_that_cannot_stream_are_refused_before_any_work(model_dirs, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(LowbitError) as caught:
        quantize_to_directory(model_dirs["llama"], "quarot", out, calibration=CALIB, stream=True)
    message = str(caught.value)
    assert "cannot quantize block by block" in message and message.count(" GB") == 2
    assert not out.exists()
    with pytest.raises(LowbitError, match="safetensors weights; the embedded model is not one"):
        quantize_to_directory(None, "rtn", out, stream=True)


def test_a_run_that_would_not_fit_is_refused_with_both_numbers(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(io_stream, "available_memory", lambda: 10**6)
    with pytest.raises(LowbitError, match=r"needs about \d+\.\d GB .* has 0\.0 GB available"):
        quantize_to_directory(model_dirs["llama"], "rtn", tmp_path / "out", stream=True)
    assert not (tmp_path / "out").exists()


def test_streams_by_itself_when_the_model_would_not_fit_in_memory(
    model_dirs, tmp_path, monkeypatch
):
    estimate = io_stream.MemoryEstimate(parameters=1, in_memory=10**10, streamed=10**6)
    monkeypatch.setattr(io_stream, "memory_estimate", lambda *args, **kwargs: estimate)
    monkeypatch.setattr(io_stream, "available_memory", lambda: 10**9)
    result = quantize_to_directory(model_dirs["llama"], "w4a16", tmp_path / "out", progress=False)
    assert result.streamed and result.model is None
    assert 4 < result.bits_per_weight < 4.5
    assert lowbit.load(tmp_path / "out").lowbit_recipe.to_dict() == result.recipe.to_dict()


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_a_streamed_checkpoint_loads_in_another_process_as_the_in_memory_model(
    tmp_path, source_dtype
):
    """`lowbit quantize --stream` in one process (shards forced), `lowbit.load` in this one: the
    logits of the in-memory quantized model, exactly (a bf16 source's float tensors are stored
    in bf16 and read back as the same float32 numbers)."""
    directory = _save(tmp_path / "m", "qwen2", dtype=source_dtype)
    out = tmp_path / "streamed"
    run = subprocess.run(
        [sys.executable, "-m", "lowbit", "quantize", "--model", str(directory), "--recipe",
         "rtn", "--set", "w_group=32", "--set", "a_bits=8", "--stream", "--no-progress",
         "--max-shard-size", "60KB", "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "streamed block by block" in run.stdout
    assert len(list(out.glob("model-*.safetensors"))) > 1
    loaded = lowbit.load(out, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    lowbit.quantize(model, get_recipe("rtn", w_group=32, a_bits=8), progress=False)
    assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    stored = FloatWeights(out).dtype("model.embed_tokens.weight")
    assert stored == (torch.bfloat16 if source_dtype == torch.bfloat16 else torch.float32)


def test_an_interrupted_streamed_gptq_run_resumes_to_the_same_bytes(
    model_dirs, tmp_path, monkeypatch, capsys
):
    directory = model_dirs["mistral"]
    recipe = get_recipe("gptq", w_group=32)
    whole = quantize_to_directory(
        directory, copy.deepcopy(recipe), tmp_path / "whole", calibration=CALIB, stream=True,
        progress=False,
    )  # fmt: skip
    original = io_stream.StreamedModel.load

    def killed_at_block_1(self, index):
        if index == 1:
            raise KeyboardInterrupt  # as a SIGINT would, after block 0 was checkpointed
        original(self, index)

    monkeypatch.setattr(io_stream.StreamedModel, "load", killed_at_block_1)
    resume = tmp_path / "resume"
    with pytest.raises(KeyboardInterrupt):
        quantize_to_directory(
            directory, copy.deepcopy(recipe), tmp_path / "out", calibration=CALIB, stream=True,
            resume_dir=resume, progress=False,
        )  # fmt: skip
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in resume.glob("block-*.json")) == ["block-0000.json"]
    monkeypatch.setattr(io_stream.StreamedModel, "load", original)
    quantize_to_directory(
        directory, copy.deepcopy(recipe), tmp_path / "out", calibration=CALIB, stream=True,
        resume_dir=resume, progress=False,
    )  # fmt: skip
    assert "1 of 2 blocks were calibrated by an earlier run" in capsys.readouterr().err
    name = "model.safetensors"
    assert (tmp_path / "out" / name).read_bytes() == (whole.directory / name).read_bytes()


@pytest.mark.slow
def test_the_embedded_model_streams_to_the_in_memory_checkpoint_byte_for_byte(tmp_path):
    """SmolLM2-135M (its safetensors conversion in lowbit's cache), GPTQ W4 g64: the streamed
    checkpoint's weights file is the in-memory one's, byte for byte."""
    from lowbit.models.loader import _gguf_cache_dir, embedded_gguf_path, load_model

    load_model(None)  # converts the GGUF once into the cache
    directory = _gguf_cache_dir(embedded_gguf_path())
    calibration = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(7))
    recipe = get_recipe("w4a16-g64-gptq")
    files = {}
    for stream in (False, True):
        out = tmp_path / f"stream-{stream}"
        result = quantize_to_directory(
            directory, copy.deepcopy(recipe), out, calibration=calibration, stream=stream,
            progress=False,
        )  # fmt: skip
        assert result.streamed is stream
        files[stream] = (out / "model.safetensors").read_bytes()
    assert files[True] == files[False]
