"""``benchmarks/make_shaped_model.py``: random-weight Llamas of real shapes, written as Hugging
Face writes big models (bf16 shards + index), that lowbit loads as a float model directory."""

import json
import types

import pytest
import torch

from lowbit.errors import LowbitError


@pytest.fixture(scope="module")
def make(load_benchmark):
    return load_benchmark("make_shaped_model")


@pytest.mark.parametrize(
    "name, parameters",
    [("llama3-8b", 8_030_261_248), ("llama-1b", 906_037_248), ("smollm2-135m", 134_515_008)],
)
def test_the_shapes_are_the_models_they_are_named_after(make, name, parameters):
    from transformers import AutoModelForCausalLM

    ids = types.SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = make.llama_config(make.SHAPES[name], make.SHAPES[name].layers, ids)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == parameters  # Llama-3-8B: 8.03 B


def test_a_shaped_model_is_sharded_bf16_and_loads_as_a_float_model(make, tmp_path):
    from lowbit.models.loader import load_model

    out = tmp_path / "m"
    checksums = make.write_model(out, "smollm2-135m", layers=2, max_shard_size="10MB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    # the embedding (57 MB) alone, then two 7 MB blocks: one shard each side of 10 MB
    assert len(shards) == 3 and set(checksums) == {*shards, "model.safetensors.index.json"}
    assert "lm_head.weight" not in index["weight_map"]  # tied, as SmolLM2's
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["dtype"]) == (
        2,
        576,
        "bfloat16",
    )

    loaded = load_model(out, dtype=torch.bfloat16)  # the loader refuses a missing tensor
    weight = loaded.model.get_submodule("model.layers.1.mlp.down_proj").weight
    assert weight.dtype == torch.bfloat16 and 0.019 < weight.float().std() < 0.021
    ids = loaded.tokenizer("Hello, world", return_tensors="pt").input_ids
    assert torch.isfinite(loaded.model(ids).logits).all()

    with pytest.raises(LowbitError, match="not empty"):
        make.write_model(out, "smollm2-135m", layers=1)
    make.write_model(out, "smollm2-135m", layers=1, seed=1, force=True)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert (out / "model.safetensors").is_file()  # 64 MB: one shard of the default 1GB
