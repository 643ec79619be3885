"""llama.cpp's 32-weight grids: lowbit's dequantized weight equals what the ``gguf`` package's
reader decodes from the exported bytes, bit for bit, for every type."""

import gguf
import numpy as np
import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.gguf_blocks import (
    BLOCK_TYPES,
    GGUFQuantized,
    block_type,
    fit_block_scales,
    round_to_grid,
)

TYPES = list(BLOCK_TYPES)


def _weight(rows=5, blocks=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, blocks * 32, generator=g)  # [rows, in]
    w[0, :32] = 0.0  # an all-zero block
    w[1, 40] = 9.0  # an outlier
    w[2, 64:96] = 3.0  # a constant block
    return w


def _quantize(w, kind):
    blocks = w.reshape(w.shape[0], -1, 32)
    scale, minimum = fit_block_scales(blocks, kind)
    codes, values = round_to_grid(blocks, kind, scale, minimum)
    container = GGUFQuantized.from_codes(kind, codes.reshape(w.shape), scale, minimum)
    return container, values.reshape(w.shape)


@pytest.mark.parametrize("name", TYPES)
def test_gguf_reader_decodes_lowbit_blocks_bit_for_bit(name):
    kind = block_type(name)
    w = _weight()
    container, values = _quantize(w, kind)
    raw = container.to_blocks()  # [rows, bytes per row]
    assert raw.shape == (5, 7 * kind.bytes_per_block)
    decoded = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])  # [rows, in]
    ours = container.dequantize().numpy()
    assert np.array_equal(decoded.view(np.uint32), ours.view(np.uint32))
    assert torch.equal(values, container.dequantize())
    assert container.storage_bits() == raw.size * 8


@pytest.mark.parametrize("name", [n for n in TYPES if n != "IQ4_NL"])
def test_rtn_error_is_at_most_llama_cpp_reference_quantizer(name):
    # the reference quantizer's own choice is among the candidates, rounded with the stored scale
    w = _weight(rows=16, blocks=8, seed=1)
    qtype = gguf.GGMLQuantizationType[name]
    reference = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
    ours = _quantize(w, block_type(name))[0].dequantize().numpy()
    ref_err = float(((reference - w.numpy()) ** 2).sum())
    our_err = float(((ours - w.numpy()) ** 2).sum())
    assert our_err <= ref_err  # measured: 0.80x (Q8_0) to 0.91x (Q5_0, Q4_0) of the reference's


@pytest.mark.parametrize("name", ["Q4_1", "Q5_1"])
def test_weights_already_on_an_affine_grid_are_found_again(name):
    # the embedded model's float weights are dequantized Q4_1 blocks: RTN must be lossless there
    qtype = gguf.GGMLQuantizationType[name]
    w = _weight(rows=8, blocks=4, seed=2).numpy()
    on_grid = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    container, _ = _quantize(torch.from_numpy(on_grid), block_type(name))
    assert np.array_equal(container.dequantize().numpy(), on_grid)


def test_iq4_nl_levels_decode_as_llama_cpp():
    kind = block_type("iq4_nl")
    codes = torch.arange(16, dtype=torch.uint8).repeat(2).reshape(1, 32)
    container = GGUFQuantized("IQ4_NL", codes, torch.ones(1, 1, dtype=torch.float16))
    decoded = gguf.quants.dequantize(container.to_blocks(), gguf.GGMLQuantizationType.IQ4_NL)
    assert decoded[0, :16].tolist() == list(kind.levels)


def test_unknown_type_is_one_sentence():
    with pytest.raises(LowbitError, match="unknown GGUF block type 'Q3_0'"):
        block_type("Q3_0")
