import copy

import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.eval.memory import memory_report
from lowbit.formats.intq import IntQuantized
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.nn.act_quant import ActivationQuantizer
from lowbit.nn.packed_linear import PackedLinear, pack_model, unpack_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.registry import get_recipe
from lowbit.transforms.hadamard import OnlineHadamard

IDS = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(1))


def _weight(out_features=37, in_features=96, seed=0):
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_simulated_bit_for_bit(bits, group, symmetric, dtype):
    weight = _weight()
    q = IntQuantized.from_float(
        weight, bits, symmetric=symmetric, group_size=group, scale_dtype=torch.float16
    )
    bias = torch.randn(37)
    transform = OnlineHadamard(96, group_size=32)
    act = ActivationQuantizer(6)
    simulated = FakeQuantLinear(
        q.dequantize(dtype), bias.to(dtype), quantized_weight=q, input_transform=transform,
        act_quantizer=act,
    )  # fmt: skip
    packed = PackedLinear.from_quantized(
        q, bias.to(dtype), input_transform=transform, act_quantizer=act, weight_dtype=dtype,
        backend="reference",  # the oracle; "auto" (the default) is tested against it
    )  # fmt: skip
    x = torch.randn(3, 5, 96).to(dtype)  # [B, S, in]
    assert torch.equal(packed(x), simulated(x))
    assert torch.equal(packed.dequantize_weight(), simulated.weight)
    assert packed.storage_bits() == simulated.storage_bits()


def test_buffers_hold_the_packed_bits():
    q = IntQuantized.from_float(_weight(), 4, group_size=32, scale_dtype=torch.float16)
    layer = PackedLinear.from_quantized(q)
    assert layer.qdata.dtype == torch.uint8 and layer.qdata.numel() == 37 * 96 // 2
    assert layer.scale.dtype == torch.float16 and layer.scale.shape == (37, 3)
    assert layer.zero is None and not any(True for _ in layer.parameters())
    # 4-bit codes + one fp16 scale per 32 weights: the memory held is the analytic storage
    assert layer.memory_bytes() * 8 == layer.storage_bits() == 37 * 96 * 4 + 37 * 3 * 16


def test_asymmetric_zero_points_are_uint8():
    q = IntQuantized.from_float(_weight(), 3, symmetric=False, scale_dtype=torch.float16)
    layer = PackedLinear.from_quantized(q)
    assert layer.zero.dtype == torch.uint8 and layer.zero.shape == (37, 1)
    assert torch.equal(layer.zero.float(), q.zero)


@pytest.mark.parametrize("recipe", ["w4a16-g64", "w4a4", "w8a16", "quarot-rtn"])
def test_pack_model_keeps_the_logits_bit_for_bit(recipe):
    model = tiny_model("qwen2")
    quantize(model, get_recipe(recipe, w_group="32") if "g64" in recipe else recipe,
             progress=False)  # fmt: skip
    expected = model(IDS).logits
    bits_before = memory_report(model, adapter_for(model))
    assert pack_model(model) == 14
    assert not any(isinstance(m, FakeQuantLinear) and m.quantized_weight is not None
                   for m in model.modules())  # fmt: skip
    assert torch.equal(model(IDS).logits, expected)
    after = memory_report(model, adapter_for(model))
    assert after.bits_per_weight == bits_before.bits_per_weight
    assert after.model_bytes == bits_before.model_bytes
    assert unpack_model(model) == 14
    assert torch.equal(model(IDS).logits, expected)


def test_quantize_packed_frees_the_float_weights():
    model = tiny_model("llama")
    simulated = quantize(copy.deepcopy(model), "w4a16", progress=False)
    packed = quantize(model, "w4a16", progress=False, packed=True)
    assert torch.equal(packed(IDS).logits, simulated(IDS).logits)
    names = adapter_for(packed).linear_names()
    held = sum(packed.get_submodule(n).memory_bytes() for n in names)
    floats = sum(simulated.get_submodule(n).weight.numel() * 4 for n in names)
    # 4-bit codes and an fp16 scale per row, against fp32 weights: 96-160 wide rows
    assert held < floats / 7


@pytest.mark.parametrize("recipe", ["w4a16", "mixed"])
def test_a_dtype_cast_of_the_model_keeps_the_stored_scales(recipe, tmp_path):
    """``model.to(torch.bfloat16)`` casts the rest of the model, never the fp16 scales; a save
    then records bf16, and the loaded tensors equal the saved ones."""
    import lowbit

    recipe = get_recipe("mixed", w_algo="rtn") if recipe == "mixed" else get_recipe(recipe)
    model = quantize(tiny_model("llama"), recipe, progress=False, packed=True)
    names = adapter_for(model).linear_names()
    weights = {n: model.get_submodule(n).dequantize_weight(torch.float32) for n in names}
    floats = {n: {b: t.dtype for b, t in model.get_submodule(n).named_buffers()
                  if t.is_floating_point()} for n in names}  # fmt: skip
    assert {torch.float16} == {d for f in floats.values() for d in f.values()}
    model.to(torch.bfloat16)
    for name in names:
        layer = model.get_submodule(name)
        assert {b: t.dtype for b, t in layer.named_buffers() if t.is_floating_point()} == floats[
            name
        ]
        assert torch.equal(layer.dequantize_weight(torch.float32), weights[name])
    assert model.model.norm.weight.dtype == torch.bfloat16  # the rest of the model is cast
    lowbit.save(model, tmp_path / "bf16")
    loaded = lowbit.load(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16  # the dtype saved is the model's, not its config's
    stored = loaded.state_dict()
    assert all(torch.equal(t, stored[k]) and t.dtype == stored[k].dtype
               for k, t in model.state_dict().items())  # fmt: skip


def test_bad_construction_is_a_sentence():
    with pytest.raises(LowbitError, match="2-8 bit"):
        PackedLinear(8, 8, bits=1)
    with pytest.raises(LowbitError, match="does not divide"):
        PackedLinear(96, 8, bits=4, group_size=40)
    q = IntQuantized.from_float(_weight(), 4, scale_bits=4)
    with pytest.raises(LowbitError, match="double-quantized"):
        PackedLinear.from_quantized(q)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_linear_on_cuda_matches_the_cpu(dtype):
    q = IntQuantized.from_float(_weight(4096, 4096), 4, group_size=128, scale_dtype=torch.float16)
    layer = PackedLinear.from_quantized(q, weight_dtype=dtype)
    x = torch.randn(5, 4096, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = layer(x.float()).double()  # fp32 on the CPU
    got = layer.to("cuda")(x.cuda()).double().cpu()
    # the same weights; only the GEMM's rounding differs (fp16/bf16 inputs and outputs).
    # Tolerance 1 % of the output's scale; not yet measured on a GPU.
    assert (got - expected).abs().max() < 1e-2 * expected.abs().max()


def test_a_compiled_model_keeps_each_packed_linear_as_one_opaque_op(recording_compile):
    """torch.compile sees lowbit.packed_matmul once per packed linear, in one graph, and the
    compiled model gives the eager logits bit for bit (a recording backend: no codegen)."""
    import copy

    model = quantize(tiny_model("llama"), "w4a16", progress=False, packed=True)
    model = model.to(torch.bfloat16)  # the torch-cpu kernels' dtype
    ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids).logits
    compiled, graphs = recording_compile(model)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, eager)
    assert len(graphs) == 1 and graphs[0].count("lowbit.packed_matmul") == 14
    copied = copy.deepcopy(model)  # a copy's layers have handles of their own
    handles = {m._handle for m in model.modules() if isinstance(m, PackedLinear)}
    assert handles.isdisjoint(m._handle for m in copied.modules() if isinstance(m, PackedLinear))
