import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized
from lowbit.kernels import dispatch
from lowbit.models.tiny import tiny_model
from lowbit.nn.packed_linear import PackedLinear, set_backend


def _layer(backend="reference"):
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    q = IntQuantized.from_float(weight, 4, group_size=32, scale_dtype=torch.float16)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(1))
    return PackedLinear.from_quantized(q, bias, backend=backend)


class _Counting(dispatch.WeightBackend):
    """A test backend: the reference product, counting layout preparations; refuses M > 4."""

    name = "counting"

    def __init__(self):
        self.prepared = self.multiplied = 0

    def unsupported(self, layer, x):
        return f"it takes at most 4 rows, not {x.shape[0]}" if x.shape[0] > 4 else None

    def prepare(self, layer):
        self.prepared += 1
        return {"weight": layer.dequantize_weight()}

    def matmul(self, layer, x, prepared, bias):
        self.multiplied += 1
        return torch.nn.functional.linear(x, prepared["weight"].to(x.dtype), bias)


@pytest.fixture
def counting(monkeypatch):
    backend = _Counting()
    dispatch.register_backend(backend)
    monkeypatch.setitem(dispatch.AUTO_ORDER, "cpu", ("counting", "reference"))
    yield backend
    dispatch.BACKENDS.unregister(("counting", "int"))
    dispatch._RESOLVED.clear()


def test_auto_takes_the_first_backend_that_fits_and_prepares_once(counting):
    layer = _layer("auto")
    reference = _layer("reference")
    small, large = torch.randn(3, 64), torch.randn(2, 5, 64)  # M = 3, M = 10
    assert torch.equal(layer(small), reference(small))
    layer(small)
    assert counting.prepared == 1  # the layout is cached on the layer
    assert dispatch.choose(layer, small).name == "counting"
    assert dispatch.choose(layer, large.reshape(-1, 64)).name == "reference"  # refused: M = 10
    assert torch.equal(layer(large), reference(large))
    assert counting.multiplied == 2  # M = 10 went to the reference backend
    layer(small)  # back to M = 3: the counting backend again
    assert counting.multiplied == 3
    assert counting.prepared == 2  # one layout per layer: the reference's run replaced it


def test_the_choice_follows_the_backend_setting_dtype_and_buffers(counting):
    layer = _layer("counting")
    x = torch.randn(2, 64)
    layer(x)
    layer.backend = "reference"
    layer(x)
    assert counting.multiplied == 1  # the new setting took over at once
    layer.backend = "counting"
    layer(x)
    layer(x.bfloat16())  # another dtype: chosen again, the same layout
    assert counting.multiplied == 3 and counting.prepared == 2
    layer.__dict__.pop("_prepared")  # what a layout change (set_sparse_format) does
    layer(x)
    assert counting.prepared == 3


def test_a_forced_backend_that_cannot_run_says_why(counting):
    layer = _layer("counting")
    with pytest.raises(LowbitError, match="at most 4 rows, not 10"):
        layer(torch.randn(10, 64))


def test_unknown_backends_and_inputs_are_sentences():
    with pytest.raises(LowbitError, match="unknown backend 'fast'"):
        _layer("fast")
    with pytest.raises(LowbitError, match="fp16, bf16 or fp32"):
        _layer()(torch.ones(2, 64, dtype=torch.float64))
    with pytest.raises(LowbitError, match="unknown backend"):
        set_backend(tiny_model("llama"), "nope")


def test_set_backend_reaches_every_packed_linear():
    model = quantize(tiny_model("llama"), "w4a16", progress=False, packed=True)
    assert set_backend(model, "auto") == 14
    assert {m.backend for m in model.modules() if isinstance(m, PackedLinear)} == {"auto"}
