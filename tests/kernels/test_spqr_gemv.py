"""The fused SpQR kernels against their torch reference.

Without CUDA they run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``) on small irregular
shapes: N = 37 and K = 50 / 130 are not multiples of 16 (partial tiles in both directions,
rows and columns padded), M = 1 takes the GEMV path, M = 3 and 13 the small-batch ``tl.dot``
path. With CUDA the same tests run compiled, and the ``gpu`` ones add layer sizes.
"""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from lowbit.algorithms.spqr import SpQRSpec  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kernels.spqr_gemv import (  # noqa: E402
    _launch,
    aligned_permutation,
    sparse_operands,
    spqr_dequantize_dense,
    spqr_gemv,
    spqr_reference,
    words_dense_reference,
)
from lowbit.kernels.triton_spqr import spqr_product  # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.interpreter

# |kernel - reference| <= TOL * max|reference| (reference: fp32 product of the same weights,
# one rounding to x's dtype). Measured under the interpreter over the cases below: fp16
# 4.1e-4 (the output's fp16 rounding), bf16 5.4e-3 (the small-batch path rounds the weights to
# bf16, as the reference backend does; the GEMV path keeps them exact).
TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _weight(n, k, fraction=0.02, perm=True, seed=0, sparse="csr"):
    """An SpQR weight of a heavy-tailed matrix (outliers in every tile row), random perm."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[torch.rand(n, k, generator=gen) < 0.02] *= 20
    q = SpQRSpec(outlier_fraction=fraction, sparse_format=sparse).rtn(w)
    if perm:
        q.perm = torch.randperm(k, generator=gen).to(torch.int16)
    return q.to(DEVICE)


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _run(q, x, bias, config=None):
    perm = None if q.perm is None else q.perm_index().to(torch.int32)
    return spqr_gemv(x, q.words(), perm, q.outliers, bias, out_features=q.shape[0], config=config)


@pytest.mark.parametrize("sparse", ["csr", "ptcsr"])
@pytest.mark.parametrize("m", [1, 3, 13])
@pytest.mark.parametrize("n, k", [(37, 50), (40, 130), (48, 64)])
def test_fused_kernel_matches_reference(n, k, m, sparse):
    q = _weight(n, k, sparse=sparse, seed=n + k)
    x = torch.randn(m, k, device=DEVICE).half()
    bias = torch.randn(n, device=DEVICE).half()
    got = _run(q, x, bias)
    assert got.shape == (m, n) and got.dtype == torch.float16
    assert _rel_err(got, spqr_reference(x.float(), q, bias.float())) < TOL[torch.float16]


@pytest.mark.parametrize("m", [1, 5])
def test_bf16_no_permutation_no_bias(m):
    q = _weight(37, 130, perm=False, seed=3)
    x = torch.randn(m, 130, device=DEVICE).bfloat16()
    got = _run(q, x, None)
    assert got.dtype == torch.bfloat16
    assert _rel_err(got, spqr_reference(x.float(), q)) < TOL[torch.bfloat16]


@pytest.mark.parametrize(
    "config",
    [(1, 1, 2, 3, 4), (16, 1, 16, 1, 4), (1, 2, 4, 2, 4)],
    ids=["gemv-split3", "dot", "gemv-split2"],
)
def test_forced_configurations_and_split_k(config):
    """Split-K divides both the tiles and each row's outliers between programs."""
    q = _weight(37, 130, fraction=0.05, seed=4)
    m = 1 if config[0] == 1 else 4
    x = torch.randn(m, 130, device=DEVICE).half()
    bias = torch.randn(37, device=DEVICE).half()
    got = _run(q, x, bias, config)
    assert _rel_err(got, spqr_reference(x.float(), q, bias.float())) < TOL[torch.float16]


@pytest.mark.parametrize("sparse", ["csr", "ptcsr"])
@pytest.mark.parametrize(
    "n, k, split, dtype",
    [(37, 50, 1, torch.float16), (48, 200, 3, torch.float16), (48, 200, 3, torch.bfloat16)],
)
def test_codes_as_subnormals_give_the_exponent_tricks_bits(n, k, split, dtype, sparse):
    """The GEMV multiplies each code as the subnormal float of its masked bits by
    ``x * 2**(E - p)`` (E = 100 for fp16, 64 for bf16); the exponent-trick form sums the same
    products ``2**(149 - E)`` larger: equal outputs bit for bit, with inputs at the ends of
    the range too (fp16: the smallest subnormal, the smallest normal, 2**15; bf16: 2**-20 and
    just below 2**64, beside the randn ones)."""
    q = _weight(n, k, fraction=0.05, sparse=sparse, seed=n + split)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    ends = [2.0**-24, -(2.0**-14), 2.0**15] if dtype == torch.float16 else [2.0**-20, -(2.0**63)]
    x[0, : len(ends)] = torch.tensor(ends)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    perm = q.perm_index().to(torch.int32)
    args = (x, q.words(), perm, sparse_operands(q.outliers), bias, n, (1, 2, 4, split, 4))
    subnormal = _launch(*args, subnormal=True)
    exponent = _launch(*args, subnormal=False)
    assert subnormal.isfinite().all()
    assert torch.equal(subnormal.view(torch.int16), exponent.view(torch.int16))


@pytest.mark.parametrize("sparse", ["csr", "ptcsr"])
@pytest.mark.parametrize("config", [(1, 1, 2, 1, 4), (1, 1, 2, 3, 4), (16, 1, 16, 3, 4)])
def test_outliers_are_walked_in_chunks_of_each_row(config, sparse):
    """A program takes several outliers of a row an iteration (4 at M = 1, 1 at 16 rows): rows
    of about 32 outliers (5 % at K = 640), split 1 or 3 ways, so whole and ragged chunks; a
    skipped or repeated outlier (a heavy-tailed weight) would exceed the tolerance many times."""
    q = _weight(37, 640, fraction=0.05, sparse=sparse, seed=8)
    m = 1 if config[0] == 1 else 3
    x = torch.randn(m, 640, generator=torch.Generator().manual_seed(9)).half().to(DEVICE)
    got = _run(q, x, None, config)
    assert _rel_err(got, spqr_reference(x.float(), q)) < TOL[torch.float16]


def test_csr_and_ptcsr_give_the_same_product():
    q = _weight(37, 130, fraction=0.05, seed=5)
    x = torch.randn(1, 130, device=DEVICE).half()
    csr = _run(q.with_sparse_format("csr"), x, None).float()
    ptcsr = _run(q.with_sparse_format("ptcsr"), x, None).float()
    ref = spqr_reference(x.float(), q).float()
    # different summation orders of the same products: equal up to the fp16 output rounding
    assert _rel_err(csr, ref) < TOL[torch.float16] and _rel_err(ptcsr, ref) < TOL[torch.float16]
    assert _rel_err(csr, ptcsr) < TOL[torch.float16]


def test_outliers_are_added():
    """The sparse part matters: the fused product is far from the dense-only reference."""
    q = _weight(37, 130, fraction=0.05, seed=6)
    x = torch.randn(1, 130, device=DEVICE).half()
    got = _run(q, x, None)
    dense_only = spqr_reference(x.float(), q, dense_only=True)
    assert _rel_err(got, dense_only) > 10 * TOL[torch.float16]


def test_dense_decode_kernel_is_bit_exact():
    q = _weight(37, 50, seed=7)
    words = q.words()
    got = spqr_dequantize_dense(words, 37, 50)
    assert torch.equal(
        got.view(torch.int16), words_dense_reference(words, 37, 50).view(torch.int16)
    )
    assert torch.equal(got, q.dense_permuted())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sparse", ["csr", "ptcsr"])
def test_prefill_multiplies_by_the_references_weight(dtype, sparse):
    """Above 16 rows the backend decodes D' in fp16 and adds the outliers at their positions:
    the product is ``F.linear`` with the reference's weight (D' + S' in fp32, rounded once to
    x's dtype) bit for bit, without an fp32 copy of the whole weight."""
    n, k = 37, 50
    q = _weight(n, k, fraction=0.05, sparse=sparse, seed=11)
    perm = q.perm_index().to(torch.int32)
    prepared = {"words": q.words(), "perm": perm, "perm_long": perm.long(),
                "sparse": q.outliers, "sparse_ops": sparse_operands(q.outliers)}  # fmt: skip
    x = torch.randn(20, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    dense = words_dense_reference(q.words(), n, k).float()  # [N, K] D', stored order
    weight = (dense + q.outliers.to_dense(torch.float32)).to(dtype)
    want = F.linear(x[:, perm.long()], weight, bias)
    assert torch.equal(spqr_product(x, prepared, bias, n), want)


def test_a_permutation_the_gemv_cannot_load_by_16_bytes_is_copied():
    """The GEMV loads the permutation four entries at a time (16-byte vector loads on the GPU):
    a view that starts 4 bytes into its buffer, or strided, is copied to one that can be
    (same entries); an aligned contiguous one is taken as it is; the product is the same."""
    q = _weight(48, 64, seed=9)
    perm = q.perm_index().to(torch.int32)
    aligned = aligned_permutation(perm)
    assert aligned is perm
    shifted = torch.zeros(65, dtype=torch.int32, device=DEVICE)[1:].copy_(perm)  # 4 bytes in
    strided = torch.zeros(128, dtype=torch.int32, device=DEVICE)[::2].copy_(perm)
    for view in (shifted, strided):
        copy = aligned_permutation(view)
        assert copy.data_ptr() % 16 == 0 and copy.is_contiguous() and torch.equal(copy, perm)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE).half()
    want = spqr_gemv(x, q.words(), perm, q.outliers, None, out_features=48)
    got = spqr_gemv(x, q.words(), shifted, q.outliers, None, out_features=48)
    assert torch.equal(got, want)


def test_bad_operands_are_one_sentence():
    q = _weight(37, 50, seed=8)
    x = torch.randn(17, 50, device=DEVICE).half()
    with pytest.raises(LowbitError, match="1 to 16 rows, not 17"):
        _run(q, x, None)
    with pytest.raises(LowbitError, match="fp16 or bf16 inputs"):
        _run(q, x[:1].float(), None)
    with pytest.raises(LowbitError, match="do not fit a 37 x 70 weight"):
        _run(q, torch.randn(1, 70, device=DEVICE).half(), None)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 4096), (11008, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 16])
def test_layer_sizes_on_cuda(n, k, m):
    q = _weight(n, k, fraction=0.01, seed=9)
    x = torch.randn(m, k, device=DEVICE).half()
    got = _run(q, x, None)
    assert _rel_err(got, spqr_reference(x.float(), q)) < TOL[torch.float16]
