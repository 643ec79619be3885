"""Projections of one input multiplied in one kernel call: the same outputs, fewer calls."""

import pytest
import torch

import lowbit
from lowbit.formats.intq import IntQuantized
from lowbit.kernels import torch_cpu
from lowbit.models.run import prepare_run, share_projection_inputs
from lowbit.models.tiny import tiny_model
from lowbit.nn.packed_linear import PackedLinear, set_backend
from lowbit.nn.shared_input import share_input

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def _count_kernel_calls(monkeypatch) -> list[int]:
    calls = [0]
    kernel = torch_cpu._kernel_matmul

    def counted(x, prepared):
        calls[0] += 1
        return kernel(x, prepared)

    monkeypatch.setattr(torch_cpu, "_kernel_matmul", counted)
    return calls


W3 = {"w_bits": 3, "w_group": 32}


@pytest.mark.parametrize("family, recipe, settings", [
    ("llama", "w4a16", {}), ("qwen2", "w4a16", {}), ("llama", "w8a16", {}), ("mistral", "rtn", W3),
])  # fmt: skip
def test_a_shared_call_gives_every_projection_its_own_output(family, recipe, settings, monkeypatch):
    """qwen2's q/k/v have biases; w8a16 runs on the int8 kernel, 3 bits on the int4 one."""
    model = tiny_model(family).to(torch.bfloat16)
    lowbit.quantize(model, lowbit.get_recipe(recipe, **settings), progress=False, packed=True)
    set_backend(model, "auto")
    calls = _count_kernel_calls(monkeypatch)
    with torch.no_grad():
        expected = model(IDS).logits
        per_layer = calls[0]
        layers = model.config.num_hidden_layers
        assert prepare_run(model).shared == 2 * layers
        calls[0] = 0
        assert torch.equal(model(IDS).logits, expected)  # bit for bit
    assert per_layer == 7 * layers and calls[0] == 4 * layers  # q/k/v and gate/up: one call each


def test_fp32_inputs_take_each_layers_exact_path():
    model = tiny_model("llama")
    lowbit.quantize(model, "w4a16", progress=False, packed=True)
    set_backend(model, "auto")
    with torch.no_grad():
        expected = model(IDS).logits
        assert share_projection_inputs(model) == 2 * model.config.num_hidden_layers
        assert torch.equal(model(IDS).logits, expected)


def _pair(bits=4, k=64):
    gen = torch.Generator().manual_seed(bits)
    layers = []
    for n in (40, 24):  # not multiples of the int4 kernel's 16 rows
        q = IntQuantized.from_float(torch.randn(n, k, generator=gen), bits, group_size=32)
        layers.append(PackedLinear.from_quantized(q, backend="torch-cpu"))
    return layers


def test_an_input_changed_in_place_or_another_tensor_is_computed_afresh():
    q, k = _pair()
    alone = [layer(torch.zeros(1, 64, dtype=torch.bfloat16)) for layer in _pair()]  # warm
    assert share_input([q, k]) is not None
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want_q, want_k = (layer(x.clone()) for layer in _pair())
    assert torch.equal(q(x), want_q)
    x.add_(1.0)  # k is asked after its input changed: its output is of the new input
    assert torch.equal(k(x), _pair()[1](x.clone()))
    y = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(k(y), _pair()[1](y)) and torch.equal(q(y), _pair()[0](y))
    assert torch.equal(k(x), _pair()[1](x))  # twice in a row: computed again
    del alone, want_k


def test_layers_with_their_own_input_transform_are_not_grouped():
    q, k = _pair()
    k.input_transform = torch.nn.Identity()
    assert share_input([q, k]) is None and "shared_input" not in q.__dict__
    assert share_input([q]) is None


def test_a_model_with_shared_inputs_saves_and_loads_the_same(tmp_path):
    model = tiny_model("llama")
    lowbit.quantize(model, "w4a16", progress=False, packed=True)
    lowbit.save(model, tmp_path / "before")
    prepare_run(model)
    lowbit.save(model, tmp_path / "after")  # the buffers are untouched
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "before" / name).read_bytes() == (tmp_path / "after" / name).read_bytes()
    with torch.no_grad():
        loaded = lowbit.load(tmp_path / "after")  # bf16, the dtype it records
        set_backend(loaded, "auto")
        expected = loaded(IDS).logits
        prepare_run(loaded)
        assert torch.equal(loaded(IDS).logits, expected)
