"""The mixed 2/4-bit GEMV (asynchronous and synchronous, outliers fused or not) against its
torch reference.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (tests/conftest.py) on small
irregular shapes: N = 37 rows (not a multiple of the row block or of g2 = 8), K = 160 (10
groups at 25 %: words A and B, a padded triplet) and K = 88 at 50 % (words A and C, a last
group of 8 columns), M = 1 (the FMA path), 3 and 13 (tl.dot, rows masked).
"""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels.mixed_dequant import mixed_dequant  # noqa: E402
from lowbit.kernels.mixed_gemv import mixed_gemv  # noqa: E402
from lowbit.kernels.mixed_layout import mixed_reference, prepare_mixed  # noqa: E402
from lowbit.nn.mixed_linear import MixedLinear  # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.interpreter

# |kernel - reference| <= TOL * max|reference|. The reference decodes in fp32, one fp32 matmul,
# one rounding; the kernel sums code * x per group and scales once (M = 1) or rounds the
# decoded weight to x's dtype for tl.dot (M > 1). Measured (interpreter): M = 1 fp16 0, M = 3
# fp16 5.0e-4 (3.0e-4 on K = 88), M = 13 fp16 5.9e-4, M = 1 bf16 5.0e-3.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _weight(n, k, frac4, outliers, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    spec = MixedWeightSpec(frac_4bit=frac4, outlier_fraction=outliers, g2=8)
    return mixed_quantize(w, None, spec).quantized


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.fixture(scope="module")
def layer():
    q = _weight(37, 160, 0.25, 0.01)
    assert (q.segments.ua, q.segments.ub, q.segments.uc) == (2, 1, 0)
    return q, {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
               for k, v in prepare_mixed(q.to(DEVICE)).items()}  # fmt: skip


def test_gemv_async_and_sync_fused_or_not(layer):
    q, ops = layer
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 160, generator=gen).half().to(DEVICE)
    bias = torch.randn(37, generator=gen).half().to(DEVICE)
    want = mixed_reference(x, q.to(DEVICE), bias)
    results = {}
    for asynchronous in (True, False):
        for fuse in (True, False):
            got = mixed_gemv(x, ops, bias, asynchronous=asynchronous, fuse_outliers=fuse)
            assert got.shape == (1, 37) and got.dtype == torch.float16
            assert _rel_err(got, want) <= TOL[torch.float16]
            results[asynchronous, fuse] = got
    # the schedules differ, the sums do not: bit-identical
    assert torch.equal(results[True, True], results[False, True])
    assert torch.equal(results[True, False], results[False, False])
    # without the outliers it is the dense part alone
    dense = mixed_reference(x, q.to(DEVICE), bias, outliers=False)
    assert not torch.equal(dense, want)


@pytest.mark.parametrize("m", [1, 3])
def test_outliers_are_summed_in_chunks_of_each_row(m):
    """The outlier sum takes several words of a row an iteration: rows of 25 to 43 outliers (5 %
    at K = 640) span several chunks, the last partial, and the sum is the dense outlier
    matrix's product within fp32 rounding (measured 1.1e-7 and 1.7e-7 relative)."""
    from lowbit.kernels.mixed_gemv import outlier_spmv

    q = _weight(37, 640, 0.25, 0.05, seed=4)
    nnz = q.outliers.to_dense().ne(0).sum(1)
    assert nnz.min() > 8 and nnz.max() != nnz.min()  # more than a chunk, ragged
    ops = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
           for k, v in prepare_mixed(q.to(DEVICE)).items()}  # fmt: skip
    x = torch.randn(m, 640, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    want = x.float() @ q.outliers.to_dense().float().to(DEVICE).T
    assert _rel_err(outlier_spmv(x, ops), want) <= 1e-6
    fused = mixed_gemv(x, ops)  # the outliers added inside the GEMV (M = 1) or 16-row kernel
    assert _rel_err(fused, mixed_reference(x, q.to(DEVICE))) <= TOL[torch.float16]


@pytest.mark.parametrize("m", [3, 13])
def test_small_batch(layer, m):
    q, ops = layer
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m)).half().to(DEVICE)
    got = mixed_gemv(x, ops, None)
    assert _rel_err(got, mixed_reference(x, q.to(DEVICE))) <= TOL[torch.float16]


@pytest.mark.parametrize("m, dtype", [(1, torch.bfloat16), (3, torch.float16)])
def test_words_c_and_a_partial_group(m, dtype):
    q = _weight(21, 88, 0.5, 0.0, seed=2)  # 6 groups, 3 four-bit: words A and C
    assert (q.segments.ua, q.segments.ub, q.segments.uc) == (1, 0, 1)
    ops = prepare_mixed(q.to(DEVICE))
    x = torch.randn(m, 88, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    for asynchronous in (True, False):
        got = mixed_gemv(x, ops, None, asynchronous=asynchronous)
        assert _rel_err(got, mixed_reference(x, q.to(DEVICE))) <= TOL[dtype]


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**40], ids=["small", "large"])
def test_bf16_gemv_holds_its_precision_across_the_range_of_x(scale):
    """The M = 1 kernel's sums are 2**-85 times the true ones for bf16 x (codes as subnormal
    floats, x * 2**(64 - s)): inputs scaled far down or up keep the reference's relative error,
    neither flushed to zero nor overflowing (every word segment, outliers fused)."""
    q = _weight(37, 160, 0.25, 0.01, seed=7)
    ops = prepare_mixed(q.to(DEVICE))
    x = torch.randn(1, 160, generator=torch.Generator().manual_seed(8)) * scale
    x = x.to(torch.bfloat16).to(DEVICE)
    got = mixed_gemv(x, ops, None)
    assert _rel_err(got, mixed_reference(x, q.to(DEVICE))) <= TOL[torch.bfloat16]


# words A per split: 2 a step at M = 1 (K = 512: 8 words), a 16-word tile above (K = 2048: 32)
@pytest.mark.parametrize(
    "m, k, config", [(1, 512, (1, 16, 2, 2, 1)), (3, 2048, (16, 16, 16, 2, 4))]
)
def test_split_k(m, k, config):
    q = _weight(21, k, 0.25, 0.01, seed=5)
    ops = prepare_mixed(q.to(DEVICE))
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=gen).half().to(DEVICE)
    bias = torch.randn(21, generator=gen).half().to(DEVICE)
    got = mixed_gemv(x, ops, bias, config=config)  # fp32 partials summed, then the bias
    assert _rel_err(got, mixed_reference(x, q.to(DEVICE), bias)) <= TOL[torch.float16]


@pytest.mark.parametrize(
    "n, k, frac4, outliers",
    [(37, 160, 0.25, 0.01), (37, 88, 0.5, 0.02), (33, 200, 0.9, 0.01), (9, 40, 0.25, 0.05)],
    ids=["words-a-b", "words-a-c", "words-c", "one-4-bit-slot"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_decoder_gives_the_references_weight(n, k, frac4, outliers, dtype):
    """The Triton decoder (dense part in fp32, outliers added, one rounding) gives
    ``MixedQuantized.dequantize`` bit for bit: every segment, padding slots, K not a multiple
    of 16, N not a multiple of g2 or the row block, a layout with a single 4-bit slot."""
    q = _weight(n, k, frac4, outliers, seed=n + k).to(DEVICE)
    got = mixed_dequant(prepare_mixed(q), dtype)
    assert torch.equal(got, q.dequantize(dtype))


def test_backend_prefill_multiplies_by_the_decoded_weight():
    """Above 16 rows the triton backend is ``F.linear`` with the reference's weight, bit for
    bit."""
    q = _weight(37, 160, 0.25, 0.01, seed=3)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(4)) * 0.02
    layer = MixedLinear.from_quantized(q, bias, backend="triton").to(DEVICE, torch.float16)
    x = torch.randn(20, 160, generator=torch.Generator().manual_seed(5)).half().to(DEVICE)
    want = F.linear(x, q.to(DEVICE).dequantize(torch.float16), layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), want)


def test_refusals(layer):
    _, ops = layer
    with pytest.raises(LowbitError, match="rows"):
        mixed_gemv(torch.zeros(17, 160, dtype=torch.float16, device=DEVICE), ops)
    with pytest.raises(LowbitError, match="fp16 or bf16"):
        mixed_gemv(torch.zeros(1, 160, device=DEVICE), ops)
    with pytest.raises(LowbitError, match=r"x must be \[M, 160\]"):
        mixed_gemv(torch.zeros(1, 16, dtype=torch.float16, device=DEVICE), ops)
    with pytest.raises(LowbitError, match="tl.dot"):
        mixed_gemv(torch.zeros(2, 160, dtype=torch.float16, device=DEVICE), ops,
                   config=(16, 16, 4, 1, 4))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 4096), (11008, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 16])
def test_layer_sizes_on_cuda(n, k, m):
    """The default launch configuration at layer sizes, untuned: one compile per schedule, so
    that the GPU plan's `tests` stage reaches the tests after these (tuning has its own)."""
    q = _weight(n, k, 0.25, 0.002, seed=4).to("cuda")
    ops = prepare_mixed(q)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    want = mixed_reference(x, q)
    for asynchronous in (True, False):
        for fuse in (True, False):
            got = mixed_gemv(x, ops, asynchronous=asynchronous, fuse_outliers=fuse, tune=False)
            assert _rel_err(got, want) <= TOL[torch.float16], (asynchronous, fuse)
