"""The ``learn-rotate`` recipe: exact alone, composed with weight and KV recipes, resumable."""

import copy

import pytest
import torch

import lowbit
from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.registry import get_recipe
from lowbit.transforms.hadamard import OnlineHadamard
from lowbit.transforms.learned_rotate import ACTIVATION_POINTS

CALIBRATION = torch.randint(3, 256, (4, 48), generator=torch.Generator().manual_seed(0))
TINY = dict(steps=6, lr=1e-2)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def _kl(reference, logits):
    """Mean KL divergence per token from the reference's next-token distribution."""
    p = reference.log_softmax(-1)
    return (p.exp() * (p - logits.log_softmax(-1))).sum(-1).mean().item()


@pytest.mark.parametrize(
    ("family", "overrides", "learn_scale"),
    [
        ("llama", {}, False),
        ("llama", {}, True),
        ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1), False),
        (
            "qwen2",
            dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, hidden_size=64),
            True,
        ),
    ],
)
def test_learned_rotation_alone_keeps_the_function(family, overrides, learn_scale):
    model = tiny_model(family, **overrides)
    original = copy.deepcopy(model)
    ids = CALIBRATION[:2, :21]
    recipe = get_recipe("learn-rotate", learn_scale=learn_scale, **TINY)
    lowbit.quantize(model, recipe, calibration=CALIBRATION)

    reference, got = _logits(original, ids), _logits(model, ids)
    kl = _kl(reference, got)
    assert kl < 1e-4  # measured: below 1e-12
    assert (got - reference).abs().max() < 1e-4
    training = model.lowbit_rotation_training
    assert training.steps == 6 and len(training.losses) == 6
    assert "learned R1" in model.lowbit_rotation.residual
    assert ("down_proj input scales" in model.lowbit_rotation.residual) == learn_scale
    # the rotation moved: not QuaRot's weights
    quarot = copy.deepcopy(original)
    lowbit.quantize(quarot, "rotate")
    q_weight = adapter_for(quarot).block(0).q_proj.weight
    assert not torch.allclose(adapter_for(model).block(0).q_proj.weight, q_weight, atol=1e-3)


def test_composes_with_gptq_and_the_kv_cache_and_resumes(tmp_path):
    recipe = get_recipe("learn-rotate+gptq+kv-int").with_settings(
        a_bits=4, rotate_qk="hadamard", **TINY
    )
    model = tiny_model("llama")
    lowbit.quantize(model, recipe, calibration=CALIBRATION, resume_dir=tmp_path)
    adapter = adapter_for(model)
    for view in adapter.blocks():  # QuaRot's structure: online down_proj, quantized linears
        assert isinstance(view.down_proj, FakeQuantLinear)
        assert isinstance(view.down_proj.input_transform, OnlineHadamard)
        assert view.q_proj.act_quantizer is not None and view.q_proj.act_quantizer.bits == 4
    assert model.lowbit_rotation_training.resumed_from == 0
    assert (tmp_path / "rotation" / "run.json").is_file()

    again = tiny_model("llama")  # the same run again: training and GPTQ both resume
    lowbit.quantize(again, recipe, calibration=CALIBRATION, resume_dir=tmp_path)
    assert again.lowbit_rotation_training.resumed_from == 6
    ids = CALIBRATION[:1, :20]
    assert torch.equal(_logits(model, ids), _logits(again, ids))


WEIGHT_ONLY = dict(a_bits=16, v_bits=16, train_w_bits=4)


@pytest.mark.parametrize(
    ("name", "settings", "bound"),
    [  # measured KL to float: 1.7e-4, 8.6e-4, 5.5e-4
        ("learn-rotate+spqr", WEIGHT_ONLY, 2e-3),
        ("learn-rotate+mixed", WEIGHT_ONLY, 5e-3),
        ("learn-rotate+gptq+kvquant", {}, 5e-3),
    ],
)
def test_composes_with_spqr_mixed_and_kvquant(name, settings, bound):
    model = tiny_model("llama")
    original = copy.deepcopy(model)
    recipe = get_recipe(name).with_settings(**settings, **TINY)
    lowbit.quantize(model, recipe, calibration=CALIBRATION)
    assert len(model.lowbit_rotation_training.losses) == TINY["steps"]
    for view in adapter_for(model).blocks():  # QuaRot's online transform stays in front
        assert isinstance(view.down_proj.input_transform, OnlineHadamard)
    ids = CALIBRATION[:1, :32]
    reference, got = _logits(original, ids), _logits(model, ids)
    kl = _kl(reference, got)
    assert 0 < kl < bound


def test_a_weight_only_composition_learns_with_the_weights_in_the_loop():
    recipe = get_recipe("learn-rotate+gptq").with_settings(**WEIGHT_ONLY, **TINY)
    model = tiny_model("llama")
    original = copy.deepcopy(model)
    lowbit.quantize(model, recipe, calibration=CALIBRATION)
    training = model.lowbit_rotation_training
    assert len(training.losses) == 6 and training.clip_ratios == []  # no activations: no clips
    view = adapter_for(model).block(0)
    assert isinstance(view.q_proj, FakeQuantLinear) and view.q_proj.act_quantizer is None
    ids = CALIBRATION[:1, :20]
    reference, got = _logits(original, ids), _logits(model, ids)
    kl = _kl(reference, got)
    assert 0 < kl < 5e-3  # 4-bit weights only; measured: 2.3e-4 (5.3e-4 without learn_scale)


def test_learned_clips_reach_the_weight_part_under_the_users_overrides():
    recipe = get_recipe("learn-rotate+rtn").with_settings(a_bits=4, learn_clip=True, **TINY)
    model = tiny_model("llama")
    mine = {"model.layers.0.mlp.down_proj": {"a_clip_ratio": 0.5}}
    lowbit.quantize(model, recipe, calibration=CALIBRATION, overrides=mine)
    clips = model.lowbit_rotation_training.clip_ratios
    assert len({round(c, 6) for layer in clips for c in layer.values()}) > 1  # per point
    for view in adapter_for(model).blocks():
        for point, names in ACTIVATION_POINTS.items():
            for name in names:
                want = 0.5 if (view.index, name) == (0, "down_proj") else clips[view.index][point]
                assert getattr(view, name).act_quantizer.clip_ratio == want


def test_fine_tuned_weights_are_fused_into_a_standard_rotated_model():
    """``learn_weights``: the deployed model has learn-rotate's modules, its weights carry ΔW
    (the function moves a little from the float model's), and the quantizers follow as usual."""
    recipe = get_recipe("learn-rotate+rtn+kv-int").with_settings(
        a_bits=4, learn_weights=True, weight_lr=1e-4, **TINY
    )
    model = tiny_model("llama")
    original = copy.deepcopy(model)
    lowbit.quantize(model, recipe, calibration=CALIBRATION)
    assert "fine-tuned weights" in model.lowbit_rotation.residual
    plain = copy.deepcopy(original)
    lowbit.quantize(plain, recipe.with_settings(learn_weights=False), calibration=CALIBRATION)
    assert {n: type(m) for n, m in model.named_modules()} == {
        n: type(m) for n, m in plain.named_modules()
    }
    ids = CALIBRATION[:1, :32]
    kl = _kl(_logits(original, ids), _logits(model, ids))
    assert 0 < kl < 0.05  # W4A4KV4 on the tiny model; measured: 1.3e-3

    float_model = copy.deepcopy(original)  # learn-rotate alone: ΔW is the only change
    lowbit.quantize(float_model, recipe.parts[0], calibration=CALIBRATION)
    kl = _kl(_logits(original, ids), _logits(float_model, ids))
    assert 1e-6 < kl < 1e-2  # measured: 8.1e-4 (six steps at weight_lr 1e-4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(a_bits=16, v_bits=16), "nothing to learn"),
        (dict(weight_lr=0.0), "weight_lr > 0"),
        (dict(steps=0), "steps >= 1"),
        (dict(a_bits=1), "a_bits must be between 2 and 8"),
        (dict(a_clip_ratio=1.5), r"a_clip_ratio must be in \(0, 1\]"),
        (dict(train_loss="mse"), "train_loss must be one of"),
        (dict(lr_schedule="step"), "lr_schedule must be one of"),
    ],
)
def test_bad_settings_are_one_sentence(settings, message):
    with pytest.raises(LowbitError, match=message):
        get_recipe("learn-rotate", **settings)


def test_calibration_shorter_than_seqlen_is_refused_before_any_work():
    model = tiny_model("llama")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(LowbitError, match="seqlen=64 tokens; the calibration samples have 48"):
        lowbit.quantize(model, get_recipe("learn-rotate", seqlen=64), calibration=CALIBRATION)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
