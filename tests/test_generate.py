import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.generate import encode_prompt, generate
from lowbit.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def test_greedy_equals_model_generate_token_for_token(tiny):
    model, tokenizer = tiny.model, tiny.tokenizer
    pieces = []
    first = generate(model, tokenizer, "The module", max_new_tokens=24, streamer=pieces.append)
    second = generate(model, tokenizer, "The module", max_new_tokens=24)
    assert first.new_tokens == second.new_tokens  # greedy is deterministic
    ids = tokenizer("The module", return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        plain = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
        )
    assert first.new_tokens == plain[0, ids.shape[1] :].tolist()
    assert first.prompt_tokens == ids.shape[1]
    # the streamed pieces are the decoded new tokens, in order
    assert "".join(pieces) == first.streamed == first.text
    assert first.text == tokenizer.decode(first.new_tokens, skip_special_tokens=True)
    assert first.text  # the tiny model does say something in 24 tokens


def test_result_reports_speed_and_memory(tiny):
    result = generate(tiny.model, tiny.tokenizer, "The module", max_new_tokens=8)
    assert len(result.new_tokens) == 8  # the tiny model does not emit </s> here
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert result.tokens_per_second == pytest.approx(7 / result.decode_seconds)
    assert result.peak_memory_bytes > 10 << 20
    assert "RSS" in result.peak_memory_kind  # on the CPU: the process's peak RSS
    assert result.cache_type == "DynamicCache"


def test_kv_recipe_generates_with_its_quantized_cache(tiny_model_dir):
    from lowbit import quantize
    from lowbit.kv.cache import QuantizedKVCache

    loaded = load_model(str(tiny_model_dir))
    quantize(loaded.model, "kv-int", progress=False)
    result = generate(loaded.model, loaded.tokenizer, "The module", max_new_tokens=12)
    assert isinstance(result.cache, QuantizedKVCache)
    assert result.cache.get_seq_length() == result.prompt_tokens + len(result.new_tokens) - 1
    assert len(result.new_tokens) == 12


def test_a_static_cache_gives_the_dynamic_cache_tokens(tiny):
    dynamic = generate(tiny.model, tiny.tokenizer, "The module", max_new_tokens=16)
    static = generate(tiny.model, tiny.tokenizer, "The module", max_new_tokens=16,
                      static_cache=True)  # fmt: skip
    assert static.cache_type == "StaticCache"
    assert static.new_tokens == dynamic.new_tokens


def test_a_static_cache_is_refused_beside_a_quantized_one(tiny_model_dir):
    from lowbit import quantize

    loaded = load_model(str(tiny_model_dir))
    quantize(loaded.model, "kv-int", progress=False)
    for option in ("static_cache", "compile"):
        with pytest.raises(LowbitError, match="static cache holds floats"):
            generate(loaded.model, loaded.tokenizer, "The", max_new_tokens=2, **{option: True})
    assert "forward" not in loaded.model.__dict__  # nothing was compiled


@pytest.mark.gpu
def test_compiled_generation_on_cuda_gives_the_eager_tokens(tiny):
    model = tiny.model.to("cuda")
    try:
        eager = generate(model, tiny.tokenizer, "The module", max_new_tokens=12)
        compiled = generate(model, tiny.tokenizer, "The module", max_new_tokens=12, compile=True)
        assert compiled.new_tokens == eager.new_tokens
        assert "forward" not in model.__dict__  # the compiled forward is removed afterwards
    finally:
        model.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["w4a16", "spqr", "mixed-2-4-16"])
def test_a_packed_model_compiled_before_any_call_gives_the_eager_tokens(tiny, recipe):
    """CUDA graphs (``reduce-overhead``) on a packed model that never ran: a kernel layout made
    inside the graphs' warm-up would outlive it and be refused (seen on an H200, 2026-11-26),
    so the compiled call comes first; then the eager tokens."""
    import lowbit
    from lowbit.models.tiny import tiny_model

    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32)
    model = tiny_model("llama", seed=0, vocab_size=len(tiny.tokenizer), **shape)
    calibration = torch.randint(3, len(tiny.tokenizer), (4, 48),
                                generator=torch.Generator().manual_seed(0))  # fmt: skip
    lowbit.quantize(model, recipe, calibration=calibration, progress=False, packed=True)
    model = model.to("cuda", torch.float16)
    compiled = generate(model, tiny.tokenizer, "The module", max_new_tokens=12, compile=True)
    eager = generate(model, tiny.tokenizer, "The module", max_new_tokens=12)
    assert compiled.new_tokens == eager.new_tokens


def test_chat_messages_go_through_the_template(tiny):
    tokenizer = tiny.tokenizer
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(LowbitError, match="has no chat template"):
        encode_prompt(tokenizer, messages)
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    try:
        ids = encode_prompt(tokenizer, messages)
        assert tokenizer.decode(ids[0]) == "<s>user: hello\n<s>assistant: "
        result = generate(tiny.model, tokenizer, messages, max_new_tokens=4)
        assert result.prompt_tokens == ids.shape[1]
    finally:
        tokenizer.chat_template = None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"temperature": -0.5}, "temperature must be 0"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p must be more than 0"),
        ({"max_new_tokens": 10_000}, "exceed the model's context of 512"),
    ],
)
def test_bad_arguments_are_sentences(tiny, kwargs, message):
    with pytest.raises(LowbitError, match=message):
        generate(tiny.model, tiny.tokenizer, "The module", **kwargs)


def test_sampling_follows_the_seed(tiny):
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(generate(tiny.model, tiny.tokenizer, "The", max_new_tokens=10, temperature=1.5))
    assert runs[0].new_tokens == runs[1].new_tokens


def test_a_quantized_cache_is_prefilled_in_chunks_with_the_same_tokens(tiny_model_dir):
    from lowbit import quantize
    from lowbit.recipes.registry import get_recipe

    loaded = load_model(str(tiny_model_dir))
    quantize(loaded.model, get_recipe("kv-int", bits=8), progress=False)
    prompt = "The module holds the functions that the rest of the package calls " * 3
    one = generate(loaded.model, loaded.tokenizer, prompt, max_new_tokens=6, prefill_chunk=4096)
    chunked = generate(loaded.model, loaded.tokenizer, prompt, max_new_tokens=6, prefill_chunk=7)
    assert chunked.new_tokens == one.new_tokens
    assert chunked.cache.get_seq_length() == one.cache.get_seq_length()
    with pytest.raises(LowbitError, match="prefill_chunk must be a positive integer"):
        generate(loaded.model, loaded.tokenizer, prompt, prefill_chunk=0)


def test_a_cache_that_does_not_fit_is_refused_before_the_prefill(tiny, monkeypatch):
    import lowbit.generate as gen

    monkeypatch.setattr(gen, "_available_bytes", lambda device: 1000)
    with pytest.raises(LowbitError, match=r"needs 0.00 GiB \([0-9,]+ bytes\), more than the"):
        generate(tiny.model, tiny.tokenizer, "The module", max_new_tokens=5)
