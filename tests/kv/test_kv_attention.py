"""The KV attention installed through the adapter: equal to the stock model when nothing is
quantized (prefill, decode, left padding, GQA, four families), pre-RoPE == post-RoPE caching,
rotate_qk invisible without quantization, generate() and chunked evaluation with quantized
caches, bad input."""

import copy

import pytest
import torch
from transformers import DynamicCache

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.eval.evaluate import window_logits
from lowbit.kv import IntTokenQuantizer, install_kv_quantization
from lowbit.kv.attention import KVQuantAttention
from lowbit.kv.cache import QuantizedKVLayer
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe
from lowbit.transforms.permute import ksort_qk

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
TOL = 1e-4  # fp32 logits; measured differences are 0 (no rotation) and <= 3e-7 (Hadamard)


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in FAMILIES}


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding of different lengths
    mask[2, :7] = 0
    return ids, mask


def _prefill_then_decode(model, cache, ids, mask, prefill=8):
    """Logits of the real tokens: a prefill of ``prefill`` tokens, then one token at a time."""
    out = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], past_key_values=cache).logits]
    for t in range(prefill, ids.shape[1]):
        positions = (mask[:, : t + 1].cumsum(1) - 1)[:, -1:]  # true positions of the new token
        step = model(
            ids[:, t : t + 1],
            attention_mask=mask[:, : t + 1],
            position_ids=positions,
            past_key_values=cache,
        )
        out.append(step.logits)
    return torch.cat(out, 1)[mask.bool()]  # [real tokens, V]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "pre_rope, rotate_qk", [(False, "none"), (True, "none"), (False, "hadamard")]
)
def test_unquantized_equals_stock(models, family, pre_rope, rotate_qk):
    stock = models[family]
    model = copy.deepcopy(stock)
    install_kv_quantization(model, pre_rope=pre_rope, rotate_qk=rotate_qk)
    assert isinstance(adapter_for(model).block(1).attn, KVQuantAttention)
    ids, mask = _batch()
    with torch.no_grad():
        one_pass = model(ids, attention_mask=mask, use_cache=False).logits
        expected = stock(ids, attention_mask=mask, use_cache=False).logits
        assert (one_pass - expected)[mask.bool()].abs().max() < TOL
        decoded = _prefill_then_decode(model, model.lowbit_make_cache(), ids, mask)
        expected = _prefill_then_decode(stock, DynamicCache(config=stock.config), ids, mask)
        assert (decoded - expected).abs().max() < TOL
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        reference = stock.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, reference)


def test_names_and_weights_are_kept(models):
    model = copy.deepcopy(models["qwen3"])
    names = adapter_for(model).linear_names()
    install_kv_quantization(model, key_quantizers=[IntTokenQuantizer(4)] * 2)
    assert adapter_for(model).linear_names() == names
    for name in names:
        model.get_submodule(name)  # still resolvable
    assert model.model.layers[0].self_attn.k_norm is not None


@pytest.mark.parametrize("recipe", [{"bits": 4}, {"bits": 3, "rotate_qk": "hadamard"}])
def test_chunked_equals_one_pass_for_per_token_formats(models, recipe):
    model = copy.deepcopy(models["llama"])
    quantize(model, get_recipe("kv-int", **recipe), progress=False)
    window = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        one_pass = window_logits(model, window)
        chunked = window_logits(model, window, chunk=16)
        stepwise = window_logits(model, window, chunk=1)
        fp = window_logits(models["llama"], window)
    # same stored values either way; only the attention arithmetic differs (measured <= 2e-5)
    assert (one_pass - chunked).abs().max() < 1e-4
    assert (one_pass - stepwise).abs().max() < 1e-4
    assert (one_pass - fp).abs().max() > 1e-3  # the quantization is really applied


def test_generate_8bit_matches_fp_greedy(models):
    stock = models["mistral"]
    model = copy.deepcopy(stock)
    quantize(model, get_recipe("kv-int", bits=8, clip_ratio=1.0), progress=False)
    ids, mask = _batch(seed=3)
    with torch.no_grad():
        cache = model.lowbit_make_cache()
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False
        )
        reference = stock.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference)
    assert cache.get_seq_length() == ids.shape[1] + 5  # the last token is never fed back
    fp_bytes = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x heads x head_dim x fp32 bytes
    assert cache.bytes_per_token() < fp_bytes / 3


def test_assisted_generation_crops_and_matches_plain_greedy(models, monkeypatch):
    model = copy.deepcopy(models["llama"])
    quantize(model, get_recipe("kv-int", bits=4), progress=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # n-grams to look up
    crops = []
    original = QuantizedKVLayer.crop
    monkeypatch.setattr(
        QuantizedKVLayer, "crop", lambda self, n: crops.append(n) or original(self, n)
    )
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert not crops
        cache = model.lowbit_make_cache()
        assisted = model.generate(
            ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=4,
            past_key_values=cache,
        )  # fmt: skip
    assert crops, "no draft token was rejected: the test did not exercise crop"
    assert torch.equal(assisted, plain)
    assert cache.get_seq_length() == assisted.shape[1] - 1


def test_kivi_generate_runs_with_default_cache(models):
    model = copy.deepcopy(models["qwen2"])
    quantize(model, get_recipe("kivi", bits=2, group=8, residual=4), progress=False)
    ids, mask = _batch(seed=4)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        cache = DynamicCache(config=model.config)  # a stock cache is given quantized layers
        model(ids, attention_mask=mask, past_key_values=cache)
    assert out.shape == (3, 17)
    assert cache.layers[0].k.chunks[0].num_tokens == 8  # 12 tokens, >= 4 fp, groups of 8


def test_all_padding_row_raises(models):
    model = copy.deepcopy(models["llama"])
    install_kv_quantization(model)
    ids, mask = _batch()
    mask[1] = 0
    with pytest.raises(LowbitError, match="all padding"):
        model(ids, attention_mask=mask)


def test_filled_foreign_cache_raises(models):
    model = copy.deepcopy(models["llama"])
    cache = DynamicCache(config=model.config)
    model(torch.randint(3, 256, (1, 4)), past_key_values=cache)
    install_kv_quantization(model)
    with pytest.raises(LowbitError, match="lowbit_make_cache"):
        model(torch.randint(3, 256, (1, 1)), past_key_values=cache)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
@pytest.mark.parametrize("attention", ["kv", "ksort"])
def test_attention_stores_into_the_cache_under_either_name(models, attention, name):
    # transformers 5.24 hands a decoder layer's cache to its attention as `cache`, 5.23 as
    # `past_key_values`; lowbit's attention forwards read only the old name and ran cacheless
    model = copy.deepcopy(models["llama"])
    if attention == "kv":
        install_kv_quantization(model)
        cache = model.lowbit_make_cache()
    else:
        ksort_qk(model)
        cache = DynamicCache(config=model.config)
    adapter = adapter_for(model)
    positions = torch.arange(5)[None]  # [1, S]
    hidden = torch.randn(1, 5, adapter.hidden_size)  # [1, S, hidden]
    with torch.no_grad():
        adapter.block(0).attn(
            hidden,
            position_embeddings=adapter.rope_cos_sin(positions),
            attention_mask=None,
            position_ids=positions,
            **{name: cache},
        )
    assert cache.get_seq_length(0) == 5


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("pre_rope", [False, True])
def test_ksorted_model_keeps_its_function_under_kv_attention(models, family, pre_rope):
    stock = models[family]
    model = copy.deepcopy(stock)
    orders = ksort_qk(model)
    assert any(not torch.equal(o, torch.arange(o.shape[1]).expand_as(o)) for o in orders)
    install_kv_quantization(model, pre_rope=pre_rope)
    ids, mask = _batch(5)
    want = _prefill_then_decode(stock, DynamicCache(config=stock.config), ids, mask)
    got = _prefill_then_decode(model, model.lowbit_make_cache(), ids, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_left_padded_row_matches_itself_alone_with_a_sink(models, pre_rope):
    model = copy.deepcopy(models["llama"])
    keys = [IntTokenQuantizer(2) for _ in range(2)]
    values = [IntTokenQuantizer(2) for _ in range(2)]
    install_kv_quantization(
        model, key_quantizers=keys, value_quantizers=values, pre_rope=pre_rope, sink_tokens=1
    )
    ids, mask = _batch(6)
    positions = (mask.cumsum(1) - 1).clamp_min(0)  # pad-aware, as generate() passes them
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=positions).logits
        alone = model(ids[2:, 7:]).logits  # row 2 without its 7 pads
    # measured max |Δlogit| 2.4e-7 (per-token formats; the real first token is the sink)
    torch.testing.assert_close(padded[2, 7:], alone[0], rtol=0, atol=1e-5)


class _Recorder(torch.nn.Module):
    """A query quantizer that halves the queries and records what it saw."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, q):
        self.seen.append(q.detach().clone())
        return q * 0.5


@pytest.mark.parametrize("pre_rope", [False, True])
def test_query_quantizer_sees_queries_after_rope(models, pre_rope):
    model = copy.deepcopy(models["llama"])
    adapter = adapter_for(model)
    recorders = [_Recorder(), None]
    install_kv_quantization(model, query_quantizers=recorders, pre_rope=pre_rope)
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        q = adapter.block(0).q_proj(adapter.block(0).input_norm(hidden))  # [B, S, H*D]
        q = q.view(2, 7, -1, adapter.head_dim).transpose(1, 2)  # [B, H, S, D]
        want = adapter.apply_rope(q, torch.arange(7).expand(2, -1))
        quantized = model(ids).logits
    torch.testing.assert_close(recorders[0].seen[0], want, rtol=1e-5, atol=1e-6)
    # the module's output is what enters q kᵀ: halving layer 0's queries changes the logits
    stock = models["llama"](ids).logits
    assert (quantized - stock).abs().max() > 1e-3


def test_bad_install(models):
    model = copy.deepcopy(models["llama"])
    with pytest.raises(LowbitError, match="pre_rope"):
        install_kv_quantization(model, pre_rope=True, rotate_qk="hadamard")
    with pytest.raises(LowbitError, match="rotate_qk"):
        install_kv_quantization(model, rotate_qk="random")
    with pytest.raises(LowbitError, match="2 layers"):
        install_kv_quantization(model, key_quantizers=[IntTokenQuantizer(4)])
    with pytest.raises(LowbitError, match="does not divide head_dim"):
        install_kv_quantization(model, value_quantizers=[IntTokenQuantizer(4, group_size=6)] * 2)
    with pytest.raises(LowbitError, match="no adapter"):
        install_kv_quantization(torch.nn.Linear(2, 2))
    with pytest.raises(LowbitError, match="query_quantizers must be 2 modules"):
        install_kv_quantization(model, query_quantizers=[None])
