import copy

import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized, fake_quant_int
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.registry import get_recipe

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
IDS = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_rtn_weights_equal_the_packed_format_bit_for_bit(family):
    model = tiny_model(family)
    original = copy.deepcopy(model)
    quantize(model, get_recipe("rtn", w_bits="4", w_group="32"), progress=False)
    layer = model.get_submodule("model.layers.1.mlp.down_proj")
    assert isinstance(layer, FakeQuantLinear)
    source = original.get_submodule("model.layers.1.mlp.down_proj").weight
    packed = IntQuantized.from_float(
        source, 4, symmetric=True, axis=-1, group_size=32, scale_dtype=torch.float16
    )
    assert torch.equal(layer.weight, packed.dequantize())
    assert layer.storage_bits() == packed.storage_bits()
    assert model.lowbit_recipe.w_group == 32


@pytest.mark.parametrize("family", FAMILIES)
def test_unquantized_settings_change_nothing(family):
    model = tiny_model(family)
    expected = model(IDS).logits
    # every layer left in float by an override (a whole-model recipe that does nothing is refused)
    quantize(model, get_recipe("rtn"), overrides={"*": {"w_bits": 16}}, progress=False)
    assert torch.equal(model(IDS).logits, expected)


def test_activation_quantizer_sees_each_linear_input():
    model = tiny_model("llama")
    seen = {}
    quantize(model, get_recipe("rtn", w_bits="16", a_bits="4"), progress=False)
    layer = model.get_submodule("model.layers.0.self_attn.o_proj")

    def capture(module, args, output):  # returns None, so the output is left alone
        seen.setdefault("x", args[0].clone())

    layer.register_forward_hook(capture)
    model(IDS)
    x = seen["x"]
    expected = torch.nn.functional.linear(fake_quant_int(x, 4, axis=-1), layer.weight)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def test_rtn_error_against_float_is_small_at_8_bits_and_larger_at_3():
    model = tiny_model("llama")
    reference = torch.log_softmax(model(IDS).logits, -1)

    def kl(recipe):
        m = quantize(copy.deepcopy(model), recipe, progress=False)
        logprobs = torch.log_softmax(m(IDS).logits, -1)
        return torch.nn.functional.kl_div(
            logprobs, reference, log_target=True, reduction="batchmean"
        ).item()

    kl8, kl3 = kl(get_recipe("w8a8")), kl(get_recipe("rtn", w_bits="3"))
    assert kl8 < 1e-3  # measured 8.0e-5 on this tiny model
    assert kl3 > 10 * kl8  # measured 7.5e-2


def test_filter_and_overrides():
    model = tiny_model("llama")
    quantize(
        model,
        get_recipe("rtn", w_bits="4"),
        filter_fn=lambda module, fqn: "mlp" in fqn,
        overrides={"model.layers.1.*": {"w_bits": 8}},
        progress=False,
    )
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), torch.nn.Linear)
    assert model.get_submodule("model.layers.0.mlp.up_proj").weight_format.startswith("int4")
    assert model.get_submodule("model.layers.1.mlp.up_proj").weight_format.startswith("int8")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"overrides": {"model.layers.9.*": {"w_bits": 8}}}, "matches no layer"),
        ({"overrides": {"model.layers.0.*": {"w_bits": 1}}}, "w_bits must be between"),
        ({"calibration": torch.zeros(2, 3)}, "token ids"),
        ({"calibration": torch.full((2, 8), 256)}, r"token id 256, outside .* \(0 to 255\)"),
        ({"calibration": torch.full((2, 8), -1)}, "token id -1, outside this model's vocab"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(LowbitError, match=message):
        quantize(tiny_model("llama"), "rtn", progress=False, **kwargs)


def test_group_that_does_not_divide_names_the_layer():
    with pytest.raises(LowbitError, match="does not divide the input width 96 of model.layers.0"):
        quantize(tiny_model("llama"), get_recipe("w4a16-g64"), progress=False)


def test_quantizing_twice_is_refused():
    model = quantize(tiny_model("llama"), "rtn", progress=False)
    with pytest.raises(LowbitError, match="already quantized"):
        quantize(model, "rtn", progress=False)
