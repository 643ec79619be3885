"""Number formats: pure tensor math with no model knowledge (CPU or GPU tensors).

Each format has a packed face (``*Quantized.from_float`` → packed data + metadata,
``dequantize()``) and a simulated face (``fake_quant_*``); the two agree bit for bit.
"""

from lowbit.formats.accounting import (
    bfp_bits,
    csr_outlier_bits,
    kvquant_bits,
    mixed_2_4_bits,
    spqr_bits,
    two_order_bits,
)
from lowbit.formats.bfp import (
    BFP_FORMATS,
    BFPQuantized,
    bfp_dequantize,
    bfp_quantize,
    fake_quant_bfp,
)
from lowbit.formats.intq import (
    IntQuantized,
    fake_quant_int,
    int_dequantize_with,
    int_qrange,
    int_quantize_with,
    int_scale_zero,
)
from lowbit.formats.mixed import MixedQuantized, mixed_rtn, mixed_statistics
from lowbit.formats.nuq import (
    NUQQuantized,
    fake_quant_nuq,
    fit_codebook,
    normal_float_codebook,
    nuq_dequantize,
    nuq_normalize,
    nuq_quantize,
)
from lowbit.formats.packing import (
    interleave_permutation,
    pack_bits,
    packed_words_per_row,
    unpack_bits,
)
from lowbit.formats.sparse import (
    CSCMatrix,
    CSRMatrix,
    PTCSRMatrix,
    pack_index_value,
    split_outliers,
    unpack_index_value,
)
from lowbit.formats.spqr import SpQRQuantized

__all__ = [
    "BFP_FORMATS",
    "BFPQuantized",
    "bfp_dequantize",
    "bfp_quantize",
    "fake_quant_bfp",
    "bfp_bits",
    "csr_outlier_bits",
    "kvquant_bits",
    "mixed_2_4_bits",
    "spqr_bits",
    "two_order_bits",
    "MixedQuantized",
    "mixed_rtn",
    "mixed_statistics",
    "NUQQuantized",
    "fake_quant_nuq",
    "fit_codebook",
    "normal_float_codebook",
    "nuq_dequantize",
    "nuq_normalize",
    "nuq_quantize",
    "SpQRQuantized",
    "CSCMatrix",
    "CSRMatrix",
    "PTCSRMatrix",
    "pack_index_value",
    "split_outliers",
    "unpack_index_value",
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
