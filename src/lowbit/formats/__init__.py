"""Number formats: pure tensor math with no model knowledge (CPU or GPU tensors).

Each format has a packed face (``*Quantized.from_float`` → packed data + metadata,
``dequantize()``) and a simulated face (``fake_quant_*``); the two agree bit for bit.
"""

from lowbit.formats.intq import (
    IntQuantized,
    fake_quant_int,
    int_dequantize_with,
    int_qrange,
    int_quantize_with,
    int_scale_zero,
)
from lowbit.formats.packing import (
    interleave_permutation,
    pack_bits,
    packed_words_per_row,
    unpack_bits,
)

__all__ = [
    "IntQuantized",
    "fake_quant_int",
    "int_dequantize_with",
    "int_qrange",
    "int_quantize_with",
    "int_scale_zero",
    "interleave_permutation",
    "pack_bits",
    "packed_words_per_row",
    "unpack_bits",
]
