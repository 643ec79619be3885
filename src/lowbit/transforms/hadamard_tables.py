"""Circulant ±1 sequences for Goethals–Seidel Hadamard matrices of order 4t.

Each entry ``t: (a, b, c, d)`` holds four first rows ('+' = +1, '-' = -1) of circulant
matrices A, B, C, D of order t with ``A A^T + B B^T + C C^T + D D^T = 4t I``. They were found
by lowbit's own search, ``tools/search_hadamard_sequences.py`` (rerun it to reproduce);
``hadamard._goethals_seidel`` turns them into a Hadamard matrix of order 4t.
"""

GOETHALS_SEIDEL_SEQUENCES: dict[int, tuple[str, str, str, str]] = {
    # order 92
    23: (
        "+++-++--+-+--+-+--++-++",
        "++-++--+++----+++--++-+",
        "-+---+++++-++-+++++---+",
        "++++--+-+-++++-+-+--+++",
    ),
    # order 116
    29: (
        "+++--++-+-++------++-+-++--++",
        "--++--++-+--++++++--+-++--++-",
        "+++-+-++---+-++++-+---++-+-++",
        "+-+++++-+++-+----+-+++-+++++-",
    ),
    # order 156
    39: (
        "--++++---++--+---+-+-+-++++++--+++----+",
        "--++-+-+++-++------+++--+--++-+++++-++-",
        "+++--+-++--+--+-+--++++-+---++-+++++-+-",
        "+++-++----+-+-+-++-+-+++++--++++++-++-+",
    ),
    # order 172
    43: (
        "+-+---+-+++--+++-+----++++-+---++---+-+++-+",
        "+-++-+--++--++++-+-++-+--+-+----++--++-+--+",
        "+++-+-+-+-++----+----++++--+---++--+--+++++",
        "-+-++++--+++++++++-+++-+++-----+-+-++++-++-",
    ),
}
