"""Every triton-backed packed linear can be captured in a CUDA graph at every row count, and
the replay gives the eager output bit for bit (marked ``gpu``; skipped without CUDA).

Decoding under CUDA graphs (``torch.compile(mode="reduce-overhead")``, vLLM's captured batch
sizes up to 512) runs the fused kernels at M <= 16 and the decoded-weight prefill above: nothing
on either path may read a value back from the GPU (a ``repeat_interleave`` without its length,
a boolean mask), which a capture refuses.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize
from lowbit.algorithms.spqr import SpQRSpec
from lowbit.formats.intq import IntQuantized
from lowbit.nn.mixed_linear import MixedLinear
from lowbit.nn.packed_linear import PackedLinear
from lowbit.nn.run_linear import kernel_form
from lowbit.nn.spqr_linear import SpQRLinear

pytestmark = pytest.mark.gpu

N, K = 272, 384  # 17 row tiles of 16, 3 groups of 128


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.02


def _spqr(sparse_format: str) -> SpQRLinear:
    layer = SpQRLinear.from_quantized(SpQRSpec(outlier_fraction=0.01).rtn(_weight()))
    layer.set_sparse_format(sparse_format)
    return layer


LAYERS = {
    "int W4 g128": lambda: PackedLinear.from_quantized(
        IntQuantized.from_float(_weight(), 4, group_size=128, scale_dtype=torch.float16)
    ),
    "spqr w3 1% csr": lambda: _spqr("csr"),
    "spqr w3 1% ptcsr": lambda: _spqr("ptcsr"),
    "2/4/16": lambda: MixedLinear.from_quantized(
        mixed_quantize(_weight(), None, MixedWeightSpec(0.25, outlier_fraction=0.01)).quantized
    ),
}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("m", [1, 16, 48])
def test_the_captured_call_replays_the_eager_output(name, m):
    layer = LAYERS[name]()
    layer.backend = "triton"
    layer = layer.to("cuda", torch.float16)
    x = torch.randn(m, K, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = layer(x)  # prepares the layer, tunes its launch configuration
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(x)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("m", [1, 48])
def test_a_stacked_kernel_layout_replays_its_members_eager_outputs(m):
    """A GPU run's q/k/v in one layout (lowbit.nn.run_linear): captured, the first member's call
    computes the stacked product and the others take their slices, as eagerly."""
    layers = [
        PackedLinear.from_quantized(
            IntQuantized.from_float(_weight(seed), 4, group_size=128, scale_dtype=torch.float16)
        ).to("cuda")
        for seed in range(3)
    ]
    model = torch.nn.Sequential(*layers)
    assert kernel_form(model, [layers], torch.float16) == (3, 1)
    x = torch.randn(m, K, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = [member(x) for member in model]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = [member(x) for member in model]
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(c, e) for c, e in zip(captured, eager, strict=True))
