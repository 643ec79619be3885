"""QuaRot's rotation keeps the function: fp32 invariance on awkward tiny models of each family."""

import copy
import json

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.transforms.fuse import untie_embeddings
from lowbit.transforms.hadamard import OnlineHadamard, hadamard_matrix
from lowbit.transforms.rotate import (
    CrossHeadHadamard,
    residual_rotation,
    rotate_model,
    rotate_residual,
)


def _tokens(vocab=256, batch=2, seqlen=21):
    return torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


# (family, config overrides, rotate_model options, expected o_proj path)
SHAPES = {
    # 6 heads x 16 = 96 (no H_6, 96 = 12·8 has one), GQA 3, intermediate 160 = 20·8
    "llama-6x16-full": ("llama", {}, {}, "full"),
    # 4 heads x 16, GQA 2, hidden 64, intermediate 48 = 12·4, untied
    "mistral-4x16-factorized": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=48),
        {},
        "factorized",
    ),
    # q/k/v biases, 8 heads x 8, GQA 4, factorized: the v bias is rotated per head too
    "qwen2-8x8-factorized-bias": (
        "qwen2",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, hidden_size=64),
        {},
        "factorized",
    ),
    "qwen2-6x16-per-head-untied": (
        "qwen2",
        dict(tie_word_embeddings=False),
        dict(o_proj_hadamard="per_head"),
        "per_head",
    ),
    # q/k norms per head, one KV head for four query heads
    "qwen3-4x16-factorized-mqa": (
        "qwen3",
        dict(num_attention_heads=4, num_key_value_heads=1),
        {},
        "factorized",
    ),
    "qwen3-4x16-full-forced": (
        "qwen3",
        dict(num_attention_heads=4, num_key_value_heads=1),
        dict(o_proj_hadamard="full"),
        "full",
    ),
    # 47 heads x 4 = 188: no Hadamard of 47 or 188, so only per head (and a random residual Q)
    "llama-47x4-per-head-random": (
        "llama",
        dict(num_attention_heads=47, num_key_value_heads=1, head_dim=4, hidden_size=188),
        dict(rotation="random"),
        "per_head",
    ),
}


def _check_structure(model, report, path):
    adapter = adapter_for(model)
    assert report.o_proj_hadamard == path
    assert len(report.layers) == adapter.num_layers
    assert not adapter.tied_embeddings
    for view in adapter.blocks():
        down = view.down_proj
        assert isinstance(down, FakeQuantLinear) and down.quantized_weight is None
        assert isinstance(down.input_transform, OnlineHadamard)
        assert down.input_transform.n == adapter.intermediate_size
        assert down.act_quantizer is None
        if path == "per_head":
            assert type(view.o_proj) is torch.nn.Linear
        else:
            expected = OnlineHadamard if path == "full" else CrossHeadHadamard
            assert isinstance(view.o_proj.input_transform, expected)


@pytest.mark.parametrize("name", list(SHAPES))
def test_rotate_model_preserves_logits_on_awkward_shapes(name):
    family, overrides, options, path = SHAPES[name]
    model = tiny_model(family, **overrides)
    original = copy.deepcopy(model)
    ids = _tokens()
    before = _logits(model, ids)

    report = rotate_model(model, **options)

    _check_structure(model, report, path)
    adapter, original_adapter = adapter_for(model), adapter_for(original)
    assert not torch.allclose(adapter.embed_tokens.weight, original_adapter.embed_tokens.weight)
    # measured: max |Δlogit| 4.2e-7 .. 8.3e-7 over these shapes (|logit| up to 0.7 .. 2.0)
    assert (_logits(model, ids) - before).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("rotation", ["hadamard", "random", "none"])
def test_every_rotation_kind_preserves_logits(family, rotation):
    model = tiny_model(family)
    ids = _tokens()
    before = _logits(model, ids)
    report = rotate_model(model, rotation=rotation, seed=3)
    assert report.rotation == rotation
    # measured: max |Δlogit| 4.2e-7 .. 6.0e-7 over families x kinds
    assert (_logits(model, ids) - before).abs().max().item() < 1e-4


@pytest.mark.parametrize("rotation", ["hadamard", "random"])
def test_residual_stream_is_rotated_by_q(rotation):
    """Every hidden state between blocks becomes h Q, with Q = residual_rotation(...)."""
    model = tiny_model("qwen2", num_hidden_layers=3)
    ids = _tokens()
    with torch.no_grad():
        before = model(ids, output_hidden_states=True).hidden_states
        rotate_model(model, rotation=rotation, seed=5)
        after = model(ids, output_hidden_states=True).hidden_states
    q = residual_rotation(96, rotation, seed=5).float()  # [hidden, hidden]
    for h_before, h_after in zip(
        before[:-1], after[:-1], strict=True
    ):  # the last one is after the norm
        # measured: max error 7.5e-8 (hadamard), 1.0e-7 (random) on |h| up to 4.8
        torch.testing.assert_close(h_after, h_before @ q, atol=1e-5, rtol=0)


def test_rotation_is_deterministic_per_seed():
    def rotated_state(seed):
        model = tiny_model("llama")
        rotate_model(model, seed=seed)
        return model.state_dict()

    first, again, other = rotated_state(0), rotated_state(0), rotated_state(1)
    for key in first:
        assert torch.equal(first[key], again[key]), key
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_qwen3_q_k_norms_and_qwen2_biases_are_untouched():
    qwen3 = tiny_model("qwen3")
    q_norm = adapter_for(qwen3).block(0).q_norm.weight.clone()
    k_norm = adapter_for(qwen3).block(0).k_norm.weight.clone()
    rotate_model(qwen3)
    assert torch.equal(adapter_for(qwen3).block(0).q_norm.weight, q_norm)
    assert torch.equal(adapter_for(qwen3).block(0).k_norm.weight, k_norm)

    qwen2 = tiny_model("qwen2")  # full o_proj path: v is not touched by a per-head transform
    view = adapter_for(qwen2).block(1)
    biases = [p.bias.clone() for p in (view.q_proj, view.k_proj, view.v_proj)]
    rotate_model(qwen2)
    for proj, bias in zip((view.q_proj, view.k_proj, view.v_proj), biases, strict=True):
        assert torch.equal(proj.bias, bias)


def test_cross_head_hadamard_matches_dense_kronecker():
    heads, head_dim = 4, 12
    x = torch.randn(3, 5, heads * head_dim, dtype=torch.float64)
    a = hadamard_matrix(heads) / heads**0.5
    dense = torch.kron(a, torch.eye(head_dim, dtype=torch.float64))  # [48, 48]
    expected = x @ dense.T
    torch.testing.assert_close(CrossHeadHadamard(heads, head_dim)(x), expected, atol=1e-12, rtol=0)


def test_online_fp16_compute_dtype_is_used_and_close():
    model = tiny_model("mistral", num_attention_heads=4, num_key_value_heads=2)
    ids = _tokens()
    before = _logits(model, ids)
    report = rotate_model(model, online_dtype=torch.float16)
    view = adapter_for(model).block(0)
    assert report.online_dtype == "float16"
    assert view.down_proj.input_transform.compute_dtype == torch.float16
    assert view.o_proj.input_transform.compute_dtype == torch.float16
    error = (_logits(model, ids) - before).abs().max().item()
    # measured: max |Δlogit| 3.2e-4 with float16 online transforms (float32: 6e-7)
    assert 1e-6 < error < 1e-2


def test_report_is_json_serialisable_and_describes_the_transforms():
    model = tiny_model("llama")
    report = rotate_model(model)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["residual"] == "randomized Hadamard H_96 (K=12 x 2^3)"
    assert data["layers"][1]["down_proj"].startswith("online H_160 (K=20 x 2^3)")
    assert "online H_96" in data["layers"][0]["o_proj"]
    assert model.lowbit_rotation is report
    assert "H_160" in report.summary()


def test_rotate_residual_requires_fused_norms_and_untied_embeddings():
    model = tiny_model("llama")
    q = residual_rotation(96, seed=0)
    with pytest.raises(LowbitError, match="fuse"):
        untie_embeddings(model)
        rotate_residual(model, q)
    with pytest.raises(LowbitError, match="96x96"):
        rotate_residual(model, q[:, :48])


@pytest.mark.parametrize(
    "overrides, options, message",
    [
        ({}, dict(rotation="givens"), "rotation must be one of"),
        ({}, dict(o_proj_hadamard="diagonal"), "o_proj_hadamard must be one of"),
        ({}, dict(o_proj_hadamard="factorized"), "impossible for 6 heads"),
        ({}, dict(online_dtype="fp16"), "online_dtype"),
        (dict(intermediate_size=90), {}, "intermediate size 90"),
        ({}, dict(hadamard_block=6), "hadamard_block=6 has no known Hadamard"),
        ({}, dict(hadamard_block=64), "hadamard_block=64 must divide .* 96 .* 160"),
        ({}, dict(hadamard_block=0), "positive integer"),
        ({}, dict(hadamard_block=16, o_proj_hadamard="per_head"), "another path"),
        (
            dict(num_attention_heads=47, num_key_value_heads=1, head_dim=4, hidden_size=188),
            {},
            "hidden size 188 .* rotation='random'",
        ),
    ],
)
def test_bad_input_raises_before_touching_the_model(overrides, options, message):
    model = tiny_model("llama", **overrides)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LowbitError, match=message):
        rotate_model(model, **options)
    assert adapter_for(model).tied_embeddings
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_rotating_twice_or_a_quantized_model_is_refused():
    model = tiny_model("llama")
    rotate_model(model)
    with pytest.raises(LowbitError, match="already rotated"):
        rotate_model(model)

    quantized = tiny_model("llama")
    view = adapter_for(quantized).block(0)
    packed = IntQuantized.from_float(view.q_proj.weight, 4)
    view.attn.q_proj = FakeQuantLinear(packed.dequantize(), None, quantized_weight=packed)
    with pytest.raises(LowbitError, match="before any quantization"):
        rotate_model(quantized)


@pytest.mark.slow
def test_embedded_model_is_invariant(embedded):
    model = copy.deepcopy(embedded.model).eval()  # float32
    ids = embedded.tokenizer(
        "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
        return_tensors="pt",
    ).input_ids
    before = _logits(model, ids)
    report = rotate_model(model)
    assert report.o_proj_hadamard == "full"  # 9 heads: no H_9; 576 = 36·16 has one
    # measured: max |Δlogit| 1.6e-4 on 32 tokens (|logit| up to 44); random Q 1.2e-4
    assert (_logits(model, ids) - before).abs().max().item() < 1e-3


@pytest.mark.parametrize("n", [64, 96, 160, 576])
def test_fast_randomized_hadamard_map_matches_the_dense_matrix(n):
    from lowbit.transforms.hadamard import random_hadamard_matrix
    from lowbit.transforms.rotate import _randomized_hadamard_map

    x = torch.randn(7, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    expected = x @ random_hadamard_matrix(n, seed=4)  # [7, n]
    torch.testing.assert_close(_randomized_hadamard_map(n, 4)(x), expected, atol=1e-12, rtol=0)


def test_fast_and_dense_residual_rotation_give_the_same_model():
    from lowbit.transforms.fuse import fuse_norms
    from lowbit.transforms.rotate import _randomized_hadamard_map

    dense, fast = tiny_model("qwen2"), tiny_model("qwen2")
    for model in (dense, fast):
        fuse_norms(model)
    rotate_residual(dense, residual_rotation(96, "hadamard", seed=6))
    rotate_residual(fast, _randomized_hadamard_map(96, 6))
    fast_state = fast.state_dict()
    for key, value in dense.state_dict().items():
        # float64 products in a different order, cast to float32: at most an ulp apart
        torch.testing.assert_close(fast_state[key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("block", [8, 16, 32])
def test_block_diagonal_online_hadamards_preserve_logits(family, block):
    """hadamard_block: each block of ``block`` input channels of down_proj and o_proj is
    transformed on its own (what one tensor-parallel shard can apply)."""
    overrides = dict(intermediate_size=128, hidden_size=64, num_attention_heads=4)
    model = tiny_model(family, **overrides)
    ids = _tokens()
    before = _logits(model, ids)
    report = rotate_model(model, hadamard_block=block)
    assert report.hadamard_block == block and report.o_proj_hadamard == "full"
    for view in adapter_for(model).blocks():
        for linear, width in ((view.down_proj, 128), (view.o_proj, 64)):
            transform = linear.input_transform
            assert isinstance(transform, OnlineHadamard)
            assert (transform.n, transform.size) == (width, block)
            # block-diagonal: channel 0 mixes with its own block only
            row = transform(torch.eye(width)[:1])  # [1, width]
            assert row[0, block:].abs().max() == 0 and row[0, :block].abs().min() > 0
    # measured: max |Δlogit| 3.6e-7 .. 6.0e-7 over families x blocks
    assert (_logits(model, ids) - before).abs().max().item() < 1e-4
