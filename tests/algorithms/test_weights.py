import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowbit.algorithms.gptq import GPTQSettings
from lowbit.algorithms.int_spec import IntWeightSpec
from lowbit.algorithms.rtn import rtn_quantize
from lowbit.algorithms.weights import quantize_linears
from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module

SPEC = IntWeightSpec(4, 32)


def calibration(n: int = 8, seqlen: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def kl_to(model, reference, tokens) -> float:
    with torch.no_grad():
        logp = F.log_softmax(model(tokens).logits, -1)
        ref = F.log_softmax(reference(tokens).logits, -1)
    return F.kl_div(
        logp.flatten(0, 1), ref.flatten(0, 1), log_target=True, reduction="batchmean"
    ).item()


class CountingQuantizer(nn.Module):
    """An identity 'activation quantizer' that counts its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


def test_rtn_path_equals_rtn_quantize_and_attaches_act_quantizers():
    model = tiny_model("qwen2")
    original = tiny_model("qwen2")
    adapter = adapter_for(model)
    report = quantize_linears(
        model, adapter, spec_for=lambda fqn: SPEC, algo="rtn",
        act_quantizer_for=lambda fqn: CountingQuantizer(), progress=False,
    )  # fmt: skip
    assert report.wins() == {"rtn": 14}
    for name in adapter.linear_names():
        layer, before = model.get_submodule(name), original.get_submodule(name)
        packed = rtn_quantize(before.weight.detach(), SPEC)
        assert torch.equal(layer.weight, packed.dequantize())
        assert layer.quantized_weight.storage_bits() == packed.storage_bits()
        assert isinstance(layer.act_quantizer, CountingQuantizer)


def test_gptq_beats_rtn_on_a_tiny_model_and_calibrates_with_float_activations():
    reference = tiny_model("llama")
    rtn_model, gptq_model = tiny_model("llama"), tiny_model("llama")
    quantizers = {}

    def act_quantizer_for(fqn):
        quantizers[fqn] = CountingQuantizer()
        return quantizers[fqn]

    quantize_linears(
        rtn_model, adapter_for(rtn_model), spec_for=lambda f: SPEC, algo="rtn", progress=False
    )
    report = quantize_linears(
        gptq_model, adapter_for(gptq_model), spec_for=lambda f: SPEC, algo="gptq",
        calibration=calibration(), act_quantizer_for=act_quantizer_for,
        gptq=GPTQSettings(guard=False), progress=False,
    )  # fmt: skip
    assert report.wins() == {"gptq": 14} and report.heldout_samples == 0
    assert all(q.calls == 0 for q in quantizers.values())  # attached after calibration
    tokens = calibration(4, 48, seed=1)
    rtn_kl, gptq_kl = kl_to(rtn_model, reference, tokens), kl_to(gptq_model, reference, tokens)
    assert gptq_kl < 0.9 * rtn_kl  # measured 0.000276 vs 0.000342 (ratio 0.81)
    assert all(q.calls == 1 for q in quantizers.values())  # and used at run time
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in gptq_model.modules())


@pytest.mark.parametrize("scale_rule", ["absmax", "absmax_half"])
def test_guard_keeps_rtn_when_gptq_is_made_worse(monkeypatch, scale_rule):
    real = IntWeightSpec.gptq

    def gptq_with_wrong_hessian(spec, weight, hessian, settings):
        # a Hessian of unrelated, strongly correlated data: GPTQ optimises for the wrong inputs
        g = torch.Generator().manual_seed(7)
        x = torch.randn(64, weight.shape[1], generator=g).cumsum(1)
        return real(spec, weight, 2 * x.T @ x / 64, settings)

    monkeypatch.setattr(IntWeightSpec, "gptq", gptq_with_wrong_hessian)
    model, original = tiny_model("mistral"), tiny_model("mistral")
    spec = dataclasses.replace(SPEC, scale_rule=scale_rule)
    report = quantize_linears(
        model, adapter_for(model), spec_for=lambda f: spec, calibration=calibration(),
        gptq=GPTQSettings(guard=True), progress=False,
    )  # fmt: skip
    assert report.wins() == {"rtn": 14}
    assert report.wins_by_kind()["down_proj"] == {"rtn": 2}
    assert report.calibration_samples == 7 and report.heldout_samples == 1
    assert all(layer.rtn_error < layer.gptq_error for layer in report.layers)
    name = "model.layers.1.mlp.up_proj"
    # the RTN candidate rounds with the absmax rule whatever GPTQ's is
    expected = rtn_quantize(original.get_submodule(name).weight.detach(), SPEC).dequantize()
    assert torch.equal(model.get_submodule(name).weight, expected)


def test_guard_with_real_gptq_mostly_keeps_gptq():
    model = tiny_model("llama")
    report = quantize_linears(
        model, adapter_for(model), spec_for=lambda f: SPEC, calibration=calibration(),
        gptq=GPTQSettings(guard=True), progress=False,
    )  # fmt: skip
    assert report.wins().get("gptq", 0) >= 10  # measured 12 of 14 (both down_proj keep RTN)
    assert "gptq" in report.summary()


def test_input_transform_is_kept_and_unselected_layers_stay_float():
    model = tiny_model("qwen3")
    adapter = adapter_for(model)
    name = "model.layers.0.mlp.down_proj"
    down = model.get_submodule(name)
    transform = nn.Identity()
    replace_module(model, name, FakeQuantLinear(down.weight, None, input_transform=transform))
    untouched = "model.layers.1.self_attn.o_proj"
    before = model.get_submodule(untouched).weight.clone()
    report = quantize_linears(
        model, adapter, spec_for=lambda f: None if "q_proj" in f else SPEC,
        calibration=calibration(4), filter_fn=lambda module, fqn: fqn != untouched,
        gptq=GPTQSettings(guard=False, sequential=False), progress=False,
    )  # fmt: skip
    assert model.get_submodule(name).input_transform is transform
    assert report.wins() == {"gptq": 11, "float": 2}
    assert isinstance(model.get_submodule(untouched), nn.Linear)
    assert torch.equal(model.get_submodule(untouched).weight, before)
    assert model.get_submodule("model.layers.0.self_attn.q_proj").weight_format == "float"


def test_bad_input_raises():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    with pytest.raises(LowbitError, match="calibration"):
        quantize_linears(model, adapter, spec_for=lambda f: SPEC, algo="gptq", progress=False)
    with pytest.raises(LowbitError, match="at least 2"):
        quantize_linears(
            model, adapter, spec_for=lambda f: SPEC, calibration=calibration(1), progress=False
        )
    with pytest.raises(LowbitError, match="'rtn' or 'gptq'"):
        quantize_linears(model, adapter, spec_for=lambda f: SPEC, algo="awq", progress=False)
    with pytest.raises(LowbitError, match="does not divide"):
        quantize_linears(
            model, adapter, spec_for=lambda f: IntWeightSpec(4, 64), algo="rtn", progress=False
        )
