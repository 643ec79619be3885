"""The triton SpQR backend's per-tensor outlier layout: profiled once, cached, overridable."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.algorithms.spqr import SpQRSpec  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels import triton_spqr  # noqa: E402
from lowbit.nn.spqr_linear import SpQRLinear  # noqa: E402

CUDA = torch.device("cuda")


def _layer(seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(32, 48, generator=gen)
    return SpQRLinear.from_quantized(SpQRSpec(outlier_fraction=0.05).rtn(weight))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend to profile on a GPU: the timing is replaced by a recorder answering ptcsr."""
    calls = []
    monkeypatch.setattr(triton_spqr, "interpreting", lambda: False)
    monkeypatch.setattr(triton_spqr, "_SPARSE_CHOICE", {})
    monkeypatch.setattr(triton_spqr, "_profile", lambda layer, *a: calls.append(layer) or "ptcsr")
    monkeypatch.delenv("LOWBIT_SPQR_SPARSE", raising=False)
    monkeypatch.delenv("LOWBIT_TRITON_TUNE", raising=False)
    return calls


def test_auto_profiles_once_per_tensor_pattern(fake_gpu):
    layer, same, other = _layer(), _layer(), _layer(seed=1)
    choose = triton_spqr.choose_sparse_format
    assert choose(layer, layer.words, None, CUDA) == "ptcsr"
    assert choose(same, same.words, None, CUDA) == "ptcsr"  # same pattern: cached
    assert len(fake_gpu) == 1
    choose(other, other.words, None, CUDA)  # another tensor: profiled
    assert len(fake_gpu) == 2


def test_the_choice_is_overridable(fake_gpu, monkeypatch):
    layer = _layer()
    layer.set_sparse_format("csr")
    assert triton_spqr.choose_sparse_format(layer, layer.words, None, CUDA) == "csr"
    layer.set_sparse_format("auto")
    monkeypatch.setenv("LOWBIT_SPQR_SPARSE", "csr")
    assert triton_spqr.choose_sparse_format(layer, layer.words, None, CUDA) == "csr"
    assert fake_gpu == []
    with pytest.raises(LowbitError, match="sparse_format must be one of"):
        layer.set_sparse_format("coo")


def test_without_a_gpu_the_stored_layout_is_kept():
    layer = _layer()
    assert triton_spqr.choose_sparse_format(layer, layer.words, None, torch.device("cpu")) == "csr"


@pytest.mark.interpreter
def test_prepared_layout_follows_the_choice():
    layer = _layer()
    layer.backend = "triton"
    layer.set_sparse_format("ptcsr")
    x = torch.randn(2, 48).half()
    expected = layer.__class__.from_quantized(layer.quantized_weight)(x.float())
    got = layer(x).float()
    (prepared,) = layer.__dict__["_prepared"].values()
    assert prepared["sparse_format"] == "ptcsr" and hasattr(prepared["sparse"], "tile_ptr")
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-3  # fp16 output
