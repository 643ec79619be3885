"""SpQR and 2/4/16 layers decoded for a CPU run: the same outputs, the packed buffers gone."""

import pytest
import torch

import lowbit
from lowbit.errors import LowbitError
from lowbit.eval.memory import memory_in_use, model_storage_bytes
from lowbit.io.compressed_tensors import plan_export
from lowbit.models.tiny import tiny_model
from lowbit.nn.decoded_linear import DecodedLinear, decode_for_run
from lowbit.nn.packed_linear import PackedLinear, PackedLinearBase, set_backend

IDS = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))
CALIB = torch.randint(3, 256, (8, 32), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("recipe", ["spqr", "mixed"])
def test_a_decoded_model_gives_the_backends_logits_in_less_memory(recipe, tmp_path):
    model = tiny_model("llama", intermediate_size=128)
    lowbit.quantize(model, recipe, calibration=CALIB, progress=False, packed=True)
    model.to(torch.bfloat16)
    set_backend(model, "torch-cpu")  # decodes the weight once per layer, beside the buffers
    expected = _logits(model)
    layers = sum(isinstance(m, PackedLinearBase) for m in model.modules())
    stored = model_storage_bytes(model)
    held = memory_in_use(model)  # packed buffers and the decoded copies

    assert decode_for_run(model) == layers > 0
    assert not any(isinstance(m, PackedLinearBase) for m in model.modules())
    assert torch.equal(_logits(model), expected)  # the same decoded weight, bit for bit
    assert model_storage_bytes(model) == stored  # it still counts what its format stores
    bf16 = tiny_model("llama", intermediate_size=128).to(torch.bfloat16)
    assert memory_in_use(model) <= memory_in_use(bf16) < held
    assert "decoded to bfloat16" in repr(model)

    with pytest.raises(LowbitError, match="decoded for the run"):
        lowbit.save(model, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    with pytest.raises(LowbitError, match="decoded for the run"):
        plan_export(model)


def test_only_bf16_and_fp16_cpu_runs_of_formats_without_a_kernel_are_decoded():
    model = tiny_model("llama", intermediate_size=128)
    lowbit.quantize(model, "spqr", calibration=CALIB, progress=False, packed=True)
    assert decode_for_run(model) == 0  # fp32: decoded per call, no copy kept
    set_backend(model, "reference")
    assert decode_for_run(model, torch.bfloat16) == 0  # a backend the user chose
    int4 = tiny_model("llama").to(torch.bfloat16)
    lowbit.quantize(int4, "w4a16", progress=False, packed=True)
    assert decode_for_run(int4) == 0  # torch's int4 kernel runs it packed
    assert any(isinstance(m, PackedLinear) for m in int4.modules())
    assert not any(isinstance(m, DecodedLinear) for m in int4.modules())
