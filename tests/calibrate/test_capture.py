import pytest
import torch
from torch import nn

from lowbit.calibrate.capture import (
    block_linears,
    calibrate_layer_by_layer,
    capture_first_block_inputs,
)
from lowbit.calibrate.hessian import AllInputsSeen, HessianAccumulator, HessianCollector
from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def calibration_tokens(n: int = 3, seqlen: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def whole_model_hessians(model, adapter, tokens) -> dict[str, torch.Tensor]:
    """Reference: every linear's input Hessian from plain forward passes of the whole model."""
    linears = {n: model.get_submodule(n) for n in adapter.linear_names()}
    with HessianCollector(linears) as collector, torch.no_grad():
        for i in range(tokens.shape[0]):
            collector.new_sample()
            model(tokens[i : i + 1], use_cache=False)
    return {n: a.hessian() for n, a in collector.accumulators.items()}


def no_hooks_left(model: nn.Module) -> bool:
    return all(
        not m._forward_hooks and not m._forward_pre_hooks and not m._forward_hooks_with_kwargs
        for m in model.modules()
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_by_layer_hessians_and_outputs_equal_the_float_model(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    tokens = calibration_tokens()
    expected = whole_model_hessians(model, adapter, tokens)
    got, groups = {}, []

    def record(index, collector):
        got.update({n: a.hessian() for n, a in collector.accumulators.items()})
        groups.append([[n.rsplit(".", 1)[1] for n in g] for g in collector.groups()])

    last = calibrate_layer_by_layer(
        model, adapter, tokens, record, propagate_last=True, progress=False
    )
    assert got.keys() == expected.keys()
    for name in expected:  # nothing is quantized: every block sees the float model's inputs
        assert torch.equal(got[name], expected[name]), name
    assert groups[0] == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"]] + [
        ["down_proj"]
    ]
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(last.hidden))  # [N, S, V]
        assert torch.equal(logits, model(tokens, use_cache=False).logits)
    assert no_hooks_left(model)


def test_sequential_pipeline_propagates_the_quantized_block():
    # replacing block 0's down_proj changes block 1's Hessians to what the changed block gives
    model = tiny_model("llama")
    adapter = adapter_for(model)
    tokens = calibration_tokens()
    got = {}

    def halve_down_proj(index, collector):
        got.update({n: a.hessian() for n, a in collector.accumulators.items()})
        name = f"{adapter.block_prefix(index)}.mlp.down_proj"
        down = model.get_submodule(name)
        replace_module(model, name, FakeQuantLinear(down.weight * 0.5, down.bias))

    calibrate_layer_by_layer(model, adapter, tokens, halve_down_proj, progress=False)
    expected = whole_model_hessians(model, adapter, tokens)  # the model with both blocks changed
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sequential", [True, False])
def test_hessian_pass_stops_once_every_input_is_seen(sequential):
    # sequential: the Hessian pass ends at down_proj's input (its product is never computed),
    # the propagation pass runs the whole block; one pass per block runs it whole, once
    model = tiny_model("llama")
    adapter = adapter_for(model)
    tokens = calibration_tokens(n=3)
    calls = []
    for index in range(adapter.num_layers):
        down = model.get_submodule(f"{adapter.block_prefix(index)}.mlp.down_proj")
        down.register_forward_hook(lambda *_, index=index: calls.append(index))
    got = {}

    def record(index, collector):
        got.update({n: a.hessian() for n, a in collector.accumulators.items()})

    calibrate_layer_by_layer(
        model, adapter, tokens, record, sequential=sequential, propagate_last=True, progress=False
    )
    assert calls == [0, 0, 0, 1, 1, 1]  # one down_proj product per sample and block
    expected = whole_model_hessians(model, adapter, tokens)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_collector_raises_after_the_last_input_of_the_sample():
    model = tiny_model("qwen3")
    adapter = adapter_for(model)
    linears = block_linears(model, adapter, 0)
    x = adapter.embed_tokens(calibration_tokens(n=1))  # [1, S, hidden]
    block = adapter.blocks_module[0]
    kwargs = capture_first_block_inputs(model, adapter, calibration_tokens(n=1)).kwargs
    with HessianCollector(linears, stop_when_complete=True) as collector, torch.no_grad():
        for _ in range(2):  # each sample starts a new count
            collector.new_sample()
            with pytest.raises(AllInputsSeen):
                block(x, **kwargs)
    assert set(collector.accumulators) == set(linears)
    assert collector.accumulators[next(iter(linears))].tokens() == 2 * x.shape[1]
    assert no_hooks_left(model)


def test_hessian_is_taken_after_the_input_transform():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    rotation = torch.linalg.qr(torch.randn(96, 96, generator=torch.Generator().manual_seed(1)))[0]
    transform = nn.Linear(96, 96, bias=False)
    transform.weight.data = rotation
    name = "model.layers.0.self_attn.q_proj"
    q = model.get_submodule(name)
    replace_module(
        model, name, FakeQuantLinear(q.weight @ rotation.T, None, input_transform=transform)
    )
    tokens = calibration_tokens()
    plain = {}

    def record(index, collector):
        if index == 0:
            plain.update({n: a.hessian() for n, a in collector.accumulators.items()})

    calibrate_layer_by_layer(model, adapter, tokens, record, progress=False)
    # q reads R x: its Hessian is R H Rᵀ; k and v (no transform) keep H and share it
    k_hessian = plain["model.layers.0.self_attn.k_proj"]
    torch.testing.assert_close(plain[name], rotation @ k_hessian @ rotation.T, rtol=1e-4, atol=1e-4)


def test_heldout_samples_go_to_their_own_split():
    model = tiny_model("qwen2")
    adapter = adapter_for(model)
    tokens = calibration_tokens(n=5, seqlen=12)
    counts = []

    def record(index, collector):
        acc = collector.accumulators[f"{adapter.block_prefix(index)}.mlp.down_proj"]
        counts.append((acc.tokens("train"), acc.tokens("heldout")))

    calibrate_layer_by_layer(model, adapter, tokens, record, heldout=2, progress=False)
    assert counts == [(36, 24), (36, 24)]
    with pytest.raises(LowbitError, match="no calibration sample"):
        calibrate_layer_by_layer(model, adapter, tokens, record, heldout=5, progress=False)


def test_hooks_are_removed_when_the_callback_fails():
    model = tiny_model("mistral")
    adapter = adapter_for(model)

    def fail(index, collector):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        calibrate_layer_by_layer(model, adapter, calibration_tokens(), fail, progress=False)
    assert no_hooks_left(model)


def test_capture_keeps_first_block_inputs_and_shared_kwargs():
    model = tiny_model("qwen3")
    adapter = adapter_for(model)
    tokens = calibration_tokens(n=2, seqlen=16)
    inputs = capture_first_block_inputs(model, adapter, tokens)
    assert inputs.hidden.shape == (2, 16, 96)
    torch.testing.assert_close(inputs.hidden, adapter.embed_tokens(tokens), rtol=0, atol=0)
    cos, sin = inputs.kwargs["position_embeddings"]
    assert cos.shape == (1, 16, 16)
    # no cache, under this transformers' name for it only (both names would warn)
    names = [k for k in ("cache", "past_key_values") if k in inputs.kwargs]
    assert len(names) == 1 and inputs.kwargs[names[0]] is None
    assert no_hooks_left(model)
    assert list(block_linears(model, adapter, 1))[0] == "model.layers.1.self_attn.q_proj"
    with pytest.raises(LowbitError, match="long tensor"):
        capture_first_block_inputs(model, adapter, tokens.float())


def test_accumulator_matches_the_definition():
    x = torch.randn(3, 7, 5)
    accumulator = HessianAccumulator(5)
    accumulator.add(x[:2])
    accumulator.add(x[2:])
    flat = x.reshape(-1, 5)
    torch.testing.assert_close(accumulator.hessian(), 2 * flat.T @ flat / 21)
    with pytest.raises(LowbitError, match="heldout"):
        accumulator.hessian("heldout")


def test_the_hessian_is_the_scaled_sum_itself_taken_once():
    """No copy of a width² matrix beside the sum: the same tensor each time, equal bit for bit to
    scaling a copy, and no tokens added after it was taken."""
    x = torch.randn(2, 9, 6)
    accumulator = HessianAccumulator(6)
    accumulator.add(x)
    flat = x.reshape(-1, 6)
    summed = flat.T @ flat
    accumulator._sums["train"].copy_(summed)  # the sum addmm_ gave, to compare one scaling
    first = accumulator.hessian()
    assert torch.equal(first, summed * (2.0 / 18))
    assert accumulator.hessian() is first
    assert torch.equal(accumulator.hessian(), summed * (2.0 / 18))  # not scaled twice
    with pytest.raises(LowbitError, match="taken already"):
        accumulator.add(x)


def test_the_heldout_split_keeps_rows_until_they_outgrow_the_sum():
    """Below ``width`` tokens the held-out split holds its rows (no width² sum), and its output
    errors equal ``tr(ΔW H ΔWᵀ) / 2`` over the same tokens; past ``width`` tokens it is a sum."""
    torch.manual_seed(0)
    width = 40
    x = torch.randn(3, 9, width)  # 27 tokens: fewer than width
    delta = torch.randn(7, width)  # ΔW [out, in]
    accumulator = HessianAccumulator(width)
    accumulator.add(x[:1], "heldout")
    accumulator.add(x[1:], "heldout")
    assert "heldout" not in accumulator._sums
    flat = x.reshape(-1, width).double()
    hessian = 2 * flat.T @ flat / 27
    expected = 0.5 * float(((delta.double() @ hessian) * delta.double()).sum())
    # float32 products over 40 inputs against the float64 reference: ~1e-7 relative
    assert accumulator.output_error(delta) == pytest.approx(expected, rel=1e-5)
    # the Hessian asked for afterwards is the same sum, built from the rows
    torch.testing.assert_close(accumulator.hessian("heldout"), hessian.float())
    assert "heldout" not in accumulator._rows

    grown = HessianAccumulator(width)
    samples = torch.randn(5, 9, width)
    for sample in samples:  # 45 tokens: the fifth sample passes width
        grown.add(sample, "heldout")
    assert "heldout" in grown._sums and "heldout" not in grown._rows
    assert grown.tokens("heldout") == 45
    flat = samples.reshape(-1, width).double()
    expected = float((flat @ delta.double().T).square().sum()) / 45
    assert grown.output_error(delta) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(LowbitError, match="'train'"):
        grown.output_error(delta, "train")


def test_a_replaced_blocks_linears_are_let_go_when_its_turn_ends():
    """A callback that replaces a block's linears (as GPTQ does) must leave the walk holding no
    reference to the old ones: streamed, each kept an 8B block's float32 weights (0.87 GB)
    resident until the walk ended."""
    import gc
    import weakref

    model = tiny_model("llama")
    adapter = adapter_for(model)
    replaced: list[list[weakref.ref]] = []
    alive_at_next_block = []

    def replace(index, collector):
        gc.collect()
        if replaced:
            alive_at_next_block.append(sum(ref() is not None for ref in replaced[-1]))
        refs = []
        for name, module in collector.linears.items():
            replace_module(model, name, nn.Linear(module.in_features, module.out_features))
            refs.append(weakref.ref(module))
        replaced.append(refs)

    calibrate_layer_by_layer(model, adapter, calibration_tokens(), replace, progress=False)
    assert len(replaced) == adapter.num_layers == 2 and len(replaced[0]) == 7
    assert alive_at_next_block == [0]
