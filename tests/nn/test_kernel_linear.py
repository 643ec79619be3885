"""Packed layers that a kernel with a layout of its own runs (torch's on the CPU, Triton's on a
GPU) kept as that layout alone for a run: the same outputs, the projections of one input in one
call, less memory."""

import copy

import pytest
import torch

import lowbit
from lowbit.errors import LowbitError
from lowbit.eval.memory import memory_in_use, model_storage_bytes, parameter_count
from lowbit.formats.intq import IntQuantized
from lowbit.kernels import torch_cpu
from lowbit.models.run import RunPreparation, prepare_run
from lowbit.models.tiny import tiny_model
from lowbit.nn import run_linear
from lowbit.nn.packed_linear import PackedLinear, PackedLinearBase, set_backend
from lowbit.nn.run_linear import KernelLinear, kernel_form

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def _count_kernel_calls(monkeypatch) -> list[int]:
    calls = [0]
    kernel = torch_cpu._kernel_matmul

    def counted(x, prepared):
        calls[0] += 1
        return kernel(x, prepared)

    monkeypatch.setattr(torch_cpu, "_kernel_matmul", counted)
    return calls


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


W3 = {"w_bits": 3, "w_group": 32}


@pytest.mark.parametrize("family, recipe, settings", [
    ("llama", "w4a16", {}), ("qwen2", "w4a16", {}), ("llama", "w8a16", {}), ("mistral", "rtn", W3),
])  # fmt: skip
def test_the_kernel_form_gives_the_packed_logits_in_fewer_calls_and_less_memory(
    family, recipe, settings, monkeypatch
):
    """qwen2's q/k/v have biases; w8a16 runs on the int8 kernel, 3 bits on the int4 one."""
    model = tiny_model(family).to(torch.bfloat16)
    lowbit.quantize(model, lowbit.get_recipe(recipe, **settings), progress=False, packed=True)
    set_backend(model, "auto")
    calls = _count_kernel_calls(monkeypatch)
    expected = _logits(model)
    per_layer = calls[0]
    held = memory_in_use(model)  # packed buffers and the kernel's layouts beside them
    stored, params = model_storage_bytes(model), parameter_count(model)
    layers = model.config.num_hidden_layers

    assert prepare_run(model) == RunPreparation(0, 7 * layers, 2 * layers)
    assert not any(isinstance(m, PackedLinearBase) for m in model.modules())
    calls[0] = 0
    assert torch.equal(_logits(model), expected)  # bit for bit
    assert per_layer == 7 * layers and calls[0] == 4 * layers  # q/k/v and gate/up: one call each
    assert model_storage_bytes(model) == stored and parameter_count(model) == params
    assert memory_in_use(model) < held
    assert "one call with 2 others" in repr(model.model.layers[0].self_attn.q_proj)


def test_a_w8_run_holds_less_than_the_bf16_model():
    """The int8 kernel's codes replace the packed ones: 1 byte per weight, not 2."""
    bf16 = tiny_model("llama", hidden_size=192, intermediate_size=512).to(torch.bfloat16)
    model = tiny_model("llama", hidden_size=192, intermediate_size=512).to(torch.bfloat16)
    lowbit.quantize(model, "w8a16", progress=False, packed=True)
    prepare_run(model)
    linear_bytes = sum(
        m.weight.numel() * 2 for m in bf16.modules() if isinstance(m, torch.nn.Linear)
    )
    saved = memory_in_use(bf16) - memory_in_use(model)
    assert saved > 0.45 * linear_bytes  # about half of the linears' bf16 bytes (0.5 less scales)


def test_fp32_runs_keep_the_packed_layers():
    model = tiny_model("llama")
    lowbit.quantize(model, "w4a16", progress=False, packed=True)
    assert prepare_run(model) == RunPreparation(0, 0, 0)  # the exact fp32 path reads the codes


def _pair(bits=4, k=64):
    gen = torch.Generator().manual_seed(bits)
    layers = []
    for n in (40, 24):  # not multiples of the int4 kernel's 16 rows
        q = IntQuantized.from_float(torch.randn(n, k, generator=gen), bits, group_size=32)
        layers.append(PackedLinear.from_quantized(q, backend="torch-cpu"))
    return layers


def _in_kernel_form(layers):
    model = torch.nn.Sequential(*layers)
    assert kernel_form(model, [list(layers)], torch.bfloat16) == (len(layers), len(layers) > 1)
    return list(model)


def test_an_input_changed_in_place_or_another_tensor_is_computed_afresh():
    q, k = _in_kernel_form(_pair())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want_q, want_k = (layer(x.clone()) for layer in _pair())
    assert torch.equal(q(x), want_q)
    x.add_(1.0)  # k is asked after its input changed: its output is of the new input
    assert torch.equal(k(x), _pair()[1](x.clone()))
    y = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(k(y), _pair()[1](y)) and torch.equal(q(y), _pair()[0](y))
    assert torch.equal(k(x), _pair()[1](x))  # twice in a row: computed again
    del want_k


def test_fp32_inputs_run_the_kernels_fp32_path():
    (q,) = _in_kernel_form(_pair()[:1])
    x = torch.randn(3, 64)
    error = (q(x) - _pair()[0](x)).abs().max().item()
    assert q(x).dtype == torch.float32 and error < 1e-4  # measured 4.8e-06


def test_layers_with_their_own_input_transform_are_converted_one_by_one():
    q, k = _pair()
    k.input_transform = torch.nn.Identity()
    model = torch.nn.Sequential(q, k)
    assert kernel_form(model, [[q, k]], torch.bfloat16) == (2, 0)
    assert all(len(m.layout.columns) == 1 for m in model)


def test_a_run_form_refuses_to_be_saved_or_moved(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    lowbit.quantize(model, "w4a16", progress=False, packed=True)
    prepare_run(model)
    assert isinstance(model.model.layers[0].mlp.down_proj, KernelLinear)
    with pytest.raises(LowbitError, match="prepared for the run"):
        lowbit.save(model, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    model.to(torch.float32)  # a cast stays on the CPU: the kernels' fp32 paths
    assert torch.isfinite(_logits(model)).all()
    with pytest.raises(LowbitError, match="load the checkpoint again on the other device"):
        model.to("meta")


def test_a_loaded_model_prepared_for_its_run_gives_the_packed_logits(tmp_path):
    model = tiny_model("llama")
    lowbit.quantize(model, "w4a16", progress=False, packed=True)
    lowbit.save(model, tmp_path / "ck")
    loaded = lowbit.load(tmp_path / "ck")  # bf16, the dtype it records
    set_backend(loaded, "auto")
    expected = _logits(loaded)
    assert prepare_run(loaded).kernel == 7 * model.config.num_hidden_layers
    assert torch.equal(_logits(loaded), expected)


def test_prepare_run_makes_every_layout_before_the_first_call():
    """A compiled step under CUDA graphs must allocate nothing it keeps: the layouts exist
    before the first forward, and the forward keeps them as they are."""
    model = tiny_model("llama")
    lowbit.quantize(model, "w4a16", progress=False, packed=True)
    prepare_run(model)
    layers = [m for m in model.modules() if isinstance(m, PackedLinearBase)]
    before = [(layer.__dict__["_prepared"], dict(layer.__dict__["_prepared"])) for layer in layers]
    _logits(model)
    for layer, (cache, entries) in zip(layers, before, strict=True):
        assert layer.__dict__["_prepared"] is cache and cache == entries


def _triton_model(settings):
    pytest.importorskip("triton")
    model = tiny_model("llama").to(torch.float16)
    lowbit.quantize(model, lowbit.get_recipe("rtn", **settings), progress=False, packed=True)
    set_backend(model, "triton")  # on the CPU: Triton's interpreter (tests/conftest.py)
    return model


@pytest.mark.parametrize(
    "settings", [{"w_bits": 4, "w_group": 32}, {"w_bits": 3, "w_group": 32, "w_symmetric": False}]
)
def test_the_triton_kernel_form_holds_the_tiled_words_alone_and_gives_the_packed_logits(settings):
    """The run form a GPU gets: the Triton kernels' tiled words and transposed statistics alone,
    q/k/v and gate/up stacked; the interpreter's launch is the same for the stacked N, so every
    output is the packed layer's bit for bit (decode rows and prefill rows)."""
    model = _triton_model(settings)
    ids = IDS[:1, :1]  # one token: the decode kernel's GEMV
    with torch.no_grad():
        expected, expected_prefill = model(ids).logits, model(IDS).logits
    held = memory_in_use(model)  # bit streams and tiled words side by side
    packed = sum(buffer.nbytes for m in model.modules() if isinstance(m, PackedLinearBase)
                 for name, buffer in m.named_buffers() if name != "bias")  # fmt: skip
    layers = model.config.num_hidden_layers
    assert prepare_run(model) == RunPreparation(0, 7 * layers, 2 * layers)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, KernelLinear) and down.layout.backend.name == "triton"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
        assert torch.equal(model(IDS).logits, expected_prefill)
    # released: the packed bit streams and [N, G] statistics, all of them; the tiled words and
    # transposed statistics, now stacked, are as many bytes as the layers' own layouts were
    assert memory_in_use(model) == held - packed


def test_a_compiled_kernel_form_is_one_opaque_op_per_member_and_one_product_per_input(
    monkeypatch, recording_compile
):
    """Each member is its own node (the compiler would not merge identical calls), and the
    stacked product is still computed once per input at run time."""
    model = _triton_model({"w_bits": 4, "w_group": 32})
    prepare_run(model)
    ids = IDS[:1, :4]
    with torch.no_grad():
        eager = model(ids).logits
    products = []
    backend = type(model.model.layers[0].mlp.down_proj.layout.backend)
    matmul_layout = backend.matmul_layout

    def counted(self, x, prepared):
        products.append(1)
        return matmul_layout(self, x, prepared)

    monkeypatch.setattr(backend, "matmul_layout", counted)
    compiled, graphs = recording_compile(model)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, eager)
    layers = model.config.num_hidden_layers
    assert len(graphs) == 1 and graphs[0].count("lowbit.layout_matmul(") == 7 * layers
    assert len(products) == 4 * layers  # q/k/v, o, gate/up, down
    copied = copy.deepcopy(model)  # a copy's layouts have handles of their own
    layout = copied.model.layers[0].mlp.down_proj.layout
    assert run_linear._LAYOUTS[id(layout)] is layout


@pytest.mark.gpu
def test_a_w4_run_on_cuda_holds_the_tiled_words_alone():
    model = tiny_model("llama", hidden_size=256, intermediate_size=512).to("cuda", torch.float16)
    lowbit.quantize(model, "w4a16-g128", progress=False, packed=True)
    ids = IDS.cuda()
    with torch.no_grad():
        expected = model(ids).logits
    held = memory_in_use(model)
    assert prepare_run(model).kernel == 7 * model.config.num_hidden_layers
    with torch.no_grad():
        got = model(ids).logits
    # the stacked launches may split their fp32 sums otherwise; not yet measured on a GPU
    assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()
    assert memory_in_use(model) < 0.62 * held
    with pytest.raises(LowbitError, match="load the checkpoint again on the other device"):
        model.cpu()
