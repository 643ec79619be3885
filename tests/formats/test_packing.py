import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import LowbitError
from lowbit.formats.packing import pack_bits, packed_words_per_row, unpack_bits


@settings(deadline=None, max_examples=60)
@given(
    bits=st.integers(1, 8),
    n=st.integers(1, 70),
    rows=st.integers(1, 3),
    word=st.sampled_from(["uint8", "int32"]),
    seed=st.integers(0, 999),
)
def test_plain_round_trip(bits, n, rows, word, seed):
    codes = torch.randint(0, 2**bits, (rows, n), generator=torch.Generator().manual_seed(seed))
    packed = pack_bits(codes, bits, word=word)
    assert packed.shape == (rows, packed_words_per_row(n, bits, word))
    assert torch.equal(unpack_bits(packed, bits, n, word=word), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("word", ["uint8", "int32"])
@pytest.mark.parametrize("order", ["interleaved", "reversed"])
def test_interleaved_round_trip(bits, word, order):
    k = (8 if word == "uint8" else 32) // bits
    perm = list(range(k))[::-1] if order == "reversed" else order
    codes = torch.randint(0, 2**bits, (3, 5 * k + 1))
    packed = pack_bits(codes, bits, word=word, order=perm)
    assert torch.equal(
        unpack_bits(packed, bits, codes.shape[1], word=word, order=perm), codes.to(torch.uint8)
    )


def test_plain_bit_layout_3bit():
    # stream LSB first: 1 | 2<<3 | 3<<6 | 4<<9 ... → bytes
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    expected = [(stream >> (8 * b)) & 0xFF for b in range(3)]
    assert pack_bits(codes, 3).tolist() == expected
    word = pack_bits(codes, 3, word="int32")
    assert word.dtype == torch.int32 and int(word) == stream


def test_awq_style_int4_order():
    codes = torch.arange(8)
    word = pack_bits(codes, 4, word="int32", order="interleaved")
    assert (int(word) & 0xFFFFFFFF) == 0x75316420  # nibbles hold elements 0,2,4,6,1,3,5,7


def test_bad_input():
    with pytest.raises(LowbitError, match="bits"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(LowbitError, match="codes must lie"):
        pack_bits(torch.tensor([8]), 3)
    with pytest.raises(LowbitError, match="integer"):
        pack_bits(torch.zeros(4), 3)
    with pytest.raises(LowbitError, match="interleaved order"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3, word="int32", order="interleaved")
    with pytest.raises(LowbitError, match="expected"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 4, 8)
