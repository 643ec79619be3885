"""The tiled int32 layout of the Triton kernels: exact round trips, tile choice, refusals."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.intq import IntQuantized
from lowbit.kernels.int_layout import (
    check_operands,
    pack_tiles,
    tile_words,
    tiled_reference,
    tiled_row_words,
    unpack_tiles,
)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("tile", [32, 16])
@pytest.mark.parametrize("k", [1, 96, 160, 333])
def test_pack_tiles_round_trips_bit_for_bit(bits, tile, k):
    codes = torch.randint(0, 2**bits, (7, k), dtype=torch.uint8)
    words = pack_tiles(codes, bits, tile)  # [7, W]
    assert words.dtype == torch.int32 and words.shape == (7, tiled_row_words(k, bits, tile))
    assert torch.equal(unpack_tiles(words, bits, k, tile), codes)


def test_slot_j_of_a_tile_holds_a_contiguous_run_of_codes():
    codes = torch.arange(64, dtype=torch.uint8).view(1, 64) % 16  # 4 bits, 8 per word
    words = pack_tiles(codes, 4, 16)  # one tile: 16 words x 8 slots = 128 codes
    for j in range(8):
        run = (words[0].to(torch.int64) >> (4 * j)) & 0xF  # slot j of every word
        want = torch.zeros(16, dtype=torch.int64)
        want[: max(0, min(16, 64 - 16 * j))] = codes[0, 16 * j : 16 * (j + 1)].long()
        assert torch.equal(run, want)


def test_three_bit_words_leave_their_top_two_bits_unused():
    codes = torch.full((3, 320), 7, dtype=torch.uint8)
    words = pack_tiles(codes, 3, 32)
    assert int((words.to(torch.int64) & 0xFFFFFFFF).max()) == 2**30 - 1


def test_tile_words_prefers_32_unless_16_pads_less_or_the_group_needs_it():
    assert tile_words(4096, 4, 128) == 32
    assert tile_words(576, 4, 64) == 16  # 640 codes instead of 768
    assert tile_words(96, 4, 16) == 16
    assert tile_words(96, 4, 8) is None


def test_check_operands_refuses_bad_input_in_a_sentence():
    q = IntQuantized.from_float(torch.randn(5, 64), 4, group_size=32)
    words = pack_tiles(q.codes().view(5, 64).to(torch.int16) + 8, 4, 32)
    scale = q.scale.t().to(torch.float16).contiguous()  # [2, 5]
    x = torch.randn(2, 64, dtype=torch.float16)
    assert check_operands(x, words, scale, None, None, 4, 32, 32) == (2, 5, 64)
    bad = [
        (x.float(), words, scale, None, None, 32),
        (x, words[:, :4], scale, None, None, 32),
        (x, words, scale.t(), None, None, 32),
        (x, words, scale, torch.zeros(2, 5), None, 32),
        (x, words, scale, None, torch.zeros(5), 32),
        (x, words, scale, None, None, 24),
    ]
    for args in bad:
        with pytest.raises(LowbitError):
            check_operands(*args[:5], 4, 32, args[5])


def test_tiled_reference_is_the_packed_product():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(11, 96, generator=gen)
    q = IntQuantized.from_float(weight, 3, group_size=32, symmetric=False)
    codes = q.codes().view(11, 96)
    scale, zero = q.scale.t().contiguous(), q.zero.t().to(torch.uint8).contiguous()  # [3, 11]
    x = torch.randn(4, 96, generator=gen).to(torch.float16)
    got = tiled_reference(x, pack_tiles(codes, 3, 32), scale, zero, None, 3, 32, 32)
    want = (x.float() @ q.dequantize(torch.float32).t()).to(torch.float16)
    assert torch.equal(got, want)
