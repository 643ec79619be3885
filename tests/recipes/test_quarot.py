import copy

import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.eval.evaluate import FloatReference, evaluate
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.registry import get_recipe

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
IDS = torch.randint(3, 256, (2, 48), generator=torch.Generator().manual_seed(0))
CALIBRATION = torch.randint(3, 256, (8, 48), generator=torch.Generator().manual_seed(1))


def model_with_outlier_channel(family="llama"):
    """A tiny model whose residual stream has one large channel, as trained LLMs do."""
    model = tiny_model(family)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 5] *= 200.0
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_rotated_unquantized_model_keeps_its_logits(family):
    model = tiny_model(family)
    expected = model(IDS).logits
    recipe = get_recipe("quarot", w_bits="16", a_bits="16", kv_bits="16")
    quantize(model, recipe, progress=False)
    with torch.no_grad():
        delta = (model(IDS).logits - expected).abs().max().item()
    assert delta < 1e-4  # measured 7.2e-7 (llama)


def test_the_pieces_are_installed():
    model = quantize(tiny_model("llama"), get_recipe("quarot", w_algo="rtn"), progress=False)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    q = model.get_submodule("model.layers.1.self_attn.q_proj")
    assert isinstance(down, FakeQuantLinear) and down.input_transform is not None
    assert q.act_quantizer.bits == 4 and q.act_quantizer.clip_ratio == 0.9
    assert q.weight_format.startswith("int4 per-channel sym, mse-clip")
    assert model.lowbit_rotation.o_proj_hadamard == "full"  # 6 heads: no H_6, but H_96 exists
    assert model.lowbit_kv is not None and model.lowbit_weight_report.wins() == {"rtn": 14}
    assert isinstance(model.lm_head, torch.nn.Linear)  # lm_head stays in float


def test_unset_clips_take_the_papers_value_up_to_4_bits_only():
    def clips(**settings):
        recipe = get_recipe("quarot", **settings)
        kv = recipe.kv_recipe()
        return (
            recipe.act_quantizer().clip_ratio,
            kv.key_quantizer().clip_ratio,
            kv.value_quantizer().clip_ratio,
        )

    assert clips() == (0.9, 0.95, 0.95)
    assert clips(a_bits=8, kv_bits=8) == (1.0, 1.0, 1.0)
    assert clips(a_bits=3, k_bits=6, v_bits=2) == (0.9, 1.0, 0.95)
    assert clips(a_bits=8, a_clip_ratio=0.8, kv_bits=6, kv_clip_ratio=0.9) == (0.8, 0.9, 0.9)
    assert get_recipe("rtn", a_bits=4).act_quantizer().clip_ratio == 1.0  # rtn: no paper clip


def test_rotation_beats_no_rotation_when_activations_have_outliers():
    model = model_with_outlier_channel()
    reference = FloatReference(model)
    windows = IDS

    def kl(**settings):
        recipe = get_recipe("quarot", w_algo="rtn", w_mse_clip=False, **settings)
        quantized = quantize(copy.deepcopy(model), recipe, progress=False)
        return evaluate(quantized, windows, reference=reference, progress=False).kl

    rotated, plain = kl(), kl(rotation="none")
    assert rotated < 0.2 * plain  # measured 7.4e-5 vs 3.3e-3 (W4A4KV4, RTN, no clip search)


def test_gptq_with_guard_reports_its_choices():
    model = quantize(
        model_with_outlier_channel("qwen2"),
        get_recipe("quarot", a_bits="16", kv_bits="16"),
        calibration=CALIBRATION,
        progress=False,
    )
    wins = model.lowbit_weight_report.wins()
    assert sum(wins.values()) == 14 and set(wins) <= {"gptq", "rtn"}


def test_kv_bits_sets_both_and_bytes_come_from_the_cache_layout():
    from lowbit.eval.memory import memory_report
    from lowbit.models.adapter import adapter_for

    recipe = get_recipe("quarot", w_algo="rtn", kv_bits="3")
    assert recipe.kv_recipe().key_bits() == recipe.kv_recipe().value_bits() == 3
    model = quantize(tiny_model("llama"), recipe, progress=False)
    report = memory_report(model, adapter_for(model), kv_context=2048)
    # K and V x 2 layers x 2 KV heads, per token: 16 channels x 3 bits packed in 6 bytes, an fp16
    # scale and a uint8 zero point
    assert report.kv_bytes_per_token == 2 * 2 * 2 * (16 * 3 / 8 + 2 + 1)


def test_gptq_needs_calibration():
    with pytest.raises(LowbitError, match="needs calibration"):
        quantize(tiny_model("llama"), get_recipe("quarot"), progress=False)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rotation": "diagonal"}, "rotation"),
        ({"w_algo": "awq"}, "w_algo"),
        ({"kv_bits": "9"}, "kv_bits must be between 2 and 8"),
        ({"a_bits": "1"}, "a_bits must be between 2 and 8"),
    ],
)
def test_bad_settings(settings, message):
    with pytest.raises(LowbitError, match=message):
        get_recipe("quarot", **settings)
