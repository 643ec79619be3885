"""Learned rotations keep the function, and the training hooks see exactly the fused model."""

import copy
import functools

import pytest
import torch

from lowbit.algorithms.rotation_training import ste_fake_quant
from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.transforms.learned_rotate import (
    ACTIVATION_POINTS,
    LearnedRotations,
    cayley,
    fuse_learned_rotations,
    quantized_in_rotated_basis,
)
from lowbit.transforms.rotate import rotate_model

# (family, config overrides, rotate_model options): the awkward shapes rotate is tested on
SHAPES = {
    "llama-6x16-gqa3-full-tied": ("llama", {}, {}),
    "qwen2-8x8-factorized-bias": (
        "qwen2",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, hidden_size=64),
        {},
    ),
    "qwen2-6x16-per-head-untied": (
        "qwen2",
        dict(tie_word_embeddings=False),
        dict(o_proj_hadamard="per_head"),
    ),
    "qwen3-4x16-mqa-qk-norms": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1), {}),
    "mistral-4x16-factorized": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=48),
        {},
    ),
    "llama-6x16-standard-graph": ("llama", {}, dict(online=False)),  # no online transforms
    "llama-47x4-random": (
        "llama",
        dict(num_attention_heads=47, num_key_value_heads=1, head_dim=4, hidden_size=188),
        dict(rotation="random"),
    ),
}


def _tokens(batch=2, seqlen=21):
    return torch.randint(0, 256, (batch, seqlen), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits.double()


def _kl(reference, logits):
    p = reference.log_softmax(-1)
    return (p.exp() * (p - logits.log_softmax(-1))).sum(-1).mean().item()


def _rotated_with_random_rotations(name, seed=3, weights=False):
    family, overrides, options = SHAPES[name]
    model = tiny_model(family, **overrides)
    original = copy.deepcopy(model)
    report = rotate_model(model, **options)
    adapter = adapter_for(model)
    rotations = LearnedRotations.for_model(
        adapter, report.o_proj_hadamard, scales=True, weights=weights
    )
    with torch.no_grad():  # far from the identity: a real rotation, not a perturbation
        generator = torch.Generator().manual_seed(seed)
        for param in rotations.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=generator))
        for delta in rotations.weight_deltas.values():  # a quarter of the weights (std 0.02)
            delta.mul_(0.01)
    return original, model, rotations


def test_cayley_is_orthogonal_and_zero_is_the_identity():
    x = torch.randn(3, 40, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    r = cayley(x)  # [3, 40, 40]
    eye = torch.eye(40, dtype=torch.float64)
    assert (r @ r.transpose(-1, -2) - eye).abs().max() < 1e-12
    assert (r - eye).abs().max() > 0.5  # a real rotation
    assert torch.equal(cayley(torch.zeros(40, 40)), torch.eye(40))


@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_learned_rotations_keep_the_function(name):
    original, model, rotations = _rotated_with_random_rotations(name)
    ids = _tokens()
    reference = _logits(original, ids)
    rotated = {n: type(m) for n, m in model.named_modules()}
    v_before = adapter_for(model).block(0).v_proj.weight.clone()
    up_norms = adapter_for(model).block(0).up_proj.weight.norm(dim=1)  # R1 keeps them, S not

    with quantized_in_rotated_basis(model, rotations, activation=None, value=lambda v: v):
        hooked = _logits(model, ids)  # a value point that does not quantize: exact
    fuse_learned_rotations(model, rotations)

    fused = _logits(model, ids)
    # measured: max |Δlogit| below 3e-6 on these shapes, KL below 1e-12
    assert (hooked - reference).abs().max() < 1e-4
    assert (fused - reference).abs().max() < 1e-4
    assert _kl(reference, fused) < 1e-4
    assert {n: type(m) for n, m in model.named_modules()} == rotated  # QuaRot's structure
    assert not torch.allclose(adapter_for(model).block(0).v_proj.weight, v_before)
    assert not torch.allclose(adapter_for(model).block(0).up_proj.weight.norm(dim=1), up_norms)


@pytest.mark.parametrize(
    "name", ["llama-6x16-gqa3-full-tied", "qwen2-8x8-factorized-bias", "llama-6x16-standard-graph",
             "qwen2-6x16-per-head-untied"]
)  # fmt: skip
def test_weight_corrections_fuse_to_what_the_loop_computed(name):
    """With ΔW beside R1, R2 and S, the fused model computes what the loop's model did (ΔW of
    down_proj learned after S), and the loop's paused model is the float one."""
    original, model, rotations = _rotated_with_random_rotations(name, weights=True)
    assert len(rotations.weight_deltas) == 7 * adapter_for(model).num_layers
    ids = _tokens()
    reference = _logits(original, ids)
    with quantized_in_rotated_basis(model, rotations, activation=None, value=lambda v: v) as paused:
        hooked = _logits(model, ids)
        with paused():
            float_view = _logits(model, ids)
    fuse_learned_rotations(model, rotations)
    fused = _logits(model, ids)

    assert (float_view - reference).abs().max() < 1e-4
    assert (hooked - reference).abs().mean() > 1e-2  # ΔW changes the function
    # measured: mean |Δlogit| from ΔW 0.03-0.06, max |fused - hooked| below 1e-6
    assert (fused - hooked).abs().max() < 1e-4


@pytest.mark.parametrize(
    "name", ["llama-6x16-gqa3-full-tied", "qwen2-8x8-factorized-bias", "llama-6x16-standard-graph"]
)
def test_training_hooks_quantize_what_the_fused_model_would(name):
    """Quantizers at the hooks' points of the *fused* model (rotations at the identity) give the
    logits that the hooks give on the unfused model with the learned rotations."""
    _, model, rotations = _rotated_with_random_rotations(name)
    ids = _tokens()
    quantize = functools.partial(ste_fake_quant, bits=6, symmetric=True, clip_ratio=0.9)
    seen = set()

    def act(x, layer, point):  # the same at every point
        seen.add((layer, point))
        return quantize(x)

    val = functools.partial(ste_fake_quant, bits=6, symmetric=False)
    with quantized_in_rotated_basis(model, rotations, activation=act, value=val):
        trained_view = _logits(model, ids)
    layers = range(adapter_for(model).num_layers)
    assert seen == {(layer, point) for layer in layers for point in ACTIVATION_POINTS}
    with quantized_in_rotated_basis(model, rotations, activation=None, value=None):
        float_view = _logits(model, ids)

    fuse_learned_rotations(model, rotations)
    adapter = adapter_for(model)
    identity = LearnedRotations(
        adapter.hidden_size, adapter.head_dim, adapter.num_layers, heads=False
    )
    with quantized_in_rotated_basis(model, identity, activation=act, value=val):
        deployed = _logits(model, ids)

    quantization_effect = (trained_view - float_view).abs().mean()
    assert quantization_effect > 1e-3  # the quantizers act
    # measured: mean |Δlogit| ~1e-6 (a rare code flips at a rounding tie between the two orders)
    assert (deployed - trained_view).abs().mean() < 0.02 * quantization_effect


@pytest.mark.parametrize(
    "name", ["llama-6x16-gqa3-full-tied", "qwen2-8x8-factorized-bias", "qwen2-6x16-per-head-untied"]
)
def test_weights_in_the_loop_are_quantized_as_the_fused_model_holds_them(name):
    """Each block linear's weight quantized per row in the fused basis (R1 on either side, R2
    on v's rows and o_proj's input through its online transform), then rotated back, gives the
    logits of the fused model with those rows quantized; leaving restores every weight."""
    _, model, rotations = _rotated_with_random_rotations(name)
    ids = _tokens()
    weights = {n: p.clone() for n, p in model.named_parameters()}
    quantize = functools.partial(ste_fake_quant, bits=4, symmetric=True)
    with quantized_in_rotated_basis(model, rotations, activation=None, value=None,
                                    weight=quantize):  # fmt: skip
        trained_view = _logits(model, ids)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    float_view = _logits(model, ids)

    fuse_learned_rotations(model, rotations)
    adapter = adapter_for(model)
    identity = LearnedRotations(
        adapter.hidden_size, adapter.head_dim, adapter.num_layers, heads=False
    )
    with quantized_in_rotated_basis(model, identity, activation=None, value=None,
                                    weight=quantize):  # fmt: skip
        deployed = _logits(model, ids)

    quantization_effect = (trained_view - float_view).abs().mean()
    assert quantization_effect > 1e-3  # the quantizer acts
    # measured: 1.3e-5 and 1.5e-5 of the quantization effect on the qwen2 shapes, 7.1e-3 on
    # llama's (codes that flip at rounding ties between the two orders of products)
    assert (deployed - trained_view).abs().mean() < 0.02 * quantization_effect


def test_learned_rotations_need_a_rotated_model():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    rotations = LearnedRotations(adapter.hidden_size, adapter.head_dim, adapter.num_layers)
    with pytest.raises(LowbitError, match="rotate_model has rotated first"):
        fuse_learned_rotations(model, rotations)
