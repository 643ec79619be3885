"""llama.cpp's grids (32-weight blocks and 256-weight K super-blocks): lowbit's dequantized weight
equals what the ``gguf`` package's reader decodes from the exported bytes, bit for bit, for every
type; lowbit's RTN rounds no worse than llama.cpp's own quantizer."""

import ctypes
import os

import gguf
import numpy as np
import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.gguf_blocks import (
    BLOCK_TYPES,
    GGUFQuantized,
    block_type,
    fit_grid,
    round_to_fitted,
)

TYPES = list(BLOCK_TYPES)


def _weight(rows=5, width=224, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, width, generator=g)  # [rows, in]
    w[0, :32] = 0.0  # an all-zero block
    w[1, 40] = 9.0  # an outlier
    w[2, 64:96] = 3.0  # a constant block
    if rows > 4 and width >= 512:
        w[3, 256:512] = 0.0  # an all-zero super-block
        w[4, :256] = w[4, :256].abs() + 0.5  # a positive super-block (the K minimums are <= 0)
    return w


def _quantize(w, kind):
    blocks = w.reshape(w.shape[0], -1, kind.block)
    grid = fit_grid(blocks, kind)
    codes, values = round_to_fitted(blocks, kind, grid)
    container = GGUFQuantized.from_grid(kind, codes, grid)
    return container, values.reshape(w.shape)


@pytest.mark.parametrize("name", TYPES)
def test_gguf_reader_decodes_lowbit_blocks_bit_for_bit(name):
    kind = block_type(name)
    w = _weight(width=7 * kind.block)
    container, values = _quantize(w, kind)
    raw = container.to_blocks()  # [rows, bytes per row]
    assert raw.shape == (5, 7 * kind.bytes_per_block)
    decoded = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])  # [rows, in]
    ours = container.dequantize().numpy()
    assert np.array_equal(decoded.view(np.uint32), ours.view(np.uint32))
    assert torch.equal(values, container.dequantize())
    assert container.storage_bits() == raw.size * 8


@pytest.mark.parametrize("name", [n for n in TYPES if n != "IQ4_NL" and "K" not in n])
def test_rtn_error_is_at_most_llama_cpp_reference_quantizer(name):
    # the reference quantizer's own choice is among the candidates, rounded with the stored scale
    w = _weight(rows=16, width=256, seed=1)
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
    w = _weight(rows=8, width=128, seed=2).numpy()
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


def _llama_cpp_quantizer():
    """ggml's own row quantizer (``ggml_quantize_chunk``, no importance matrix), from the
    library llama-cpp-python ships."""
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]  # fmt: skip

    def quantize(w: np.ndarray, name: str) -> np.ndarray:
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, width = w.shape
        out = np.zeros((rows, width // block * size), dtype=np.uint8)
        x = np.ascontiguousarray(w, dtype=np.float32)
        lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, width, None)
        return gguf.quants.dequantize(out, qtype)

    return quantize


@pytest.mark.parametrize("name", ["Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL"])
def test_rtn_error_is_at_most_llama_cpps_own_quantizer(name):
    reference = _llama_cpp_quantizer()
    w = torch.randn(32, 1024, generator=torch.Generator().manual_seed(3))
    ref_err = float(((reference(w.numpy(), name) - w.numpy()) ** 2).sum())
    our_err = float(((_quantize(w, block_type(name))[0].dequantize() - w) ** 2).sum())
    # measured: 0.77x (Q2_K), 0.86x (Q6_K), 0.93-0.97x (Q3_K, Q4_K, Q5_K, IQ4_NL) llama.cpp's
    assert our_err <= ref_err


def test_k_type_sub_block_integers_decode_as_llama_cpp():
    # Q3_K's sixteen 6-bit scales are split over twelve bytes; every value -32..31 round trips
    kind = block_type("Q3_K")
    codes = torch.full((1, 256), 5, dtype=torch.uint8)  # level 1
    sub_scale = torch.arange(-32, 32, 4, dtype=torch.int8).reshape(1, 16)
    container = GGUFQuantized("Q3_K", codes, torch.ones(1, 1, dtype=torch.float16), None,
                              sub_scale)  # fmt: skip
    decoded = gguf.quants.dequantize(container.to_blocks(), gguf.GGMLQuantizationType.Q3_K)
    assert decoded.reshape(16, 16)[:, 0].tolist() == sub_scale[0].tolist()
    assert kind.bits_per_weight == 3.4375
