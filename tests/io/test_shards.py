"""Sharded checkpoints: ShardWriter's files, a sharded save that loads (in another process) as
the single-file save does, and damaged or edited shards refused with one sentence."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowbit.api import quantize
from lowbit.checksum import file_sha256
from lowbit.errors import LowbitError
from lowbit.io import format as io_format
from lowbit.io.checkpoint import checkpoint_tensors, load, save
from lowbit.io.shards import INDEX_NAME, ShardWriter, parse_size, read_weight_map
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

IDS = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(7))


# -- ShardWriter -----------------------------------------------------------------------------------
def _tensors(count: int, numel: int = 250) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(count)
    return {f"t.{i:02d}": torch.randn(numel, generator=gen) for i in range(count)}  # 1000 B each


def test_shards_are_bounded_named_and_indexed(tmp_path):
    tensors = _tensors(7)
    writer = ShardWriter(tmp_path, max_shard_bytes=2500)  # two 1000-byte tensors per shard
    writer.add(dict(list(tensors.items())[:3]))
    writer.add(dict(list(tensors.items())[3:]))
    checksums = writer.close()
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, INDEX_NAME])
    assert checksums == {name: file_sha256(tmp_path / name) for name in [*names, INDEX_NAME]}
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"] == {"total_size": 7000}
    assert read_weight_map(tmp_path) == index["weight_map"]
    for key, name in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / name)[key], tensors[key])
    assert [len(load_file(tmp_path / n)) for n in names] == [2, 2, 2, 1]  # in the order given
    with safe_open(str(tmp_path / names[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_one_shard_is_what_save_file_writes_and_large_tensors_get_their_own(tmp_path):
    tensors = {"a": torch.arange(12.0).reshape(3, 4).t(), "b": torch.ones(3, dtype=torch.int8)}
    (tmp_path / "one").mkdir()
    writer = ShardWriter(tmp_path / "one")
    writer.add(tensors)  # a transposed (non-contiguous) tensor is stored contiguous
    assert writer.close() == {"model.safetensors": file_sha256(tmp_path / "one/model.safetensors")}
    contiguous = {k: t.contiguous() for k, t in tensors.items()}
    save_file(contiguous, tmp_path / "direct.safetensors", metadata={"format": "pt"})
    one = (tmp_path / "one" / "model.safetensors").read_bytes()
    assert one == (tmp_path / "direct.safetensors").read_bytes()

    (tmp_path / "big").mkdir()
    writer = ShardWriter(tmp_path / "big", max_shard_bytes=100)
    writer.add({"small": torch.zeros(5), "large": torch.zeros(1000), "tail": torch.zeros(5)})
    writer.close()
    weight_map = read_weight_map(tmp_path / "big")
    assert len(set(weight_map.values())) == 3  # small | large alone | tail


def test_a_spilling_writer_writes_the_same_files_from_the_bytes_it_was_given(tmp_path):
    # every dtype a checkpoint holds (bf16 has no numpy type), odd sizes, a 0-dim and an
    # empty tensor, over three shards: the spilled queue gives the in-memory queue's files
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "w.bf16": torch.randn(5, 7, generator=gen).bfloat16(),
        "codes": torch.randint(0, 255, (13,), generator=gen, dtype=torch.uint8),
        "scale": torch.randn(3, generator=gen).half(),
        "zero": torch.tensor(2.5),
        "none": torch.empty(0, 4),
        "idx": torch.arange(9, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "w.f32": torch.randn(33, generator=gen),
    }
    expected = {key: tensor.clone() for key, tensor in tensors.items()}
    for spill in (False, True):
        (tmp_path / str(spill)).mkdir()
        writer = ShardWriter(tmp_path / str(spill), max_shard_bytes=100, spill=spill)
        for key, tensor in tensors.items():
            writer.add({key: tensor})
            if spill:  # the bytes are taken when given: the writer holds no reference
                tensor.zero_() if tensor.dtype != torch.bool else tensor.fill_(False)
        writer.close()
        tensors = {key: tensor.clone() for key, tensor in expected.items()}
    names = sorted(p.name for p in (tmp_path / "False").iterdir())
    assert len(names) > 3 and names == sorted(p.name for p in (tmp_path / "True").iterdir())
    for name in names:  # the scratch file is gone, the files are the same bytes
        assert (tmp_path / "True" / name).read_bytes() == (tmp_path / "False" / name).read_bytes()
    loaded = {}
    for name in names:
        if name.endswith(".safetensors"):
            loaded.update(load_file(tmp_path / "True" / name))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)


def test_a_key_given_twice_or_a_closed_writer_is_a_sentence(tmp_path):
    writer = ShardWriter(tmp_path, max_shard_bytes=1)  # "a" is written at once
    writer.add({"a": torch.zeros(2)})
    with pytest.raises(LowbitError, match="'a' was given twice"):
        writer.add({"a": torch.zeros(2)})
    writer.close()
    with pytest.raises(LowbitError, match="closed"):
        writer.add({"b": torch.zeros(2)})


@pytest.mark.parametrize(
    "text, value",
    [
        ("500MB", 500 * 10**6),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("4096", 4096),
        (" 20 kb ", 20_000),
        ("3KiB", 3072),
        (123, 123),
    ],  # fmt: skip
)
def test_sizes_parse_as_hugging_face_reads_them(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["2 GBs", "GB", "-1GB", "0", "1e9", True, 2.5, "0.1B"])
def test_a_bad_size_is_a_sentence(text):
    with pytest.raises(LowbitError, match="size"):
        parse_size(text)


# -- sharded checkpoints ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One quantized tiny model (packed 4-bit weights) saved as one file and as shards of at
    most 40 kB."""
    model = quantize(
        tiny_model("llama", head_dim=32), get_recipe("rtn", w_bits=4, w_group=32), progress=False
    )
    root = tmp_path_factory.mktemp("shards")
    save(model, root / "one")
    save(model, root / "many", max_shard_size="40kB")
    return root, model


def test_a_sharded_checkpoint_loads_in_another_process_as_the_single_file_does(checkpoints):
    root, model = checkpoints
    shards = sorted(p.name for p in (root / "many").glob("model-*.safetensors"))
    assert len(shards) > 3 and not (root / "many" / "model.safetensors").exists()
    for name in shards:  # bounded: a shard is over 40 kB only when one tensor is
        tensors = load_file(root / "many" / name)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 40_000 or len(tensors) == 1
    stored = {}
    for name in shards:
        stored.update(load_file(root / "many" / name))
    single = load_file(root / "one" / "model.safetensors")
    assert stored.keys() == single.keys()
    assert all(torch.equal(stored[k], single[k]) for k in single)
    assert single.keys() == checkpoint_tensors(model).keys()
    torch.save(IDS, root / "ids.pt")
    code = (
        "import sys, torch, lowbit\n"
        "from transformers import AutoModelForCausalLM\n"
        "root = sys.argv[1]\n"
        "ids = torch.load(root + '/ids.pt')\n"
        "one = lowbit.load(root + '/one', dtype=torch.float32)\n"
        "many = lowbit.load(root + '/many', dtype=torch.float32)\n"
        "hf = AutoModelForCausalLM.from_pretrained(root + '/many', dtype=torch.float32)\n"
        "a, b = one.state_dict(), many.state_dict()\n"
        "assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)\n"
        "logits = one(ids).logits\n"
        "assert torch.equal(many(ids).logits, logits) and torch.equal(hf(ids).logits, logits)\n"
        "torch.save(logits, root + '/logits.pt')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert torch.equal(torch.load(root / "logits.pt"), model(IDS).logits)


def _copy(checkpoints, tmp_path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(checkpoints[0] / "many", target)
    return target


def _shard(directory: Path, number: int = 2) -> Path:
    return sorted(directory.glob("model-*.safetensors"))[number - 1]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _move_a_key(directory: Path) -> None:
    """Edit the index to place a tensor in another shard, and record the edited index's sum
    (as someone who edits files by hand could)."""
    index = json.loads((directory / INDEX_NAME).read_text())
    files = list(index["weight_map"].values())
    key = next(k for k, name in index["weight_map"].items() if files.count(name) > 1)
    others = sorted(set(index["weight_map"].values()) - {index["weight_map"][key]})
    index["weight_map"][key] = others[0]
    (directory / INDEX_NAME).write_text(json.dumps(index))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["checksums"][INDEX_NAME] = file_sha256(directory / INDEX_NAME)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _flip_a_byte(_shard(d)), r"model-00002-of-\d+.safetensors does not match the "),
        (lambda d: _shard(d, 3).unlink(), r"has no model-00003-of-\d+.safetensors: the checkpoint"),
        (lambda d: (d / INDEX_NAME).unlink(), "has no model.safetensors.index.json"),
        (lambda d: _flip_a_byte(d / INDEX_NAME), "index.json does not match the checksum"),
        (_move_a_key, "which model.safetensors.index.json places in model-"),
        (
            lambda d: shutil.copy(_shard(d), d / "model.safetensors"),
            "holds both shards and a model.safetensors",
        ),
    ],
)
def test_a_damaged_shard_or_index_is_one_sentence(checkpoints, tmp_path, damage, message):
    directory = _copy(checkpoints, tmp_path)
    damage(directory)
    with pytest.raises(LowbitError, match=message) as refused:
        load(directory)
    assert "\n" not in str(refused.value)
    from transformers import AutoModelForCausalLM

    if "index.json" not in message:  # transformers reads the index before lowbit is asked
        with pytest.raises(LowbitError, match=message):  # transformers' path verifies the same way
            AutoModelForCausalLM.from_pretrained(directory)


def test_a_shard_with_a_tensor_left_out_is_named(checkpoints, tmp_path):
    directory = _copy(checkpoints, tmp_path)
    path = _shard(directory)
    tensors = load_file(path)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, path, metadata={"format": "pt"})
    index = json.loads((directory / INDEX_NAME).read_text())
    del index["weight_map"][dropped]
    (directory / INDEX_NAME).write_text(json.dumps(index))
    config = json.loads((directory / "config.json").read_text())
    checksums = config["quantization_config"]["checksums"]
    checksums.update({p.name: file_sha256(p) for p in (path, directory / INDEX_NAME)})
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(LowbitError, match=f"has no tensor '{dropped}'"):
        io_format.verify_checkpoint(directory)


def test_cli_quantize_writes_shards_and_refuses_a_bad_size(tiny_model_dir, tmp_path, capsys):
    from lowbit.cli import main

    out = tmp_path / "w4"
    assert main(["quantize", "--model", str(tiny_model_dir), "--recipe", "w4a16",
                 "--set", "w_group=32", "--max-shard-size", "50kB", "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    assert len(read_weight_map(out).values()) > 1
    assert main(["info", "--model", str(out)]) == 0
    capsys.readouterr()
    assert main(["quantize", "--model", str(tiny_model_dir), "--recipe", "w4a16",
                 "--max-shard-size", "2 parsecs", "--out", str(tmp_path / "x")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown unit 'parsecs'" in err


def test_fp32_floats_run_in_bf16_are_cast_after_loading_exactly_and_held_once(checkpoints):
    """The quantizer loads floats as stored (views of the mapping) and casts them after, a slab
    at a time: the same values as a cast while loading, and the fp32 pages are not resident."""
    from lowbit.io import hf
    from lowbit.mapped import file_mappings

    root, _ = checkpoints
    exact = load(root / "many", dtype=torch.float32)
    previous, hf._CAST_SLAB = hf._CAST_SLAB, 1000  # several slabs even for a tiny embedding
    try:
        fast = load(root / "many")
    finally:
        hf._CAST_SLAB = previous
    embedding = fast.get_submodule("model.embed_tokens").weight
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, exact.get_submodule("model.embed_tokens").weight.bfloat16())
    mapped = file_mappings()
    assert not any(m.start <= embedding.data_ptr() < m.end for m in mapped)  # a copy
    packed = fast.get_submodule("model.layers.0.mlp.up_proj").qdata
    assert any(m.start <= packed.data_ptr() < m.end for m in mapped)  # a view of the file
    want, got = exact.state_dict(), fast.state_dict()
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
