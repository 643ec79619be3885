"""A weight format added from outside lowbit's integer code goes through every generic path.

``ToyQuantized`` (int8 codes with one fp16 scale per row) stands for the formats SpQR and 2/4/16
add: its spec quantizes through the weight driver, its packed module registers itself, and then
pack/unpack, the backend dispatch by format kind, checkpoints and resume directories handle it
without knowing it. Every comparison is bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import lowbit
from lowbit.algorithms.weights import quantize_linears
from lowbit.calibrate.resume import BlockCheckpoints
from lowbit.errors import LowbitError
from lowbit.kernels import dispatch
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.nn import packed_linear
from lowbit.nn.packed_linear import (
    PackedLinear,
    PackedLinearBase,
    pack_model,
    unpack_model,
)
from lowbit.nn.quant_linear import FakeQuantLinear
from lowbit.nn.spec import MODULES, register_module
from lowbit.recipes.registry import get_recipe


@dataclass
class ToyQuantized:
    codes: Tensor  # [out, in] int8
    scale: Tensor  # [out] fp16
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return (self.codes.float() * self.scale.float()[:, None]).to(dtype or self.dtype)

    def storage_bits(self) -> int:
        return self.codes.numel() * 8 + self.scale.numel() * 16

    def to(self, device) -> ToyQuantized:
        return dataclasses.replace(self, codes=self.codes.to(device), scale=self.scale.to(device))


@dataclass(frozen=True)
class ToySpec:
    def check(self, weight: Tensor, name: str) -> None:
        if weight.shape[1] > 4096:
            raise LowbitError(f"{name} is too wide for the toy format")

    def describe(self) -> str:
        return "toy int8"

    def rtn(self, weight: Tensor) -> ToyQuantized:
        scale = (weight.abs().amax(1) / 127).clamp_min(1e-8).half()  # [out]
        codes = (weight / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        return ToyQuantized(codes, scale)

    def gptq(self, weight, hessian, options):
        container = self.rtn(weight)
        return container, container.dequantize(), 0.0

    def guard_candidate(self, weight):
        return None

    def matches(self, weight: Any) -> bool:
        return isinstance(weight, ToyQuantized)


class ToyLinear(PackedLinearBase):
    format_kind = "toy"
    container_type = ToyQuantized
    format_fields = {}  # no settings beyond the ones every packed linear has

    def __init__(self, in_features, out_features, *, weight_dtype=torch.float32, bias=False,
                 input_transform=None, act_quantizer=None, backend="reference"):  # fmt: skip
        super().__init__()
        self._init_linear(
            in_features, out_features, weight_dtype=weight_dtype, bias=bias,
            input_transform=input_transform, act_quantizer=act_quantizer, backend=backend,
            device=None,
        )  # fmt: skip
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float16))

    @classmethod
    def from_quantized(cls, weight, bias=None, *, input_transform=None, act_quantizer=None,
                       weight_dtype=None, backend="reference"):  # fmt: skip
        out_features, in_features = weight.shape
        layer = cls(
            in_features, out_features, weight_dtype=weight_dtype or weight.dtype,
            bias=bias is not None, input_transform=input_transform,
            act_quantizer=act_quantizer, backend=backend,
        )  # fmt: skip
        layer.codes, layer.scale = weight.codes.clone(), weight.scale.clone()
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer.to(weight.codes.device)

    @property
    def quantized_weight(self) -> ToyQuantized:
        return ToyQuantized(self.codes, self.scale, self.weight_dtype)

    def format_spec(self):
        return {}

    def weight_format(self) -> str:
        return "toy int8"


@pytest.fixture
def toy_format():
    register_module(ToyLinear)  # what ``@register_module`` on the class does
    yield
    MODULES.unregister("ToyLinear")


def _toy_model(algo="rtn", calibration=None):
    model = tiny_model("llama")
    quantize_linears(
        model, adapter_for(model), spec_for=lambda fqn: ToySpec(), algo=algo,
        calibration=calibration, progress=False,
    )  # fmt: skip
    model.lowbit_recipe = get_recipe("rtn", w_bits=8)  # a label: saving records a recipe
    return model


def _ids(n=2, seqlen=12, seed=0):
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def test_the_driver_quantizes_with_any_spec(toy_format):
    model = _toy_model("gptq", calibration=_ids(4, 16))
    linears = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    assert len(linears) == 14
    assert all(isinstance(m.quantized_weight, ToyQuantized) for m in linears)
    assert all(torch.equal(m.weight, m.quantized_weight.dequantize()) for m in linears)


def test_pack_dispatch_and_unpack_handle_a_new_format(toy_format):
    model, ids = _toy_model(), _ids()
    expected = model(ids).logits
    assert pack_model(model) == 14
    layers = [m for m in model.modules() if isinstance(m, ToyLinear)]
    assert len(layers) == 14 and not any(isinstance(m, PackedLinear) for m in model.modules())
    assert torch.equal(model(ids).logits, expected)
    layer, x = layers[0], torch.randn(3, layers[0].in_features)
    assert dispatch.choose(layer, x).name == "reference"  # auto: no toy kernel on the CPU
    layer.backend = "torch-cpu"
    with pytest.raises(LowbitError, match="backend 'torch-cpu' has no kernel for toy weights"):
        layer(x)
    layer.backend = "reference"
    assert unpack_model(model) == 14
    assert torch.equal(model(ids).logits, expected)


def test_a_saved_model_of_a_new_format_loads_with_the_same_logits(toy_format, tmp_path):
    model, ids = _toy_model(), _ids()
    expected = model(ids).logits
    lowbit.save(model, tmp_path / "toy")
    loaded = lowbit.load(tmp_path / "toy", dtype=torch.float32)
    assert sum(isinstance(m, ToyLinear) for m in loaded.modules()) == 14
    assert torch.equal(loaded(ids).logits, expected)


def test_resume_directories_store_any_packed_format(toy_format, tmp_path):
    weight = ToySpec().rtn(torch.randn(5, 7))
    store = BlockCheckpoints(tmp_path / "run", {"part": 1})
    store.save(0, [{"name": "a", "algo": "gptq"}], {"a": weight})
    layers, quantized = store.load(0)
    assert layers == [{"name": "a", "algo": "gptq"}]
    assert torch.equal(quantized["a"].codes, weight.codes)
    assert torch.equal(quantized["a"].scale, weight.scale)


def test_a_container_without_a_packed_format_is_a_sentence():
    with pytest.raises(LowbitError, match="no packed linear for a ToyQuantized weight"):
        packed_linear.packed_format_for(ToySpec().rtn(torch.randn(2, 3)))
