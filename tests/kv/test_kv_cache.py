"""The quantized cache layer: what it stores where, measured bytes == analytic bytes, sizes
reported to transformers, batch selection."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.kv import (
    IntChannelQuantizer,
    IntTokenQuantizer,
    KIVIKeyQuantizer,
    KIVIValueQuantizer,
    KVCacheLayout,
    QuantizedKVLayer,
)
from lowbit.kv.bfp_quant import BFPKVQuantizer
from lowbit.kv.kvquant import KVQuantQuantizer


def _kv(batch, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, tokens, 16, generator=g), torch.randn(
        batch, 2, tokens, 16, generator=g
    )


def _feed(layer, k, v, chunks):
    start, out = 0, None
    for size in chunks:
        out = layer.update(k[:, :, start : start + size], v[:, :, start : start + size])
        start += size
    return out


def test_sinks_packed_chunks_and_residual():
    layer = QuantizedKVLayer(
        IntChannelQuantizer(4, token_group=4), IntTokenQuantizer(4), sink_tokens=2, fp_window=3
    )
    k, v = _kv(1, 20)
    keys, values = _feed(layer, k, v, [5, 1, 14])
    assert layer.get_seq_length() == 20 and keys.shape == k.shape
    assert layer.k.sink.shape[2] == 2 and layer.v.sink.shape[2] == 2
    # keys: 18 after the sinks, >= 3 kept in fp, packed in whole groups of 4 -> 12 packed, 6 fp
    assert layer.k.chunks[0].num_tokens == 12 and layer.k.residual.shape[2] == 6
    assert layer.v.chunks[0].num_tokens == 15 and layer.v.residual.shape[2] == 3
    assert len(layer.k.chunks) == 1  # chunks are joined as they arrive
    assert torch.equal(keys[:, :, :2], k[:, :, :2])  # sinks and recent tokens are exact
    assert torch.equal(keys[:, :, -6:], k[:, :, -6:])
    assert not torch.equal(keys[:, :, 2:14], k[:, :, 2:14])
    assert layer.get_mask_sizes(3) == (23, 0)


def test_sinks_hold_their_own_storage_not_the_prompts():
    """A sink is a copy of its tokens: not a view that keeps the whole prompt's keys and values
    (as converted to the residual dtype) alive for the cache's lifetime."""
    layer = QuantizedKVLayer(
        IntTokenQuantizer(4), IntTokenQuantizer(4), sink_tokens=1, residual_dtype=torch.float16
    )
    k, v = _kv(1, 64)
    layer.store(k, v)
    for sink in (layer.k.sink, layer.v.sink):  # 64 bytes of storage, not the prompt's 4 KB
        assert sink.untyped_storage().nbytes() == sink.numel() * sink.element_size()


def test_sinks_follow_positions_under_left_padding():
    layer = QuantizedKVLayer(IntTokenQuantizer(2), IntTokenQuantizer(2), sink_tokens=1)
    k, v = _kv(2, 6)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 1, 0, 1, 2, 3]])  # row 1: two pads
    keys, values = layer.update(k, v, {"positions": positions})
    for row, first in ((0, 0), (1, 2)):  # each row's first real token comes back exactly
        assert torch.equal(keys[row, :, first], k[row, :, first])
        assert torch.equal(values[row, :, first], v[row, :, first])
    assert not torch.equal(keys[1, :, 3], k[1, :, 3])  # the rest is quantized
    assert layer.k.pinned_rows.tolist() == [1] and layer.k.pinned_slots.tolist() == [2]
    before = layer.nbytes()
    # beams: the pinned token follows its row
    layer.reorder_cache(torch.tensor([1, 1, 0]))
    keys, _ = layer.update(*_kv(3, 1, seed=1), {"positions": torch.tensor([[6], [4], [4]])})
    for row in (0, 1):
        assert torch.equal(keys[row, :, 2], k[1, :, 2])
    assert torch.equal(keys[2, :, 0], k[0, :, 0])
    assert layer.nbytes() > before
    # without positions (or without padding) nothing is pinned
    plain = QuantizedKVLayer(IntTokenQuantizer(2), IntTokenQuantizer(2), sink_tokens=1)
    plain.update(k, v, {"positions": torch.arange(6)[None]})
    assert plain.k.pinned is None


@pytest.mark.parametrize("chunks", [[40], [1] * 40, [7, 13, 1, 19], [16, 16, 8]])
def test_quantization_does_not_depend_on_arrival_for_per_token(chunks):
    k, v = _kv(2, 40)
    whole = QuantizedKVLayer(IntTokenQuantizer(3), IntTokenQuantizer(2), sink_tokens=1)
    pieces = QuantizedKVLayer(IntTokenQuantizer(3), IntTokenQuantizer(2), sink_tokens=1)
    a = _feed(whole, k, v, [40])
    b = _feed(pieces, k, v, chunks)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


LAYOUTS = {
    "int4-token": lambda n: KVCacheLayout(
        [IntTokenQuantizer(4)] * n, [IntTokenQuantizer(4)] * n, residual_dtype=torch.float16
    ),
    "int3-channel-pre-rope-sink": lambda n: KVCacheLayout(
        [IntChannelQuantizer(3, token_group=8)] * n,
        [IntTokenQuantizer(3, group_size=8)] * n,
        sink_tokens=1,
        residual_dtype=torch.float16,
        track_positions=True,
    ),
    "kivi2": lambda n: KVCacheLayout(
        [KIVIKeyQuantizer(2, 8)] * n,
        [KIVIValueQuantizer(2, 8)] * n,
        fp_window=16,
        residual_dtype=torch.float16,
    ),
    "values-only": lambda n: KVCacheLayout(
        [None] * n, [IntTokenQuantizer(2)] * n, residual_dtype=torch.float16
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("tokens, chunks", [(37, [37]), (37, [5, 1, 1, 30]), (64, [16] * 4)])
def test_measured_bytes_equal_analytic(name, tokens, chunks):
    """Measured from the stored tensors == KVCacheLayout.bytes_per_token, exactly: the split
    between packed and fp tokens depends only on the token count, and the formats store whole
    bytes per packed row, so there is no padding to amortize."""
    layout = LAYOUTS[name](2)
    cache = layout.make_cache()
    k, v = _kv(1, tokens)
    for layer_idx in range(2):
        start = 0
        for size in chunks:
            positions = torch.arange(start, start + size)[None]
            cache.update(
                k[:, :, start : start + size],
                v[:, :, start : start + size],
                layer_idx,
                {"positions": positions},
            )
            start += size
    expected = layout.bytes_per_token(num_kv_heads=2, head_dim=16, context_length=tokens)
    assert cache.bytes_per_token() == pytest.approx(expected, rel=1e-12)
    fp16 = 2 * 2 * 2 * 16 * 2  # layers x (K, V) x heads x head_dim x 2 bytes
    assert cache.bytes_per_token() < fp16


def test_positions_are_kept_once_per_cache():
    layout = LAYOUTS["int3-channel-pre-rope-sink"](3)
    cache = layout.make_cache()
    k, v = _kv(2, 5)
    pos = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    for i in range(3):
        cache.update(k, v, i, {"positions": pos})
    assert torch.equal(cache.layers[2].positions(), pos)
    assert cache.layers[0].nbytes() - cache.layers[1].nbytes() == pos.numel() * 4


def test_batch_select_and_reorder():
    layout = LAYOUTS["kivi2"](1)
    cache = layout.make_cache()
    k, v = _kv(3, 30)
    cache.update(k, v, 0)
    full_k, full_v = cache.layers[0].k.full(torch.float32), cache.layers[0].v.full(torch.float32)
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert torch.equal(cache.layers[0].k.full(torch.float32), full_k[[2, 2, 0]])
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache.layers[0].v.full(torch.float32), full_v[[2]])
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].k.full(torch.float32).shape[0] == 2


def test_bad_use():
    with pytest.raises(LowbitError, match="sink_tokens"):
        QuantizedKVLayer(sink_tokens=-1)
    layer = QuantizedKVLayer(IntTokenQuantizer(4))
    layer.update(*_kv(1, 3))
    with pytest.raises(LowbitError, match="negative number"):
        layer.crop(2)
    with pytest.raises(LowbitError, match="does not track positions"):
        layer.positions()
    with pytest.raises(LowbitError, match="empty"):
        LAYOUTS["kivi2"](1).make_cache().bytes_per_token()


@pytest.mark.parametrize(
    "key, value",
    [
        (IntTokenQuantizer(3), IntTokenQuantizer(2)),
        (KVQuantQuantizer(3, 2, 16, outlier_fraction=0.1), KVQuantQuantizer(2, 2, 16)),
        (BFPKVQuantizer(4, 8, 2, 16), BFPKVQuantizer(8, 16, 2, 16)),
    ],
)
def test_crop_of_per_token_formats_equals_never_having_the_tokens(key, value):
    k, v = _kv(2, 30)
    positions = torch.stack([torch.arange(30), torch.tensor([1, 1, 1, *range(27)])])
    layers = [QuantizedKVLayer(key, value, sink_tokens=1) for _ in range(2)]
    for start, stop in ((0, 12), (12, 13), (13, 30)):  # 30 tokens, then the last 9 are dropped
        span = slice(start, stop)
        layers[0].update(k[:, :, span], v[:, :, span], {"positions": positions[:, span]})
    assert layers[0].k.pinned is not None  # row 1's first real token, slot 3
    layers[0].crop(-9)
    layers[1].update(k[:, :, :21], v[:, :, :21], {"positions": positions[:, :21]})
    assert layers[0].get_seq_length() == 21
    new = _kv(2, 4, seed=5)
    got = layers[0].update(*new, {"positions": positions[:, 21:25]})
    want = layers[1].update(*new, {"positions": positions[:, 21:25]})
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert layers[0].nbytes() == layers[1].nbytes()
    layers[0].crop(-23)  # below the pinned slot: the pin goes too
    assert layers[0].k.pinned.shape[0] == 0 and layers[0].get_seq_length() == 2


def test_crop_within_a_token_group_keeps_the_dequantized_tokens():
    layer = QuantizedKVLayer(
        IntChannelQuantizer(3, token_group=4), IntTokenQuantizer(3), sink_tokens=2, fp_window=3
    )
    k, v = _kv(1, 20)
    keys, values = _feed(layer, k, v, [20])  # keys: 2 sinks, 12 packed (3 groups), 6 fp
    layer.crop(-11)  # keep 9 = 2 sinks + 1 whole group + 3 tokens of the next
    assert layer.get_seq_length() == 9
    assert layer.k.chunks[0].num_tokens == 4 and layer.k.residual.shape[2] == 3
    assert layer.v.chunks[0].num_tokens == 7 and layer.v.residual is None  # per token: cut
    kept_k, kept_v = layer.k.full(torch.float32), layer.v.full(torch.float32)
    assert torch.equal(kept_k, keys[:, :, :9]) and torch.equal(kept_v, values[:, :, :9])
    layer.crop(-8)  # into the sinks
    assert layer.get_seq_length() == 1 and layer.k.chunks == [] and layer.k.residual is None
    assert torch.equal(layer.k.full(torch.float32), k[:, :, :1])
    keys, _ = layer.update(*_kv(1, 6, seed=2))  # refills the sink, then quantizes again
    assert keys.shape[2] == 7 and layer.k.sink.shape[2] == 2


def test_layout_bits_per_element_is_the_mean_over_layers():
    # layers may differ: kvquant's shared outliers give each layer its own value outlier count
    two = KVQuantQuantizer(bits=3, num_heads=2, head_dim=16, outlier_fraction=2 / 32)
    none = KVQuantQuantizer(bits=3, num_heads=2, head_dim=16, outlier_fraction=0.0)
    layout = KVCacheLayout([two, None], [two, none])
    keys, values = layout.bits_per_element(16)
    assert keys == pytest.approx((two.bits_per_element(16) + 16) / 2)
    # two outliers of 32 bits per token of 32 elements: 2 bits per element between the layers
    assert two.bits_per_element(16) - none.bits_per_element(16) == pytest.approx(2.0)
    assert values == pytest.approx(none.bits_per_element(16) + 1.0)


def test_position_bounds_follow_the_positions_they_are_of(monkeypatch):
    """A cache's least and greatest position: computed once while the positions stay as they
    are (every layer of a decode step asks), again after an append or a write in place."""
    from lowbit.kv.cache import PositionTrack

    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(1) or aminmax(t))
    track = PositionTrack()
    track.append(torch.tensor([[3, 4, 5]]))
    assert [track.bounds() for _ in range(3)] == [(3, 5)] * 3 and len(calls) == 1
    track.append(torch.tensor([[9]]))
    assert track.bounds() == (3, 9) and len(calls) == 2
    track.positions[0, 1] = -2
    assert track.bounds() == (-2, 9) and len(calls) == 3
