import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import LowbitError
from lowbit.formats.nuq import (
    NUQQuantized,
    fake_quant_nuq,
    fit_codebook,
    normal_float_codebook,
)

# bitsandbytes' published NF4 table (QLoRA appendix), ascending
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]  # fmt: skip


def test_nf4_matches_published_table():
    # the published values come from a slightly different float path: agree to 1e-6
    assert torch.allclose(normal_float_codebook(4), torch.tensor(NF4), atol=1e-6, rtol=0)


def _naive_lloyd(x, w, centroids, iters, pin_ends=False):
    for _ in range(iters):
        d = (x[:, None] - centroids[None, :]).abs()
        assign = d.argmin(1)  # first (lower) on ties
        new = centroids.clone()
        for j in range(len(centroids)):
            m = assign == j
            if w[m].sum() > 0:
                new[j] = (w[m] * x[m]).sum() / w[m].sum()
        if pin_ends:
            new[[0, -1]] = torch.stack([x.min(), x.max()])
        centroids = new.sort().values
    return centroids


def test_fit_codebook_matches_naive_weighted_lloyd():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g).double()
    w = torch.rand(3000, generator=g).double()
    probs = (torch.arange(8, dtype=torch.float64) + 0.5) / 8
    xs, order = x.sort()
    cum = torch.cumsum(w[order], 0) / w.sum()
    init = xs[torch.searchsorted(cum, probs)]
    ref = _naive_lloyd(x, w, init, 30)
    ours = fit_codebook(x.float(), 8, w.float(), max_iter=30, tol=0.0)
    assert torch.allclose(ours.double(), ref, atol=1e-5)


def test_pinned_ends_stay_at_the_data_extremes_and_inner_levels_follow_lloyd():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g).clamp(-1.5, 1.5).double()  # clamped mass at both ends
    w = torch.rand(4000, generator=g).double()
    pinned = fit_codebook(x.float(), 8, w.float(), pin_ends=True, max_iter=40, tol=0.0)
    assert pinned[0] == -1.5 and pinned[-1] == 1.5
    assert fit_codebook(x.float(), 8, w.float())[-1] < 1.5  # free Lloyd pulls the end inward
    # the inner levels are the weighted means of their cells given the pinned ends
    bounds = (pinned[1:] + pinned[:-1]).double() / 2
    cell = torch.searchsorted(bounds, x.contiguous(), right=False)  # [N], ties to the lower
    for j in range(1, 7):
        m = cell == j
        want = (w[m] * x[m]).sum() / w[m].sum()
        assert abs(float(pinned[j]) - float(want)) < 1e-5


def _weighted_error(x, w, codebook):
    bounds = (codebook[1:] + codebook[:-1]) / 2
    return float((w * (codebook[torch.bucketize(x, bounds)] - x).square()).sum())


def test_lloyd_from_a_given_grid_ends_no_worse_than_it_under_heavy_tailed_weights():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g) * 0.4).clamp(-1, 1)
    w = torch.exp(3 * torch.randn(20000, generator=g))  # heavy-tailed, like Fisher information
    grid = torch.linspace(-1, 1, 16)
    from_grid = fit_codebook(x, 16, w, pin_ends=True, init=grid)
    # measured: 0.64 times the grid's weighted error
    assert _weighted_error(x, w, from_grid) < 0.7 * _weighted_error(x, w, grid)
    # the same steps as plain Lloyd from that start, ends held at the data extremes
    ref = _naive_lloyd(x.double(), w.double(), grid.double(), 30, pin_ends=True)
    ours = fit_codebook(x, 16, w, pin_ends=True, init=grid, max_iter=30, tol=0.0)
    assert torch.allclose(ours.double(), ref, atol=1e-5)


def test_dead_centroids_move_into_the_cells_with_the_largest_error():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 0.02 - 0.9, torch.randn(4000, generator=g) * 0.02 + 0.9])  # fmt: skip
    w = torch.rand(8000, generator=g) + 0.5
    grid = torch.linspace(-1, 1, 4)  # the inner two levels, at ±1/3, serve no sample
    stuck = _naive_lloyd(x.double(), w.double(), grid.double(), 50)
    assert torch.allclose(stuck[1:3], grid[1:3].double())  # plain Lloyd leaves them there
    fitted = fit_codebook(x, 4, w, init=grid)
    assert int((fitted < 0).sum()) == 2  # two levels per cluster
    # measured: 0.37 times plain Lloyd's weighted error
    assert _weighted_error(x, w, fitted) < 0.5 * _weighted_error(x, w, stuck.float())


def test_weights_pull_centroids_and_fit_is_deterministic():
    x = torch.linspace(-1, 1, 10001)
    heavy_right = torch.where(x > 0.5, 100.0, 1.0)
    plain = fit_codebook(x, 4)
    weighted = fit_codebook(x, 4, heavy_right)
    assert (weighted > 0.5).sum() > (plain > 0.5).sum()
    assert torch.equal(fit_codebook(x, 4, heavy_right), weighted)


def test_kmeans_codebook_beats_uniform_grid_on_gaussian():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(1))
    cb = fit_codebook(x, 8)
    uniform = torch.linspace(float(x.min()), float(x.max()), 8)
    err_k = (fake_quant_nuq(x, cb, normalize=None) - x).pow(2).mean()
    err_u = (fake_quant_nuq(x, uniform, normalize=None) - x).pow(2).mean()
    assert err_k < 0.5 * err_u  # measured ≈ 0.32


@pytest.mark.parametrize(
    "kw",
    [
        dict(axis=-2),  # keys: per channel over tokens
        dict(axis=-1),  # values: per token
        dict(axis=None, normalize="absmax"),
        dict(axis=-1, normalize=None),
        dict(axis=-2, stat_dtype=torch.float16),
    ],
    ids=str,
)
def test_packed_equals_simulated_bit_exact(kw):
    k = torch.randn(2, 48, 64)
    cb = normal_float_codebook(3)
    assert torch.equal(
        NUQQuantized.from_float(k, cb, **kw).dequantize(), fake_quant_nuq(k, cb, **kw)
    )


def test_per_channel_codebook():
    k = torch.randn(40, 16)
    cbs = torch.stack([normal_float_codebook(2) * (1 + c / 16) for c in range(16)])  # [16, 4]
    out = fake_quant_nuq(k, cbs, axis=0, codebook_axis=1)
    for c in (0, 7, 15):  # each channel uses its own codebook
        col = fake_quant_nuq(k[:, c : c + 1], cbs[c], axis=0)
        assert torch.equal(out[:, c : c + 1], col)
    assert torch.equal(NUQQuantized.from_float(k, cbs, axis=0, codebook_axis=1).dequantize(), out)


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**16),
    bits=st.integers(1, 4),
    scale=st.floats(1e-3, 1e3),
)
def test_nearest_entry_and_idempotent(seed, bits, scale):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)) * scale
    cb = fit_codebook(x, 2**bits)
    out = fake_quant_nuq(x, cb, normalize=None)
    # every output is a codebook entry at minimal distance
    dist = (x[..., None] - cb).abs().amin(-1)
    assert torch.allclose((out - x).abs(), dist, rtol=1e-6, atol=0)
    assert torch.equal(fake_quant_nuq(out, cb, normalize=None), out)


def test_storage_accounting():
    k = torch.randn(1, 256, 128)  # [heads, tokens, head_dim]
    q = NUQQuantized.from_float(k, normal_float_codebook(3), axis=-2, stat_dtype=torch.float16)
    # 3-bit indices + per-channel (128) center and half range in fp16 + 8 fp32 entries
    assert q.storage_bits() == 256 * 128 * 3 + 128 * 2 * 16 + 8 * 32
    assert q.bits_per_element(include_codebook=False) == 3 + 2 * 16 / 256


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fake_quant_nuq(torch.randn(4, 8), torch.tensor([0.0, 1.0, 2.0])), "power of two"),
        (lambda: fake_quant_nuq(torch.randn(4, 8), torch.tensor([1.0, 0.0])), "sorted"),
        (lambda: fake_quant_nuq(torch.tensor([[float("nan")]]), torch.tensor([0.0, 1.0])), "NaN"),
        (
            lambda: fake_quant_nuq(torch.ones(2, 2, dtype=torch.int64), torch.tensor([0.0, 1.0])),
            "floating",
        ),
        (lambda: fit_codebook(torch.randn(10), 1), "n_levels"),
        (lambda: fit_codebook(torch.randn(10), 4, -torch.ones(10)), "weights"),
        (lambda: fit_codebook(torch.empty(0), 4), "empty"),
        (lambda: fit_codebook(torch.randn(10), 4, init=torch.zeros(3)), "init"),
        (lambda: fit_codebook(torch.randn(10), 2, init=torch.tensor([1.0, 0.0])), "init"),
        (
            lambda: fake_quant_nuq(torch.randn(4, 8), torch.zeros(3, 4), codebook_axis=0),
            "per-channel",
        ),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(LowbitError, match=match):
        call()
