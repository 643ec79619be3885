"""The ``mixed`` recipe through lowbit's generic paths: quantize, pack, backends, save/load,
composition, per-layer overrides and ``lowbit generate`` (tiny llama: widths 96 and 160, so
the 4-bit groups are 25 % of 6 or 10 groups and the layout pads words B)."""

import pytest
import torch

import lowbit
from lowbit.errors import LowbitError
from lowbit.formats.mixed import MixedQuantized
from lowbit.kernels.dispatch import choose
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.nn.mixed_linear import MixedLinear
from lowbit.nn.packed_linear import pack_model, unpack_model
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.recipes.registry import PRESETS, get_recipe, recipe_from_dict


def _ids(n=4, seqlen=32, seed=0):
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def quantized():
    """A tiny llama quantized with the preset of Li et al., 2024 (GPTQ), and its calibration ids."""
    model, ids = tiny_model("llama"), _ids()
    lowbit.quantize(model, "mixed-2-4-16", calibration=ids, progress=False)
    return model, ids


def test_preset_and_settings():
    recipe = get_recipe("mixed-2-4-16")
    assert PRESETS["mixed-2-4-16"][0] == "mixed"
    assert (recipe.frac_4bit, recipe.outlier_fraction, recipe.g2) == (0.25, 0.002, 16)
    assert recipe.needs_calibration and not get_recipe("mixed", w_algo="rtn").needs_calibration
    assert recipe_from_dict(recipe.to_dict()) == recipe
    for bad in ({"frac_4bit": "1.5"}, {"outlier_fraction": "0.1"}, {"g2": "0"},
                {"qat_steps": "-1"}, {"w_algo": "awq"}):  # fmt: skip
        with pytest.raises(LowbitError):
            get_recipe("mixed", **bad)


def test_quantize_pack_and_back_bit_for_bit(quantized):
    model, ids = quantized
    linears = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    assert len(linears) == 14
    assert all(isinstance(m.quantized_weight, MixedQuantized) for m in linears)
    assert all(torch.equal(m.weight, m.quantized_weight.dequantize()) for m in linears)
    bits = sum(m.storage_bits() for m in linears) / sum(m.weight.numel() for m in linears)
    # measured 4.27: on 32-160-row matrices of 96-160 columns the CSR row pointers (32 bits a
    # row), the second order (32 bits per 16 rows and group) and the padded words weigh more
    assert 4.0 < bits < 4.5
    with torch.no_grad():
        expected = model(ids).logits
        assert pack_model(model) == 14
        layers = [m for m in model.modules() if isinstance(m, MixedLinear)]
        assert len(layers) == 14 and layers[0].weight_format().startswith("mixed 2/4-bit")
        assert torch.equal(model(ids).logits, expected)
        assert sum(m.storage_bits() for m in layers) == sum(m.storage_bits() for m in linears)
        assert unpack_model(model) == 14
        assert torch.equal(model(ids).logits, expected)


def test_save_and_load(quantized, tmp_path):
    model, ids = quantized
    with torch.no_grad():
        expected = model(ids).logits
    lowbit.save(model, tmp_path / "mixed")
    loaded = lowbit.load(tmp_path / "mixed", dtype=torch.float32)
    assert sum(isinstance(m, MixedLinear) for m in loaded.modules()) == 14
    assert loaded.lowbit_recipe.method == "mixed"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


def test_cpu_backend_keeps_the_reference_weight(quantized):
    model, _ = quantized
    layer = model.model.layers[1].mlp.down_proj
    mixed = MixedLinear.from_quantized(layer.quantized_weight).to(torch.bfloat16)
    x = torch.randn(3, mixed.in_features, generator=torch.Generator().manual_seed(5))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        mixed.backend = "reference"
        want = mixed(x)
        mixed.backend = "auto"  # the CPU's first choice: torch-cpu, the decoded weight kept
        assert choose(mixed, x).name == "torch-cpu"
        assert torch.equal(mixed(x), want)
        (prepared,) = mixed._prepared.values()
        assert torch.equal(prepared["weight:torch.bfloat16"], mixed.dequantize_weight(x.dtype))
        assert torch.equal(mixed(x), want)  # from the kept weight


@pytest.mark.interpreter
def test_triton_backend_matches_the_reference(quantized):
    pytest.importorskip("triton")
    model, ids = quantized
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = model.model.layers[1].mlp.down_proj  # 160 wide: words A and B
    mixed = MixedLinear.from_quantized(layer.quantized_weight).to(device).half()
    for rows in (1, 20):  # the GEMV kernel; above 16 rows the decode-then-F.linear path
        x = torch.randn(rows, mixed.in_features, device=device).half()
        mixed.backend = "reference"
        want = mixed(x)
        mixed.backend = "triton"
        got = mixed(x)
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert err <= 2e-3  # measured 7.3e-4 (M = 1) and 0 (M = 20: the reference decode)


def test_rtn_overrides_and_refusals():
    model = tiny_model("llama")
    overrides = {"*.mlp.down_proj": {"frac_4bit": 1.0}, "*.self_attn.q_proj": {"frac_4bit": 0.0}}
    lowbit.quantize(model, get_recipe("mixed", w_algo="rtn"), overrides=overrides, progress=False)
    down = model.model.layers[0].mlp.down_proj.quantized_weight
    q = model.model.layers[0].self_attn.q_proj.quantized_weight
    up = model.model.layers[0].mlp.up_proj.quantized_weight
    assert down.n4 == down.groups and q.n4 == 0 and up.n4 == 2  # 25 % of 6 groups: 1.5 -> 2
    with pytest.raises(LowbitError, match="cannot be overridden per layer"):
        lowbit.quantize(tiny_model("llama"), get_recipe("mixed", w_algo="rtn"),
                        overrides={"*": {"damp": 0.1}}, progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def rotated_mixed():
    """The tiny llama under ``rotate+mixed`` (RTN) alone, and its calibration ids."""
    ids = _ids(4, 48)  # kvquant's Fisher pass takes >= 128 tokens
    model = lowbit.quantize(tiny_model("llama"), get_recipe("rotate+mixed", w_algo="rtn"),
                            calibration=ids, progress=False)  # fmt: skip
    return model, ids


@pytest.mark.parametrize(
    "kv, settings",
    [("kv-int", {}), ("kivi", {"group": 16}), ("kvquant", {}), ("ksort-bfp", {"block": 16})],
)  # groups and blocks within the tiny model's 16-wide heads
def test_composes_with_rotation_and_every_kv_recipe(rotated_mixed, kv, settings):
    alone, ids = rotated_mixed
    recipe = get_recipe(f"rotate+mixed+{kv}", w_algo="rtn", **settings)
    model = lowbit.quantize(tiny_model("llama"), recipe, calibration=ids, progress=False)
    linears = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    assert all(isinstance(m.quantized_weight, MixedQuantized) for m in linears)
    assert any(m.input_transform is not None for m in linears)  # the rotation's Hadamards
    alone_linears = [m for m in alone.modules() if isinstance(m, FakeQuantLinear)]
    for mine, theirs in zip(linears, alone_linears, strict=True):
        assert torch.equal(mine.weight, theirs.weight)  # the KV part leaves the weights alone
    adapter = adapter_for(model)
    kv_alone = get_recipe(kv, **settings).kv_bytes_per_token(adapter, 64)
    assert recipe.kv_bytes_per_token(adapter, 64) == kv_alone
    cache = model.lowbit_make_cache()
    assert cache is not None
    with torch.no_grad():
        cached = model(ids[:1, :8], past_key_values=cache, use_cache=True).logits  # [1, 8, V]
        one_pass = model(ids[:1, :8]).logits  # the KV quantizers simulated in one pass
        weights_only = alone(ids[:1, :8]).logits
    assert torch.equal(cached, one_pass)  # through the packed cache, bit for bit
    assert not torch.equal(cached, weights_only)  # and the KV part acts


def test_generate_from_the_cli(capsys, tiny_model_dir):
    from lowbit.cli import main

    code = main(["generate", "--model", str(tiny_model_dir), "--recipe", "mixed-2-4-16",
                 "--set", "w_algo=rtn", "--prompt", "The module", "--max-new-tokens", "6",
                 "--no-progress"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip() and "6 new tokens" in captured.err


def test_resume_restores_mixed_blocks_bit_for_bit(tmp_path, monkeypatch):
    from lowbit.algorithms.mixed import MixedWeightSpec

    ids = _ids(4, 16)
    first = tiny_model("llama")
    lowbit.quantize(first, "mixed-2-4-16", calibration=ids, progress=False,
                    resume_dir=tmp_path / "run")  # fmt: skip
    again = tiny_model("llama")  # every block is restored from the directory, none quantized

    def refuse(*args, **kwargs):
        raise AssertionError("a finished block was quantized again")

    monkeypatch.setattr(MixedWeightSpec, "gptq", refuse)
    lowbit.quantize(again, "mixed-2-4-16", calibration=ids, progress=False,
                    resume_dir=tmp_path / "run")  # fmt: skip
    for (name, a), (_, b) in zip(first.named_modules(), again.named_modules(), strict=True):
        if isinstance(a, FakeQuantLinear):
            assert torch.equal(a.weight, b.weight), name
            assert a.storage_bits() == b.storage_bits()
