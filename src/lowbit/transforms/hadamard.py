"""Hadamard matrices of order K·2^m and a fast Walsh–Hadamard transform in pure torch.

Conventions (used everywhere in lowbit):

* ``hadamard_matrix(n)`` returns an *unnormalized* Hadamard matrix ``H``: entries exactly
  ``±1`` and ``H @ H.T == n * I``. The orthonormal version is ``H / sqrt(n)``.
* For ``n = K * 2**m`` (``(K, 2**m) = hadamard_factorization(n)``)
  ``H_n = kron(S_{2**m}, H_K)`` (QuaRot's ``H_{2^n} ⊗ H_m``) where ``S`` is the Sylvester
  matrix (``S_1 = [1]``, ``S_{2h} = [[S_h, S_h], [S_h, -S_h]]``) and ``H_K`` the explicitly
  built matrix of order K. Index ``i`` of a length-n vector is ``i = p * K + k``: the
  butterfly mixes the slow (outer) axis of size 2^m, the K×K factor the fast (inner) axis.
* ``fast_hadamard_transform(x)`` computes ``x @ H_n.T / sqrt(n)`` along the last axis of
  ``x`` (``normalize=True``), i.e. the orthonormal transform ``y = H x / sqrt(n)`` applied
  to every row. ``H_n / sqrt(n)`` is orthogonal, so its inverse is its transpose:
  ``fast_hadamard_transform(y, K_matrix=H_K.T)`` applies ``kron(S, H_K.T) = H_n.T`` and
  undoes it. ``H_n`` is symmetric only when ``H_K`` is (Sylvester, Paley II).
* ``random_hadamard_matrix(n, seed=seed)`` is QuaRot's randomized Hadamard
  ``Q = H_n diag(s) / sqrt(n)`` (orthonormal, ``Q @ Q.T == I``). Online, with
  ``s = random_hadamard_signs(n, seed=seed)``: ``x @ Q.T == fast_hadamard_transform(x * s)``.

Constructions for the explicit factor K (all checked orthogonal in the tests):

* Sylvester: powers of two.
* Paley I: ``q + 1`` for a prime power ``q ≡ 3 (mod 4)`` (quadratic character over GF(q)).
* Paley II: ``2 (q + 1)`` for a prime power ``q ≡ 1 (mod 4)``.
* Goethals–Seidel arrays from four circulant ±1 sequences of length t (order 4t), found by
  ``tools/search_hadamard_sequences.py`` and stored in ``hadamard_tables.py``.
* Kronecker products ``H_a ⊗ H_b`` of two constructible orders.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.nn.spec import Rebuildable, register_module
from lowbit.settings import dtype_from_name, dtype_name

__all__ = [
    "OnlineHadamard",
    "fast_hadamard_transform",
    "hadamard_factorization",
    "hadamard_matrix",
    "has_hadamard",
    "random_hadamard_matrix",
    "random_hadamard_signs",
    "random_orthogonal_matrix",
]


# ---------------------------------------------------------------------------
# Finite fields GF(p^k): just enough for the quadratic character.
# ---------------------------------------------------------------------------


def _prime_power(q: int) -> tuple[int, int] | None:
    """Return ``(p, k)`` with ``q == p**k`` and p prime, or None."""
    if q < 2:
        return None
    p = next((d for d in range(2, math.isqrt(q) + 1) if q % d == 0), q)
    k = 0
    while q % p == 0:
        q //= p
        k += 1
    return (p, k) if q == 1 else None


@functools.lru_cache(maxsize=64)
def _gf_tables(q: int) -> tuple[np.ndarray, np.ndarray]:
    """Subtraction and quadratic-character tables of GF(q), q = p^k odd.

    Elements are the integers 0..q-1 read as base-p digit vectors (polynomial coefficients).

    Returns:
        difference: int64 [q, q], ``difference[a, b]`` is the element ``a - b``.
        character: int64 [q], 0 at 0, +1 on nonzero squares, -1 on non-squares.
    """
    p, k = _prime_power(q)  # type: ignore[misc]
    powers = p ** np.arange(k)  # [k]
    digits = (np.arange(q)[:, None] // powers) % p  # [q, k]
    diff_digits = (digits[:, None, :] - digits[None, :, :]) % p  # [q, q, k]
    difference = diff_digits @ powers  # [q, q]

    # Find a primitive polynomial f = x^k + c_{k-1} x^{k-1} + ... + c_0: then x generates the
    # multiplicative group, and x^i is a square exactly when i is even.
    for code in range(p**k):
        low_coeffs = (code // powers) % p  # [k], c_0..c_{k-1}
        if low_coeffs[0] == 0:
            continue
        element = np.zeros(k, dtype=np.int64)
        element[0] = 1  # the element 1
        character = np.zeros(q, dtype=np.int64)
        for exponent in range(q - 1):
            index = int(element @ powers)
            if character[index] != 0:
                break  # x has order < q - 1: f is not primitive
            character[index] = 1 if exponent % 2 == 0 else -1
            top = element[k - 1]
            element = (np.concatenate(([0], element[:-1])) - top * low_coeffs) % p
        else:
            return difference, character
    raise AssertionError(f"no primitive polynomial found for GF({q})")  # cannot happen


def _jacobsthal(q: int) -> np.ndarray:
    """Jacobsthal matrix Q[a, b] = chi(a - b) of GF(q), int64 [q, q]."""
    difference, character = _gf_tables(q)
    return character[difference]


# ---------------------------------------------------------------------------
# Constructions of the explicit factor.
# ---------------------------------------------------------------------------


def _sylvester(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order n = 2^m, int64 [n, n]."""
    h = np.ones((1, 1), dtype=np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _paley_one(q: int) -> np.ndarray:
    """Paley I: order q + 1 for a prime power q ≡ 3 (mod 4), int64 [q+1, q+1]."""
    jacobsthal = _jacobsthal(q)  # [q, q], antisymmetric since chi(-1) = -1
    skew = np.zeros((q + 1, q + 1), dtype=np.int64)  # skew conference matrix
    skew[0, 1:] = 1
    skew[1:, 0] = -1
    skew[1:, 1:] = jacobsthal
    return skew + np.eye(q + 1, dtype=np.int64)


def _paley_two(q: int) -> np.ndarray:
    """Paley II: order 2 (q + 1) for a prime power q ≡ 1 (mod 4), int64 [2q+2, 2q+2]."""
    jacobsthal = _jacobsthal(q)  # [q, q], symmetric since chi(-1) = +1
    conference = np.zeros((q + 1, q + 1), dtype=np.int64)  # symmetric, C @ C = q I
    conference[0, 1:] = 1
    conference[1:, 0] = 1
    conference[1:, 1:] = jacobsthal
    plus = np.array([[1, 1], [1, -1]], dtype=np.int64)
    minus = np.array([[1, -1], [-1, -1]], dtype=np.int64)
    return np.kron(conference, plus) + np.kron(np.eye(q + 1, dtype=np.int64), minus)


def _circulant(first_row: np.ndarray) -> np.ndarray:
    """Circulant matrix with ``C[i, j] = first_row[(j - i) % t]``, int64 [t, t]."""
    t = first_row.shape[0]
    index = (np.arange(t)[None, :] - np.arange(t)[:, None]) % t  # [t, t]
    return first_row[index]


def _goethals_seidel(rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Goethals–Seidel array: order 4t from four ±1 rows of length t.

    Needs circulants A, B, C, D with ``A A^T + B B^T + C C^T + D D^T = 4t I``; R is the
    back-diagonal permutation. Returns int64 [4t, 4t].
    """
    a, b, c, d = (_circulant(np.asarray(r, dtype=np.int64)) for r in rows)
    reverse = np.eye(a.shape[0], dtype=np.int64)[::-1]
    br, cr, dr = b @ reverse, c @ reverse, d @ reverse
    return np.block(
        [
            [a, br, cr, dr],
            [-br, a, d.T @ reverse, -c.T @ reverse],
            [-cr, -d.T @ reverse, a, b.T @ reverse],
            [-dr, c.T @ reverse, -b.T @ reverse, a],
        ]
    )


def _goethals_seidel_table() -> dict[int, tuple[str, str, str, str]]:
    from lowbit.transforms.hadamard_tables import GOETHALS_SEIDEL_SEQUENCES

    return GOETHALS_SEIDEL_SEQUENCES


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@functools.cache
def _base_construction(order: int) -> tuple | None:
    """How to build a Hadamard matrix of this order, or None if lowbit knows no way.

    Returns a recipe tuple: ("sylvester",), ("paley1", q), ("paley2", q),
    ("goethals_seidel", t) or ("kronecker", a, b). Tried in that order.
    """
    if order < 1:
        return None
    if _is_power_of_two(order):
        return ("sylvester",)
    if order % 4 != 0:
        return None  # Hadamard orders > 2 are multiples of 4
    q = order - 1
    if q % 4 == 3 and _prime_power(q) is not None:
        return ("paley1", q)
    q = order // 2 - 1
    if q % 4 == 1 and _prime_power(q) is not None:
        return ("paley2", q)
    if order // 4 in _goethals_seidel_table():
        return ("goethals_seidel", order // 4)
    for a in range(2, math.isqrt(order) + 1):
        if order % a == 0 and _base_construction(a) and _base_construction(order // a):
            return ("kronecker", a, order // a)
    return None


@functools.lru_cache(maxsize=32)
def _base_matrix_numpy(order: int) -> np.ndarray:
    """Explicit Hadamard matrix of a constructible order, int64 [order, order] (read-only)."""
    recipe = _base_construction(order)
    if recipe is None:
        raise _no_construction_error(order)
    kind = recipe[0]
    if kind == "sylvester":
        matrix = _sylvester(order)
    elif kind == "paley1":
        matrix = _paley_one(recipe[1])
    elif kind == "paley2":
        matrix = _paley_two(recipe[1])
    elif kind == "goethals_seidel":
        rows = tuple(
            np.array([1 if s == "+" else -1 for s in row], dtype=np.int64)
            for row in _goethals_seidel_table()[recipe[1]]
        )
        matrix = _goethals_seidel(rows)  # type: ignore[arg-type]
    else:
        matrix = np.kron(_base_matrix_numpy(recipe[1]), _base_matrix_numpy(recipe[2]))
    matrix.setflags(write=False)
    return matrix


# ---------------------------------------------------------------------------
# Factorization n = K * 2^m.
# ---------------------------------------------------------------------------


def _factorize(n: int, is_base_order) -> tuple[int, int] | None:
    """Smallest K with ``n == K * 2**m`` and ``is_base_order(K)``, as ``(K, 2**m)``.

    Every divisor of the form ``n / 2**m`` is tried, from the smallest K upwards, so an
    order whose smallest candidate (e.g. 9 or 18 for 576) has no matrix still finds a larger
    one (36 for 576). Powers of two give K = 1.
    """
    if n < 1:
        return None
    power = 1
    while n % (2 * power) == 0:
        power *= 2
    while power >= 1:  # K = n // power grows as power shrinks
        k = n // power
        if is_base_order(k):
            return k, power
        power //= 2
    return None


def _unknown_orders_sentence() -> str:
    missing = [str(k) for k in range(4, 257, 4) if _base_construction(k) is None]
    return "every multiple of 4 up to 256" + (f" except {', '.join(missing)}" if missing else "")


def _no_construction_error(n: int) -> LowbitError:
    if n < 1:
        return LowbitError(f"no Hadamard matrix of order {n} exists: the order must be positive")
    reason = "odd orders above 2 do not exist, " if n > 2 and n % 2 == 1 else ""
    return LowbitError(
        f"no Hadamard matrix of order {n} is known to lowbit ({reason}orders must be K*2^m with"
        f" K = 1 or a constructible K: {_unknown_orders_sentence()}); pass"
        " allow_random=True to random_hadamard_matrix for a random orthogonal matrix instead"
    )


def hadamard_factorization(n: int) -> tuple[int, int]:
    """Split n into ``(K, 2**m)`` with ``n == K * 2**m`` and H_K built explicitly.

    All divisors ``K = n / 2**m`` are tried and the smallest K with a known construction
    wins (cheapest online transform: one K×K product per length-n vector, the rest is
    the O(n log n) butterfly). Powers of two give ``(1, n)``.

    Raises:
        LowbitError: if no divisor of that form has a construction.
    """
    found = _factorize(n, lambda k: _base_construction(k) is not None)
    if found is None:
        raise _no_construction_error(n)
    return found


def has_hadamard(n: int) -> bool:
    """Whether ``hadamard_matrix(n)`` succeeds."""
    return n >= 1 and _factorize(n, lambda k: _base_construction(k) is not None) is not None


def hadamard_matrix(n: int, *, dtype=torch.float64, device=None) -> Tensor:
    """Hadamard matrix of order n: entries ±1, ``H @ H.T == n * I``.

    ``H = kron(Sylvester_{2**m}, H_K)`` with ``(K, 2**m) = hadamard_factorization(n)``;
    ``fast_hadamard_transform`` applies exactly this matrix.

    Args:
        n: the order.
        dtype, device: of the returned tensor.

    Returns:
        [n, n] tensor.

    Raises:
        LowbitError: if lowbit knows no construction for n.
    """
    k, power = hadamard_factorization(n)
    matrix = np.kron(_sylvester(power), _base_matrix_numpy(k))  # [n, n]
    return torch.as_tensor(matrix, dtype=dtype, device=device)


def _base_matrix_tensor(k: int, dtype: torch.dtype, device) -> Tensor:
    """The explicit K×K factor of the transform as a tensor, [k, k]."""
    return torch.tensor(_base_matrix_numpy(k), dtype=dtype, device=device)


# ---------------------------------------------------------------------------
# Random rotations.
# ---------------------------------------------------------------------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(int(seed))


def _target(device) -> torch.device:
    """Where a random matrix drawn on the CPU goes: ``device``, else the default device (as
    for torch's factories, so a module built under ``with torch.device(...)`` holds it there)."""
    return torch.get_default_device() if device is None else torch.device(device)


def random_hadamard_signs(n: int, *, seed: int, dtype=torch.float64, device=None) -> Tensor:
    """The random ±1 vector s of ``random_hadamard_matrix(n, seed=seed)``, shape [n].

    Drawn on the CPU from ``torch.Generator().manual_seed(seed)``, so it is the same on
    every device.
    """
    bits = torch.randint(0, 2, (n,), generator=_generator(seed), device="cpu")  # [n]
    return (2 * bits - 1).to(dtype=dtype, device=_target(device))


def random_orthogonal_matrix(n: int, *, seed: int, dtype=torch.float64, device=None) -> Tensor:
    """Haar-random orthogonal matrix Q (``Q @ Q.T == I``), deterministic for a seed.

    QR of a standard Gaussian matrix (float64, CPU generator), with the signs of R's
    diagonal moved into Q so the distribution is Haar.

    Returns:
        [n, n] tensor.
    """
    if n < 1:
        raise LowbitError(f"a random orthogonal matrix needs a positive order, got {n}")
    gaussian = torch.randn(
        n, n, generator=_generator(seed), dtype=torch.float64, device="cpu"
    )  # [n, n]
    q, r = torch.linalg.qr(gaussian)
    diagonal_signs = torch.sign(torch.diagonal(r))  # [n]
    diagonal_signs[diagonal_signs == 0] = 1
    return (q * diagonal_signs).to(dtype=dtype, device=_target(device))


def random_hadamard_matrix(
    n: int, *, seed: int, dtype=torch.float64, device=None, allow_random: bool = False
) -> Tensor:
    """QuaRot's randomized Hadamard ``Q = H diag(s) / sqrt(n)``: orthonormal, ``Q @ Q.T == I``.

    Args:
        n: the order.
        seed: picks s = ``random_hadamard_signs(n, seed=seed)``.
        allow_random: if no Hadamard matrix of order n is known, return
            ``random_orthogonal_matrix(n, seed=seed)`` instead of raising.

    Returns:
        [n, n] tensor.
    """
    if not has_hadamard(n):
        if allow_random and n >= 1:
            return random_orthogonal_matrix(n, seed=seed, dtype=dtype, device=device)
        raise _no_construction_error(n)
    signs = random_hadamard_signs(n, seed=seed, device="cpu")  # [n]
    matrix = hadamard_matrix(n, device="cpu") * signs / math.sqrt(n)  # [n, n], column j scaled
    return matrix.to(dtype=dtype, device=_target(device))


# ---------------------------------------------------------------------------
# Fast transform.
# ---------------------------------------------------------------------------


def _sylvester_butterfly(x: Tensor, inner: int) -> Tensor:
    """Sylvester transform on the axis of size P in ``x`` viewed as [R, P, inner].

    log2(P) add/sub stages that ping-pong between two buffers (no allocation per stage);
    each stage pairs blocks ``half * inner`` apart. Never writes into x.

    Args:
        x: [..., P * inner] contiguous.
        inner: size of the untouched inner axis (the K axis of ``kron(S_P, H_K)``).

    Returns:
        tensor of x's shape: ``y[r, p, i] = sum_q S_P[p, q] x[r, q, i]``.
    """
    width = x.shape[-1]
    size = width // inner
    source = x.reshape(-1, width)  # [R, P * inner]
    if size == 1:
        return x.clone()
    if torch.is_grad_enabled() and x.requires_grad:
        # out= writes are not differentiable: the same stages out of place (e.g. Fisher passes)
        half = 1
        while half < size:
            pairs = source.reshape(-1, size // (2 * half), 2, half * inner)
            first, second = pairs[:, :, 0], pairs[:, :, 1]  # [R, blocks, half*inner]
            source = torch.stack((first + second, first - second), dim=2)
            half *= 2
        return source.reshape(x.shape)
    buffers = [torch.empty_like(source), None]
    half, stage = 1, 0
    while half < size:
        target = buffers[stage % 2]
        if target is None:
            target = buffers[stage % 2] = torch.empty_like(source)
        pairs = source.view(-1, size // (2 * half), 2, half * inner)  # [R, blocks, 2, half*inner]
        out = target.view(pairs.shape)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
        source = target
        half, stage = half * 2, stage + 1
    return source.view(x.shape)


def fast_hadamard_transform(
    x: Tensor,
    *,
    normalize: bool = True,
    K_matrix: Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Apply ``H_n`` along the last axis of x without ever forming an n×n matrix.

    Equals ``x @ hadamard_matrix(n).T / sqrt(n)`` (``normalize=True``) with
    ``H_n = kron(Sylvester_{2**m}, H_K)``: x is viewed as [..., 2**m, K], a butterfly mixes
    the outer 2^m axis (O(n log n) adds) and one [.., K] @ [K, K] GEMM the inner K axis.

    Args:
        x: [..., n], any leading shape.
        normalize: divide by sqrt(n) so the transform is orthonormal. The scale is applied
            before the butterfly so float16 intermediate sums stay in range.
        K_matrix: the [K, K] factor, e.g. a module buffer; built from
            ``hadamard_factorization(n)`` when None. Passing ``H_K.T`` applies ``H_n.T``,
            the inverse of the orthonormal transform.
        compute_dtype: dtype for the arithmetic (default: x's dtype); the result is cast back
            to x's dtype. QuaRot runs its online transforms in float32.

    Returns:
        [..., n] tensor of x's dtype.
    """
    n = x.shape[-1]
    k, _ = hadamard_factorization(n)
    work_dtype = compute_dtype or x.dtype
    y = x.to(work_dtype).contiguous()
    if normalize:
        y = y * (1.0 / math.sqrt(n))
    y = _sylvester_butterfly(y, inner=k)  # [..., n] = [..., P * K]
    if k > 1:
        if K_matrix is None:
            K_matrix = _base_matrix_tensor(k, work_dtype, x.device)
        elif tuple(K_matrix.shape) != (k, k):
            raise LowbitError(
                f"K_matrix has shape {tuple(K_matrix.shape)} but order {n} needs a {k}x{k} factor"
            )
        factor = K_matrix.to(dtype=work_dtype, device=y.device)  # [K, K], e.g. a CPU constant
        y = y.view(-1, k) @ factor.T  # [R * P, K] @ [K, K] -> [R * P, K]
    return y.reshape(x.shape).to(x.dtype)


@register_module
class OnlineHadamard(Rebuildable, torch.nn.Module):
    """Orthonormal Hadamard transform along the last axis, whole or per group.

    ``group_size=None``: ``y = fast_hadamard_transform(x)`` over the full last axis of size n.
    ``group_size=g``: x is viewed as [..., n // g, g] and each group (e.g. each attention
    head) is transformed on its own, i.e. ``H = kron(I_{n/g}, H_g)``.
    Holds only the K×K factor (non-persistent buffer ``K_matrix``, None when K = 1).

    Args:
        n: size of the last axis.
        group_size: transform size per group; must divide n.
        compute_dtype: arithmetic dtype (default: the input's dtype).
    """

    spec_fields = {"n": int, "group_size": int | None, "compute_dtype": torch.dtype | None}

    def __init__(
        self, n: int, *, group_size: int | None = None, compute_dtype: torch.dtype | None = None
    ):
        super().__init__()
        size = n if group_size is None else group_size
        if size < 1 or n % size != 0:
            raise LowbitError(f"group_size {group_size} must be positive and divide n = {n}")
        self.n, self.size, self.compute_dtype = n, size, compute_dtype
        k, _ = hadamard_factorization(size)
        factor = _base_matrix_tensor(k, torch.float32, None) if k > 1 else None
        self.register_buffer("K_matrix", factor, persistent=False)

    def spec(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "group_size": None if self.size == self.n else self.size,
            "compute_dtype": dtype_name(self.compute_dtype),
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> OnlineHadamard:
        dtype = dtype_from_name(spec["compute_dtype"])
        return cls(spec["n"], group_size=spec["group_size"], compute_dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., n] -> [..., n]."""
        if x.shape[-1] != self.n:
            raise LowbitError(f"OnlineHadamard expects last dim {self.n}, got {x.shape[-1]}")
        groups = x.reshape(*x.shape[:-1], self.n // self.size, self.size)  # [..., n/g, g]
        factor = self.K_matrix
        y = fast_hadamard_transform(groups, K_matrix=factor, compute_dtype=self.compute_dtype)
        return y.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"n={self.n}, group_size={self.size}, compute_dtype={self.compute_dtype}"
