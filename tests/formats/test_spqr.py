import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import LowbitError
from lowbit.formats.spqr import (
    SpQRQuantized,
    decode_fp16,
    make_outliers,
    pack_words,
    quantize_stats,
    second_order_by_shuffle,
    unpack_words,
)


def _random_fields(out_f, in_f, seed, bits=3):
    g = torch.Generator().manual_seed(seed)
    tiles, groups = math.ceil(out_f / 16), math.ceil(in_f / 16)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.uint8)
    sc = torch.randint(0, 8, (out_f, groups), generator=g, dtype=torch.uint8)
    zc = torch.randint(0, 8, (out_f, groups), generator=g, dtype=torch.uint8)
    # every fp16 bit pattern (NaN and Inf included) must survive the words
    second = torch.randint(-(2**15), 2**15, (tiles, groups, 4), generator=g, dtype=torch.int16)
    return codes, sc, zc, second.view(torch.float16)


def _container(out_f, in_f, seed, sparse="csr", perm=True):
    codes, sc, zc, _ = _random_fields(out_f, in_f, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tiles, groups = math.ceil(out_f / 16), math.ceil(in_f / 16)
    # finite second-order statistics of a plausible size
    second = torch.stack(
        [
            torch.rand(tiles, groups, generator=g) * 0.01,  # q_ss
            torch.rand(tiles, groups, generator=g) * 2,  # q_zs
            -torch.rand(tiles, groups, generator=g),  # q_sz
            torch.rand(tiles, groups, generator=g),  # q_zz
        ],
        -1,
    ).half()
    values = torch.randn(out_f, in_f, generator=g)
    mask = torch.rand(out_f, in_f, generator=g) < 0.05
    order = torch.randperm(in_f, generator=g).to(torch.int16) if perm else None
    return SpQRQuantized(codes, sc, zc, second, make_outliers(values, mask, sparse), order)


@settings(deadline=None, max_examples=40)
@given(out_f=st.integers(1, 50), in_f=st.integers(1, 50), seed=st.integers(0, 10_000))
def test_words_round_trip_bit_exact(out_f, in_f, seed):
    """Shapes that are not multiples of 16 are padded to whole tiles with code 0."""
    codes, sc, zc, second = _random_fields(out_f, in_f, seed)
    words = pack_words(codes, sc, zc, second)
    assert words.shape == (math.ceil(out_f / 16), math.ceil(in_f / 16) * 16)
    assert words.dtype == torch.int64 and bool((words >= 0).all())  # spare bits 62-63 are 0
    codes2, sc2, zc2, second2 = unpack_words(words, out_f, in_f)
    assert torch.equal(codes2, codes) and torch.equal(sc2, sc) and torch.equal(zc2, zc)
    assert torch.equal(second2.view(torch.int16), second.view(torch.int16))
    # the padding holds code 0 in every field but the chunks
    full = words.view(words.shape[0], -1, 16).permute(0, 2, 1).reshape(-1, words.shape[1] // 16)
    w = full.unsqueeze(-1) >> (6 + 3 * torch.arange(16))  # [rows, G, 16]
    padded_codes = (w & 7).reshape(full.shape[0], -1)
    assert bool((padded_codes[out_f:] == 0).all()) and bool((padded_codes[:, in_f:] == 0).all())


def test_word_layout_of_one_tile_row():
    codes = torch.zeros(16, 16, dtype=torch.uint8)
    codes[0] = torch.arange(16) % 8
    sc = torch.full((16, 1), 5, dtype=torch.uint8)
    zc = torch.full((16, 1), 2, dtype=torch.uint8)
    halves = torch.tensor([0x1234, 0x5678, 0x9ABC, 0xDEF0]).to(torch.int16)  # ss, zs, sz, zz
    second = halves.view(1, 1, 4).view(torch.float16)
    words = pack_words(codes, sc, zc, second)[0]  # [16] rows of the single tile
    word0 = int(words[0])
    assert word0 & 7 == 5 and (word0 >> 3) & 7 == 2
    assert [(word0 >> (6 + 3 * i)) & 7 for i in range(16)] == [i % 8 for i in range(16)]
    second64 = 0x1234 | 0x5678 << 16 | 0x9ABC << 32 | 0xDEF0 << 48
    chunks = [(int(w) >> 54) & 0xFF for w in words]
    assert chunks == [(second64 >> (8 * (r // 2))) & 0xFF for r in range(16)]  # twice each
    assert all(int(w) >> 62 == 0 for w in words)


@pytest.mark.parametrize("shape", [(16, 16), (37, 50), (5, 70)])
def test_second_order_recovered_by_the_kernel_shuffle(shape):
    """Every row of a tile, in both halves of the 16 lanes, ORs the full 64-bit word."""
    codes, sc, zc, second = _random_fields(*shape, seed=3)
    words = pack_words(codes, sc, zc, second)
    recovered = second_order_by_shuffle(words)  # [T, G * 16]
    halves = second.view(torch.int16).to(torch.int64) & 0xFFFF  # [T, G, 4]
    for k in range(4):
        half = (recovered >> (16 * k)) & 0xFFFF  # [T, G * 16]
        expected = halves[..., k].repeat_interleave(16, dim=1)
        assert torch.equal(half, expected)


@pytest.mark.parametrize("sparse", ["csr", "ptcsr"])
@pytest.mark.parametrize("shape", [(16, 32), (37, 50), (3, 17)])
def test_packed_face_equals_simulated_face(shape, sparse):
    q = _container(*shape, seed=7, sparse=sparse)
    back = SpQRQuantized.from_words(q.words(), shape, q.outliers, q.perm)
    assert torch.equal(back.dequantize(), q.dequantize())
    csr = q.with_sparse_format("csr").dequantize()
    ptcsr = q.with_sparse_format("ptcsr").dequantize()
    assert torch.equal(csr, ptcsr)


def test_dequantize_follows_the_equations_and_the_permutation():
    q = _container(20, 40, seed=11)
    perm = q.perm_index()
    w = q.dequantize()
    second = q.second.float()
    for r, j in [(0, 0), (19, 39), (7, 21)]:
        g, t = j // 16, r // 16
        ss, zs, sz, zz = (second[t, g, k] for k in range(4))
        s = (ss * (q.scale_codes[r, g] - sz).half().float()).half().float()
        z = (zs * (q.zero_codes[r, g] - zz).half().float()).half().float()
        dense = (s * (q.codes[r, j] - z).half().float()).half().float()
        expected = dense + q.outliers.to_dense()[r, j]
        assert float(w[r, perm[j]]) == float(expected)


def test_decode_fp16_rounds_each_operation_like_half_arithmetic():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 8, (1000,), generator=g)
    scale = (torch.rand(1000, generator=g) * 3).half()
    zero = (torch.randn(1000, generator=g) * 5).half()
    expected = scale * (codes.half() - zero)  # torch's CPU half ops, rounded per operation
    assert torch.equal(
        decode_fp16(codes, scale, zero).view(torch.int16), expected.view(torch.int16)
    )


def test_storage_bits_count_the_words_outliers_and_permutation():
    q = _container(32, 48, seed=5)
    nnz = q.nnz
    expected = 64 * 2 * 3 * 16 + 32 * (nnz + 33) + 16 * 48
    assert q.storage_bits() == expected
    assert q.dense_bits() / (32 * 48) == 4.0  # the packed layout: 4 bits per weight
    assert q.analytic_bits() == 3.625
    unpermuted = _container(32, 48, seed=5, perm=False)
    assert unpermuted.storage_bits() == expected - 16 * 48


def test_quantize_stats_constant_tile_decodes_back():
    values = torch.tensor([[0.25], [0.25], [0.25]])
    codes, s2, z2 = quantize_stats(values, 3, 16)
    assert torch.equal(decode_fp16(codes, s2[0], z2[0]).float(), values)
    zeros = torch.zeros(3, 1)
    codes, s2, z2 = quantize_stats(zeros, 3, 16)
    assert torch.equal(decode_fp16(codes, s2[0], z2[0]).float(), zeros)


def test_bad_input_is_one_sentence():
    q = _container(16, 16, seed=1)
    with pytest.raises(LowbitError, match="3-bit codes and statistics, not 4-bit"):
        SpQRQuantized(**{**q.__dict__, "bits": 4}).words()
    with pytest.raises(LowbitError, match=r"16 x 16 tiles .* not beta1 = 8"):
        SpQRQuantized(**{**q.__dict__, "beta1": 8}).words()
    with pytest.raises(LowbitError, match="at most 65536 input columns, not 65537"):
        make_outliers(torch.zeros(1, 65537), torch.zeros(1, 65537, dtype=torch.bool))
    words = q.words().clone()
    words[0, 3] |= 1 << 62
    with pytest.raises(LowbitError, match="spare bits"):
        unpack_words(words, 16, 16)
    words = q.words().clone()
    words[0, 1] ^= 1 << 54
    with pytest.raises(LowbitError, match="repeated second-order chunks"):
        unpack_words(words, 16, 16)
