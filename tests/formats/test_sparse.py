import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import LowbitError
from lowbit.formats.sparse import (
    CSCMatrix,
    CSRMatrix,
    PTCSRMatrix,
    pack_index_value,
    split_outliers,
    unpack_index_value,
)

CONTAINERS = [CSRMatrix, CSCMatrix, PTCSRMatrix]


def _sparse(rows, cols, density, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return torch.where(torch.rand(rows, cols, generator=g) < density, x, torch.zeros(()))


def test_word_layout_is_index_high_fp16_low():
    words = pack_index_value(torch.tensor([3, 65535]), torch.tensor([1.0, -2.0]))
    assert (int(words[0]) & 0xFFFFFFFF) == (3 << 16) | 0x3C00  # fp16 1.0 = 0x3C00
    assert (int(words[1]) & 0xFFFFFFFF) == (65535 << 16) | 0xC000  # fp16 -2.0 = 0xC000
    idx, val = unpack_index_value(words)
    assert idx.tolist() == [3, 65535] and val.tolist() == [1.0, -2.0]


def test_value_high_words_are_the_spqr_kernels_col_val():
    """SpQR's kernel word: fp16 value in the high half, column in the low half."""
    words = pack_index_value(torch.tensor([3, 65535]), torch.tensor([1.0, -2.0]), value_high=True)
    assert (int(words[0]) & 0xFFFFFFFF) == (0x3C00 << 16) | 3
    assert (int(words[1]) & 0xFFFFFFFF) == (0xC000 << 16) | 65535
    idx, val = unpack_index_value(words, value_high=True)
    assert idx.tolist() == [3, 65535] and val.tolist() == [1.0, -2.0]
    x = _sparse(37, 50, 0.1, 4)
    for container in (CSRMatrix, PTCSRMatrix):
        assert torch.equal(
            container.from_dense(x, value_high=True).to_dense(), container.from_dense(x).to_dense()
        )


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("shape", [(1, 7), (13, 40), (37, 5), (64, 64)])
def test_round_trip_and_matvec(container, shape):
    x = _sparse(*shape, 0.15, shape[0])
    x16 = x.half().float()  # values are stored in fp16
    m = container.from_dense(x)
    assert torch.equal(m.to_dense(), x16)
    v = torch.randn(shape[1])
    assert torch.allclose(m.matvec(v), x16 @ v, rtol=1e-5, atol=1e-5)


@settings(deadline=None, max_examples=30)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    density=st.floats(0, 1),
    seed=st.integers(0, 999),
)
def test_containers_agree(rows, cols, density, seed):
    x = _sparse(rows, cols, density, seed)
    dense = [c.from_dense(x).to_dense() for c in CONTAINERS]
    assert torch.equal(dense[0], dense[1]) and torch.equal(dense[0], dense[2])


def test_ptcsr_layout_transposed_and_padded():
    x = torch.zeros(16, 8)
    x[0, 1], x[0, 5], x[3, 2] = 1.0, 2.0, 3.0  # row 0 has 2 nonzeros → L = 2
    m = PTCSRMatrix.from_dense(x)
    assert m.tile_ptr.tolist() == [0, 32]
    idx, val = unpack_index_value(m.col_val)
    # word i*16 + r is row r's i-th nonzero
    assert (idx[0].item(), val[0].item()) == (1, 1.0)
    assert (idx[16].item(), val[16].item()) == (5, 2.0)
    assert (idx[3].item(), val[3].item()) == (2, 3.0)
    assert int((m.col_val != 0).sum()) == 3 and m.nnz == 3
    assert m.storage_bits() == 32 * (32 + 2)


def test_split_by_threshold_fraction_mask():
    x = torch.tensor([[0.1, -5.0, 0.2], [3.0, 0.0, -0.3]])
    dense, mask = split_outliers(x, threshold=1.0)
    assert mask.tolist() == [[False, True, False], [True, False, False]]
    assert torch.equal(dense + torch.where(mask, x, 0.0), x)
    _, top = split_outliers(x, fraction=1 / 6)
    assert top.tolist() == [[False, True, False], [False, False, False]]
    per_channel = torch.tensor([10.0, 1.0, 0.25])  # KVQuant-style thresholds per column
    _, m = split_outliers(x, threshold=per_channel)
    assert m.tolist() == [[False, True, False], [False, False, True]]
    _, m2 = split_outliers(x, mask=mask)
    assert torch.equal(m2, mask)


def test_accounting_csr():
    x = _sparse(64, 128, 0.01, 0)
    m = CSRMatrix.from_dense(x)
    assert m.storage_bits() == 32 * (m.nnz + 65)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: split_outliers(torch.randn(3, 3)), "exactly one"),
        (lambda: split_outliers(torch.randn(3, 3), fraction=2.0), "fraction"),
        (lambda: split_outliers(torch.randn(3), threshold=1.0), "2-d"),
        (lambda: CSRMatrix.from_dense(torch.full((2, 2), 1e5)), "fp16"),
        (lambda: CSRMatrix.from_dense(torch.eye(3)).matvec(torch.ones(4)), "length 3"),
        (lambda: split_outliers(torch.tensor([[float("nan")]]), threshold=1.0), "NaN"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(LowbitError, match=match):
        call()
