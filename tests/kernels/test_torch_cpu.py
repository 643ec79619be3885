"""The torch-cpu backend against the reference backend: kernels, exact paths, refusals, eval."""

import json

import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized
from lowbit.kernels import dispatch
from lowbit.models.tiny import tiny_model
from lowbit.nn.packed_linear import PackedLinear, set_backend

N = 37  # not a multiple of the int4 kernel's 16 rows: padding is exercised
ROWS = (1, 3, 13, 64)

# |torch-cpu - reference| <= TOL * max|reference|, per input dtype. bf16: the kernel rounds each
# group's scale (and zero term) and the output to bf16, the reference rounds each weight to bf16:
# measured max 7.4e-3 over the cases below (the reference itself is 4.8e-3 from the fp32
# product). fp16: scales stay exact, measured max 9.1e-4. fp32 never reaches the kernels: the
# same arithmetic as the reference, equal bit for bit.
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}

# (bits, group, symmetric, K): the int4 kernel takes 2-4-bit groups of 32..256 (per channel
# becomes repeated groups of the largest that divides K), the int8 one symmetric channels with
# K % 8 == 0
KERNEL_FORMATS = [
    *[(4, 32, sym, k) for sym in (True, False) for k in (96, 128, 160)],
    *[(b, g, sym, 96) for b in (2, 3) for g in (32, None) for sym in (True, False)],
    *[(4, g, sym, 128) for g in (64, 128) for sym in (True, False)],
    *[(4, None, sym, k) for sym in (True, False) for k in (96, 128, 160)],
    *[(8, None, True, k) for k in (96, 128, 160)],
]
# 2-4- and 8-bit formats no kernel takes: the exact unpack path for every input dtype
EXACT_FORMATS = [
    (4, 16, True, 96), (4, 16, False, 160), (8, None, False, 96), (8, 32, True, 128),
    (2, 16, False, 96), (3, 16, True, 160),
]  # fmt: skip


def _layers(bits, group, symmetric, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(N, k, generator=gen), torch.randn(N, generator=gen)
    q = IntQuantized.from_float(
        weight, bits, group_size=group, symmetric=symmetric, scale_dtype=torch.float16
    )
    fast = PackedLinear.from_quantized(q, bias, backend="torch-cpu")
    return fast, PackedLinear.from_quantized(q, bias, backend="reference")


def _prepared(layer):
    (prepared,) = layer.__dict__["_prepared"].values()
    return prepared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bits, group, symmetric, k", KERNEL_FORMATS)
def test_kernel_formats_match_the_reference(bits, group, symmetric, k, dtype):
    fast, reference = _layers(bits, group, symmetric, k)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        got, want = fast(x), reference(x)  # [M, N]
        assert got.shape == (m, N) and got.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            err = (got.float() - want.float()).abs().max()
            assert err <= TOL[dtype] * want.float().abs().max(), (m, err)
    assert next(iter(_prepared(fast))) == ("int8" if bits == 8 else "int4")  # the kernel layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bits, group, symmetric, k", EXACT_FORMATS)
def test_formats_without_a_kernel_equal_the_reference_bit_for_bit(bits, group, symmetric, k, dtype):
    fast, reference = _layers(bits, group, symmetric, k)
    for m in ROWS:
        x = torch.randn(2, m, k).to(dtype)
        assert torch.equal(fast(x), reference(x))
    assert set(_prepared(fast)) == (set() if bits in (4, 8) else {"codes"})  # no kernel layout


@pytest.mark.parametrize("bits, symmetric", [(4, False), (4, True), (3, False), (2, True)])
def test_the_int4_layout_decodes_each_code_exactly(bits, symmetric):
    """With fp32 inputs the int4 kernel itself decodes (c' - 8) * s + z exactly: feeding it the
    identity gives back the reference's weight (fp32 never takes this path in matmul)."""
    fast, reference = _layers(bits, 32, symmetric, 96)
    fast(torch.randn(1, 96, dtype=torch.bfloat16))
    p = _prepared(fast)
    eye = torch.eye(96)
    decoded = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, p["int4"], 32, p["scale_zero"])
    assert torch.equal(decoded[:, :N].T, reference.dequantize_weight())


@pytest.mark.parametrize("bits", [5, 6, 7])
def test_other_widths_are_refused_in_a_sentence_and_auto_falls_back(bits):
    fast, reference = _layers(bits, 32, True, 96)
    x = torch.randn(3, 96)
    with pytest.raises(LowbitError, match=f"2-4- and 8-bit weights only, and this one has {bits}"):
        fast(x)
    fast.backend = "auto"
    assert dispatch.choose(fast, x).name == "reference"
    assert torch.equal(fast(x), reference(x))


def test_auto_takes_torch_cpu_on_the_cpu():
    fast, _ = _layers(4, 32, True, 96)
    fast.backend = "auto"
    for dtype in (torch.float32, torch.bfloat16):
        assert dispatch.choose(fast, torch.randn(1, 96, dtype=dtype)).name == "torch-cpu"


def test_a_bf16_model_runs_on_the_kernels_like_the_reference():
    """A whole tiny llama in bf16, W4 g32 packed: logits within bf16 reach of the reference."""
    model = tiny_model("llama").to(torch.bfloat16)
    quantize(model, "w4a16", progress=False, packed=True)
    # the recipe's default is per channel; K = 96 and 160 are multiples of 32
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        set_backend(model, "reference")
        want = model(ids).logits.float()
        set_backend(model, "torch-cpu")
        got = model(ids).logits.float()
    # measured max 0.0078 = 0.0042 of max|logit| (1.87): the two bf16 products differ by rounding
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lowbit.data import pydoc_text

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(pydoc_text("eval")[:20000])
    return path


def test_eval_with_torch_cpu_gives_the_reference_perplexity(tiny_model_dir, corpus, tmp_path):
    """A saved W4 g32 model and a simulated W8 one (packed by --backend): fp32 inputs
    (``--dtype float32``) take the exact path, so the perplexity is the reference's to every
    digit. Left to itself the saved model runs in bf16, on the kernel, and says so."""
    from lowbit.cli import main

    packed = tmp_path / "w4"
    common = ["--dataset", str(corpus), "--seqlen", "64", "--windows", "2", "--no-progress"]
    assert main(["quantize", "--model", str(tiny_model_dir), "--recipe", "w4a16-g64",
                 "--set", "w_group=32", "--seqlen", "64", "--out", str(packed),
                 "--no-progress"]) == 0  # fmt: skip
    rows = {}
    for model, recipe in ((packed, []), (tiny_model_dir, ["--recipe", "w8a16"])):
        for backend in ("reference", "torch-cpu"):
            out = tmp_path / f"{model.name}-{backend}.json"
            args = ["eval", "--model", str(model), *recipe, *common, "--backend", backend,
                    "--dtype", "float32"]  # fmt: skip
            assert main([*args, "--json", str(out)]) == 0
            rows[model.name, backend] = json.loads(out.read_text())
    for model in (packed, tiny_model_dir):
        assert rows[model.name, "torch-cpu"]["ppl"] == rows[model.name, "reference"]["ppl"]
        assert rows[model.name, "torch-cpu"]["backend"] == "torch-cpu"
        assert rows[model.name, "torch-cpu"]["dtype"] == "float32"
    out = tmp_path / "bf16.json"
    assert main(["eval", "--model", str(packed), *common, "--json", str(out)]) == 0
    bf16 = json.loads(out.read_text())
    assert bf16["dtype"] == "bfloat16"
    # measured 375.0105 against 375.0130 in fp32: bf16 activations, the same packed weights
    assert bf16["ppl"] == pytest.approx(rows[packed.name, "reference"]["ppl"], rel=1e-3)


def test_eval_names_an_unknown_backend(tiny_model_dir, corpus, capsys):
    from lowbit.cli import main

    assert main(["eval", "--model", str(tiny_model_dir), "--backend", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown backend 'fast'" in err
