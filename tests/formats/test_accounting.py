import pytest
import torch

from lowbit.formats.accounting import (
    bfp_bits,
    csr_outlier_bits,
    kvquant_bits,
    mixed_2_4_bits,
    spqr_bits,
    two_order_bits,
)
from lowbit.formats.bfp import BFPQuantized
from lowbit.formats.intq import IntQuantized
from lowbit.formats.sparse import CSRMatrix, split_outliers


def test_li_et_al_eq10_gives_2_91():
    assert mixed_2_4_bits() == pytest.approx(2.9116, abs=1e-4)
    assert round(mixed_2_4_bits(), 2) == 2.91
    assert mixed_2_4_bits(outlier_fraction=0.0, rows=10**9, cols=10**9) == pytest.approx(
        2.84, abs=5e-3
    )


def test_spqr_bilevel_3bit():
    assert spqr_bits() == 3.625


def test_bfp12_block64():
    assert bfp_bits(4, 64) == 4.125
    assert BFPQuantized.from_float(torch.randn(4, 64), 4, 64).bits_per_element() == bfp_bits(4, 64)


def test_kvquant_nuq3_1pct():
    assert kvquant_bits() == pytest.approx(3.33, abs=5e-3)


def test_containers_reproduce_the_formulas():
    w = torch.randn(256, 512)
    one = IntQuantized.from_float(w, 2, symmetric=False, group_size=16, scale_dtype=torch.float16)
    assert one.bits_per_element() == two_order_bits(2, 16)
    two = IntQuantized.from_float(
        w, 2, symmetric=False, group_size=16, scale_bits=4, scale_group=16
    )
    # the container keeps the second-order zero in fp16, eq. 7 counts it at N_s bits
    assert two.bits_per_element() == pytest.approx(two_order_bits(2, 16, 4, 16) + (16 - 4) / 256)
    _, mask = split_outliers(w, fraction=0.002)
    csr = CSRMatrix.from_dense(w, mask)
    assert csr.bits_per_element() == pytest.approx(csr_outlier_bits(csr.nnz / w.numel(), 256, 512))
