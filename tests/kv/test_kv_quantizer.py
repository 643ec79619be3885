"""The KV quantizer interface: packed == simulated bit for bit, measured bytes == analytic bits,
chunks join and split exactly, settings round-trip, bad input raises LowbitError."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.intq import fake_quant_int
from lowbit.kv import (
    IntChannelQuantizer,
    IntTokenQuantizer,
    KIVIKeyQuantizer,
    KIVIValueQuantizer,
    kv_quantizer_from_dict,
)

QUANTIZERS = [
    lambda: IntTokenQuantizer(4),
    lambda: IntTokenQuantizer(3, group_size=8, clip_ratio=0.95),
    lambda: IntTokenQuantizer(2, symmetric=True),
    lambda: IntTokenQuantizer(5, zero="fp16"),
    lambda: IntChannelQuantizer(4, token_group=4),
    lambda: IntChannelQuantizer(3, token_group=8, symmetric=True, clip_ratio=0.9),
    lambda: KIVIKeyQuantizer(2, group=4),
    lambda: KIVIValueQuantizer(4, group=8),
]


def _kv(batch, tokens, head_dim=16, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, tokens, head_dim, generator=g)
    return x * torch.linspace(0.2, 4.0, head_dim)  # channel scales differ, like real keys


@pytest.mark.parametrize("make", QUANTIZERS)
@pytest.mark.parametrize("batch", [1, 3])
def test_packed_equals_simulated_and_bytes_equal_analytic(make, batch):
    q = make()
    x = _kv(batch, 8 * q.token_group if q.token_group > 1 else 13)
    packed = q.quantize(x)
    deq = packed.dequantize()
    assert deq.shape == x.shape and deq.dtype == x.dtype
    assert torch.equal(q.fake_quant(x), deq)
    assert packed.codes.dtype == torch.uint8  # really packed bits
    assert packed.nbytes() * 8 == q.bits_per_element(16) * x.numel()
    rel = ((deq - x).pow(2).sum() / x.pow(2).sum()).item()
    # relative squared error x 4**bits, measured 0.34 (KIVI keys) .. 4.6 (2-bit symmetric)
    assert rel * 4**q.bits < 6.0


@pytest.mark.parametrize(
    "q", [IntTokenQuantizer(4), IntTokenQuantizer(3, group_size=8, clip_ratio=0.95)]
)
def test_int_token_matches_formats_intq(q):
    x = _kv(2, 11)
    expected = fake_quant_int(
        x,
        q.bits,
        symmetric=q.symmetric,
        axis=-1,
        group_size=q.group_size,
        clip_ratio=q.clip_ratio,
        scale_dtype=torch.float16,
    )
    assert torch.equal(q.fake_quant(x), expected)


def test_channel_stats_cover_token_groups():
    q = IntChannelQuantizer(4, token_group=4)
    x = _kv(1, 8)
    packed = q.quantize(x)
    assert packed.scale.shape == (1, 3, 2, 16)  # [B, H, T / token_group, D]
    halves = q.fake_quant(x[:, :, :4]), q.fake_quant(x[:, :, 4:])
    assert torch.equal(torch.cat(halves, 2), packed.dequantize())


@pytest.mark.parametrize("make", QUANTIZERS)
def test_concat_and_select_batch_are_exact(make):
    q = make()
    tg = q.token_group
    x = _kv(3, 6 * tg, seed=1)
    parts = [q.quantize(x[:, :, : 2 * tg]), q.quantize(x[:, :, 2 * tg :])]
    joined = type(parts[0]).concat(parts)
    separate = torch.cat([p.dequantize() for p in parts], 2)
    assert torch.equal(joined.dequantize(), separate)
    assert joined.nbytes() == sum(p.nbytes() for p in parts)
    index = torch.tensor([2, 0])
    assert torch.equal(joined.select_batch(index).dequantize(), separate[index])


@pytest.mark.parametrize("make", QUANTIZERS)
def test_settings_round_trip(make):
    q = make()
    again = kv_quantizer_from_dict(q.to_dict(), q.state_dict())
    assert type(again) is type(q) and again.to_dict() == q.to_dict()
    x = _kv(1, 4 * q.token_group)
    assert torch.equal(again.fake_quant(x), q.fake_quant(x))


def test_fp16_input_keeps_dtype():
    x = _kv(1, 5).half()
    out = IntTokenQuantizer(4).fake_quant(x)
    assert out.dtype == torch.float16
    assert (out.float() - x.float()).abs().max() < 0.5


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: IntTokenQuantizer(1), "from 2 to 8"),
        (lambda: IntTokenQuantizer(9), "from 2 to 8"),
        (lambda: IntChannelQuantizer(4, token_group=0), "positive integer"),
        (lambda: IntTokenQuantizer(4, clip_ratio=1.5), "clip_ratio"),
        (lambda: IntTokenQuantizer(4, zero="bf16"), "zero must be one of"),
        (lambda: kv_quantizer_from_dict({"kind": "nope"}), "unknown KV quantizer"),
    ],
)
def test_bad_settings(make, message):
    with pytest.raises(LowbitError, match=message):
        make()


def test_bad_shapes():
    with pytest.raises(LowbitError, match="does not divide head_dim"):
        IntTokenQuantizer(4, group_size=12).quantize(_kv(1, 3))
    with pytest.raises(LowbitError, match="groups of 4"):
        IntChannelQuantizer(4, token_group=4).quantize(_kv(1, 6))
    with pytest.raises(LowbitError, match=r"\[batch, heads, tokens, head_dim\]"):
        IntTokenQuantizer(4).quantize(torch.randn(3, 16))
