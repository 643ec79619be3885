"""Search Goethals–Seidel sequences for Hadamard orders 4t that Paley and Kronecker miss.

Writes nothing by itself: prints a ``t: (a, b, c, d)`` line per order found, to be pasted
into ``src/lowbit/transforms/hadamard_tables.py``. Usage::

    python tools/search_hadamard_sequences.py 23 29 39 43 47 59 65 73

Method (deterministic, no randomness): pick a subgroup M of the units of Z_t and restrict
each of the four ±1 sequences of length t to be constant on the orbits of Z_t under
multiplication by M. The discrete Fourier transform of such a sequence is constant on the
same orbits (X(u k) = X(k) for u in M), so the Goethals–Seidel condition
``|A(k)|^2 + |B(k)|^2 + |C(k)|^2 + |D(k)|^2 = 4t`` for every k only has to be checked on one
frequency per orbit. All 2^(orbits) sequences are enumerated, those with a spectral value
above 4t are dropped, and the four-way sum is solved meet-in-the-middle: pairs (A, B) and
(C, D) are grouped by row sums (the k = 0 term: four odd squares summing to 4t) and matched
on the rounded remaining spectral values. Each match is verified exactly (H H^T == 4t I).
Subgroups are tried from large (few orbits, fast) to small (many orbits, slow).

Result on 2 CPU cores (seconds each): found t = 23, 29, 39, 43, 65, 73 (orders 92, 116, 156,
172, 260, 292); nothing for t = 47, 59 (orders 188, 236): their subgroups of index 1 and
2 give no solution, {±1} (24 / 30 orbits, beyond max_orbits) would be Williamson type,
which does not exist for 47 and 59, and the trivial subgroup is the full 2^(4t) search.
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import numpy as np


def multiplicative_order_subgroups(t: int) -> list[list[int]]:
    """Cyclic subgroups of (Z/t)^*, largest first, as sorted element lists."""
    units = [u for u in range(1, t) if math.gcd(u, t) == 1]
    subgroups = set()
    for g in units:
        members, x = {1}, g
        while x != 1:
            members.add(x)
            x = x * g % t
        subgroups.add(tuple(sorted(members)))
    return [list(s) for s in sorted(subgroups, key=len, reverse=True)]


def orbits(t: int, subgroup: list[int]) -> list[list[int]]:
    seen, result = set(), []
    for i in range(t):
        if i not in seen:
            orbit = sorted({i * u % t for u in subgroup})
            seen.update(orbit)
            result.append(orbit)
    return result


def odd_square_splits(total: int) -> list[tuple[int, int, int, int]]:
    odd = [s for s in range(1, math.isqrt(total) + 1, 2)]
    return [
        c for c in itertools.combinations_with_replacement(odd, 4) if sum(x * x for x in c) == total
    ]


def goethals_seidel_ok(rows: list[np.ndarray]) -> bool:
    t = rows[0].shape[0]
    index = (np.arange(t)[None, :] - np.arange(t)[:, None]) % t
    total = sum(r[index] @ r[index].T for r in rows)
    return bool((total == 4 * t * np.eye(t, dtype=np.int64)).all())


def search(t: int, max_orbits: int = 16, max_pairs: int = 30_000_000) -> list[np.ndarray] | None:
    for subgroup in multiplicative_order_subgroups(t):
        orbit_list = orbits(t, subgroup)
        r = len(orbit_list)
        if r > max_orbits:
            continue
        start = time.time()
        membership = np.zeros((r, t), dtype=np.int64)  # [r, t]
        for o, orbit in enumerate(orbit_list):
            membership[o, orbit] = 1
        signs = 1 - 2 * ((np.arange(2**r)[:, None] >> np.arange(r)) & 1)  # [2^r, r]
        seqs = signs @ membership  # [2^r, t]
        seqs = seqs[seqs.sum(1) > 0]  # row sum odd; fix the sign of each sequence
        reps = np.array([orbit[0] for orbit in orbit_list])  # one frequency per orbit
        fourier = np.exp(-2j * np.pi * np.outer(np.arange(t), reps) / t)  # [t, r]
        psd = np.abs(seqs @ fourier) ** 2  # [N, r]
        keep = (psd <= 4 * t + 1e-6).all(1)
        seqs, psd = seqs[keep], psd[keep]
        row_sums = seqs.sum(1)
        for split in odd_square_splits(4 * t):
            groups = [np.flatnonzero(row_sums == s) for s in split]
            left_size = len(groups[0]) * len(groups[1])
            right_size = len(groups[2]) * len(groups[3])
            if min(left_size, right_size) == 0 or max(left_size, right_size) > max_pairs:
                continue
            li, lj = (g.ravel() for g in np.meshgrid(groups[0], groups[1], indexing="ij"))
            ri, rj = (g.ravel() for g in np.meshgrid(groups[2], groups[3], indexing="ij"))
            left = np.rint((psd[li] + psd[lj])[:, 1:] * 1e4).astype(np.int64)
            right = np.rint((4 * t - psd[ri] - psd[rj])[:, 1:] * 1e4).astype(np.int64)
            weights = np.random.default_rng(0).integers(1, 2**31, size=r - 1)
            left_key, right_key = left @ weights, right @ weights
            common, left_at, right_at = np.intersect1d(left_key, right_key, return_indices=True)
            for a in range(len(common)):
                rows = [
                    seqs[li[left_at[a]]],
                    seqs[lj[left_at[a]]],
                    seqs[ri[right_at[a]]],
                    seqs[rj[right_at[a]]],
                ]
                if goethals_seidel_ok(rows):
                    print(
                        f"# t={t}: subgroup of size {len(subgroup)}, {r} orbits, split {split},"
                        f" {time.time() - start:.1f}s",
                        file=sys.stderr,
                    )
                    return rows
        print(f"# t={t}: none with subgroup size {len(subgroup)} ({r} orbits)", file=sys.stderr)
    return None


def main(argv: list[str]) -> None:
    for t in (int(a) for a in argv) if argv else (23, 29, 39, 43, 47, 59, 65, 73):
        rows = search(t)
        if rows is None:
            print(f"# t={t}: not found", file=sys.stderr)
            continue
        strings = ", ".join('"' + "".join("+" if v > 0 else "-" for v in r) + '"' for r in rows)
        print(f"    {t}: ({strings}),")


if __name__ == "__main__":
    main(sys.argv[1:])
