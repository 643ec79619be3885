import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.formats.accounting import bfp_bits
from lowbit.formats.bfp import fake_quant_bfp
from lowbit.kv.bfp_quant import BFPKVQuantizer, BFPPackedKV, BFPQueryQuantizer
from lowbit.kv.quantizer import kv_quantizer_from_dict
from lowbit.recipes.registry import get_recipe


def _orders(heads, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(d, generator=g) for _ in range(heads)])


def _gather(x, order):
    return x.gather(-1, order[None, :, None, :].expand_as(x))


@pytest.mark.parametrize("bits,block", [(4, 16), (4, 32), (8, 64), (3, 8)])
@pytest.mark.parametrize("sorted_", [False, True])
def test_packed_equals_fake_quant_in_the_stored_order(bits, block, sorted_):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 13, 64, generator=g) * torch.logspace(-2, 2, 64)
    q = BFPKVQuantizer(bits, block, num_heads=2, head_dim=64, sorted=sorted_)
    order = torch.arange(64).expand(2, -1)
    if sorted_:
        order = _orders(2, 64)
        q.channel_order.copy_(order)
    out = q.quantize(x).dequantize()
    assert torch.equal(_gather(out, order), fake_quant_bfp(_gather(x, order), bits, block, -1))
    assert torch.equal(q.fake_quant(x), out)


def test_chunks_batches_and_bytes():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 10, 64, generator=g)
    q = BFPKVQuantizer(4, 16, num_heads=2, head_dim=64, sorted=True)
    q.channel_order.copy_(_orders(2, 64, seed=3))
    whole = q.quantize(x)
    joined = BFPPackedKV.concat([q.quantize(x[:, :, :4]), q.quantize(x[:, :, 4:])])
    assert torch.equal(joined.dequantize(), whole.dequantize())
    assert torch.equal(whole.select_batch(torch.tensor([1])).dequantize(), whole.dequantize()[1:2])
    assert q.bits_per_element(64) == bfp_bits(4, 16) == 4.5
    assert whole.nbytes() * 8 == q.bits_per_element(64) * x.numel()  # order is not per token


def test_blocks_never_straddle_heads():
    x = torch.ones(1, 2, 3, 16)
    x[:, 0] *= 1000.0  # head 0 is huge; head 1 must keep its own exponents
    out = BFPKVQuantizer(4, 16, num_heads=2, head_dim=16).quantize(x).dequantize()
    assert torch.equal(out[:, 1], x[:, 1])


def test_query_quantizer_uses_its_groups_order():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 5, 16, generator=g)  # 6 query heads, 2 KV heads
    order = _orders(2, 16, seed=5)
    got = BFPQueryQuantizer(8, 8, 16, order)(q)
    q_order = order.repeat_interleave(3, dim=0)
    assert torch.equal(_gather(got, q_order), fake_quant_bfp(_gather(q, q_order), 8, 8, -1))
    # BFP16: relative error of a query ≈ 2**-7 at most per block max
    assert (got - q).abs().max() <= q.abs().max() * 2**-6


def test_state_round_trip():
    q = BFPKVQuantizer(4, 32, num_heads=2, head_dim=64, sorted=True)
    q.channel_order.copy_(_orders(2, 64))
    rebuilt = kv_quantizer_from_dict(q.to_dict(), q.state_dict())
    x = torch.randn(1, 2, 3, 64)
    assert torch.equal(rebuilt.quantize(x).dequantize(), q.quantize(x).dequantize())


def test_bad_blocks_and_bits_raise_one_sentence():
    with pytest.raises(LowbitError, match="must divide head_dim 64"):
        BFPKVQuantizer(4, 24, num_heads=2, head_dim=64)
    with pytest.raises(LowbitError, match="from 2 to 8"):
        BFPKVQuantizer(9, 16, num_heads=2, head_dim=64)
    with pytest.raises(LowbitError, match="16 for off"):
        get_recipe("ksort-bfp", k_mantissa_bits="12")
    from lowbit.models.adapter import adapter_for
    from lowbit.models.tiny import tiny_model

    adapter = adapter_for(tiny_model("llama"))  # head_dim 16
    with pytest.raises(LowbitError, match="must divide head_dim 16"):
        get_recipe("ksort-bfp", block="32").kv_bytes_per_token(adapter, 128)
