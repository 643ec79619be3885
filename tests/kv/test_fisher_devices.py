"""The KV Fisher pass block by block (how a model on the CPU calibrates on a GPU) against the
whole-model pass, and KVCalibration.to."""

import pytest
import torch

from lowbit.kv.fisher import collect_kv_fisher
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model


def _ids(samples: int = 4, seqlen: int = 48) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(3, 256, (samples, seqlen), generator=generator, device="cpu")


def _tensors(calib) -> list[torch.Tensor]:
    grads = (calib.key_grads or []) + (calib.value_grads or [])
    return [calib.positions, calib.samples, *calib.keys, *calib.values, *grads]


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: keys after k_norm
@pytest.mark.parametrize("gradients", [True, False])
def test_block_by_block_equals_the_whole_model_pass_bit_for_bit(family, gradients):
    model = tiny_model(family)
    adapter = adapter_for(model)
    whole = collect_kv_fisher(model, adapter, _ids(), max_tokens=100, gradients=gradients)
    blocks = collect_kv_fisher(
        model, adapter, _ids(), max_tokens=100, gradients=gradients, block_by_block=True
    )
    assert blocks.has_gradients == gradients
    for a, b in zip(_tensors(whole), _tensors(blocks), strict=True):
        assert torch.equal(a, b)
    assert all(p.requires_grad for p in model.parameters())  # restored
    assert all(p.grad is None for p in model.parameters())  # no parameter gradients formed


def test_calibration_moves_as_a_whole():
    model = tiny_model("llama")
    calib = collect_kv_fisher(model, adapter_for(model), _ids(), max_tokens=100)
    assert calib.device == torch.device("cpu") and calib.to("cpu") is calib
    moved = calib.to("meta")
    assert {t.device.type for t in _tensors(moved)} == {"meta"}
