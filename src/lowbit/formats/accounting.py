"""Bits-per-element formulas of the papers lowbit implements, next to the containers' exact counts.

The containers' own ``bits_per_element()`` count what they store; these functions state the
papers' formulas (with their settings as arguments) so the two can be compared in tests.
"""

from __future__ import annotations

__all__ = [
    "two_order_bits",
    "mixed_2_4_bits",
    "csr_outlier_bits",
    "spqr_bits",
    "bfp_bits",
    "kvquant_bits",
]


def two_order_bits(
    n_bits: int, g1: int, scale_bits: int | None = None, g2: int | None = None
) -> float:
    """Li et al., 2024 (2/4/16-bit mixed precision), eqs. 6-7: ``N + (N + 16)/g1`` (1-order), or
    with ``scale_bits = N_s`` and ``g2``: ``N + (N + N_s)/g1 + (N_s + 16)/(g1 g2)`` (N-bit zero,
    N_s-bit scale per group; N_s-bit zero and 16-bit scale per group of scales)."""
    if scale_bits is None:
        return n_bits + (n_bits + 16) / g1
    return n_bits + (n_bits + scale_bits) / g1 + (scale_bits + 16) / (g1 * g2)


def csr_outlier_bits(
    fraction: float, rows: int, cols: int, word_bits: int = 32, ptr_bits: int = 32
) -> float:
    """Outliers in CSR: one ``word_bits`` word (16-bit index + fp16 value) per outlier plus a
    ``ptr_bits`` row pointer per row (``rows + 1`` of them), per matrix element."""
    return fraction * word_bits + ptr_bits * (rows + 1) / (rows * cols)


def mixed_2_4_bits(
    frac_4bit: float = 0.25,
    g1: int = 16,
    g2: int = 16,
    scale_bits: int = 4,
    outlier_fraction: float = 0.002,
    rows: int = 4096,
    cols: int = 4096,
) -> float:
    """Li et al.'s eq. 10 plus outliers: ``α (2 + (2 + N_s)/g1 + (N_s + 16)/(g1 g2)) + (1 - α) 4``
    with ``α = 1 - frac_4bit``, plus CSR outliers (:func:`csr_outlier_bits`). Defaults: the
    paper's Llama settings (g1 = g2 = 16, 0.2% outliers), N_s = 4 (its 4-bit 2-order scales),
    25% 4-bit groups counted at 4 bits as in eq. 10, and a 4096 × 4096 matrix for the row
    pointers: 2.8398 + 0.0640 + 0.0078 = 2.9116 ≈ the paper's 2.91."""
    alpha = 1.0 - frac_4bit
    dense = alpha * two_order_bits(2, g1, scale_bits, g2) + (1 - alpha) * 4
    return dense + csr_outlier_bits(outlier_fraction, rows, cols)


def spqr_bits(
    w_bits: int = 3, beta1: int = 16, beta2: int = 16, stat_bits: int = 3, second_bits: int = 16
) -> float:
    """SpQR bi-level statistics (Dettmers et al., 2024; §2 of Crnčević's master's thesis, 2025):
    ``w + (s + z)/β1 + 4 · 16/(β1 β2)``: a ``stat_bits`` scale and zero per row of β1 weights, and
    per β1 × β2 tile the fp16 scale and zero of the scales and of the zeros. 3-bit, β = 16: 3 +
    0.375 + 0.25 = 3.625 (sparse outliers extra). The thesis's 64-bit packed tile rows hold this
    in exactly 4 bits/weight."""
    return w_bits + 2 * stat_bits / beta1 + 4 * second_bits / (beta1 * beta2)


def bfp_bits(mantissa_bits: int, block_size: int, exponent_bits: int = 8) -> float:
    """BFP / MX: ``p + 8 / n`` (BFP12, n = 64: 4.125)."""
    return mantissa_bits + exponent_bits / block_size


def kvquant_bits(
    bits: int = 3,
    outlier_fraction: float = 0.01,
    hidden: int = 4096,
    n_levels_amortized: float = 0.0,
) -> float:
    """KVQuant nuqX with dense-and-sparse outliers, per cached element: ``bits`` for every
    element (outlier slots keep their dense code), 32 bits per outlier (fp16 value + 16-bit
    index), one 32-bit CSR row pointer per token of ``hidden`` elements, and the per-layer
    codebook amortised to ~0 over a long context (``n_levels_amortized`` adds it back).
    nuq3-1%, hidden 4096: 3 + 0.32 + 0.0078 = 3.328 ≈ the paper's 3.33."""
    return bits + outlier_fraction * 32 + 32 / hidden + n_levels_amortized
