import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.transforms.permute import (
    RopeOrder,
    apply_ordered_rope,
    ksort_order,
    ksort_qk,
    ksort_v,
    permute_qk_channels,
)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_ksort_preserves_logits(family):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (3, 37), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    orders = ksort_qk(model)
    ksort_v(model)
    assert any(not torch.equal(o, torch.arange(16).expand(2, -1)) for o in orders)
    # measured: max |Δlogit| ≈ 3e-7 to 5e-7 in fp32 on all four families
    assert (_logits(model, ids) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ksort_preserves_cached_decoding(family):
    """Prefill then token-by-token decoding through a DynamicCache gives the same logits."""
    from transformers import DynamicCache

    model = tiny_model(family)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    ref = _logits(model, ids)
    ksort_qk(model)
    cache, pieces = DynamicCache(), []
    with torch.no_grad():
        for start, stop in ((0, 12), *((t, t + 1) for t in range(12, 20))):
            out = model(ids[:, start:stop], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            pieces.append(out.logits)
    assert (torch.cat(pieces, dim=1) - ref).abs().max() < 1e-4  # measured ≈ 5e-7


def test_permuted_weights_need_the_ordered_rope():
    """Control: the same weight permutation with transformers' stock RoPE changes the logits,
    so the invariance above really rests on carrying RoPE through the permutation."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    ref = _logits(model, ids)
    adapter = adapter_for(model)
    for view in adapter.blocks():
        permute_qk_channels(model, view.index, ksort_order(view.k_proj.weight, 2))
    assert (_logits(model, ids) - ref).abs().max() > 1e-2  # stock forward still bound


def test_ordered_rope_matches_permuted_stock_rope():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 5, 16, generator=g)  # [B, H, S, D]
    positions = torch.arange(5).expand(2, -1) + 7
    order = torch.stack([torch.randperm(16, generator=g) for _ in range(3)])  # [H, D]
    cos, sin = adapter.rope_cos_sin(positions)
    permuted = x.gather(-1, order[None, :, None, :].expand_as(x))
    got = apply_ordered_rope(permuted, cos, sin, RopeOrder.from_order(order))
    want = adapter.apply_rope(x, positions).gather(-1, order[None, :, None, :].expand_as(x))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_ksort_order_sorts_by_row_norm():
    weight = torch.tensor([[1.0, 0], [3, 0], [0, 2], [0.5, 0], [9, 9], [0, 0.1]])
    order = ksort_order(weight, num_heads=2)
    assert order.tolist() == [[1, 2, 0], [1, 0, 2]]


def test_bad_order_is_rejected():
    model = tiny_model("llama")
    with pytest.raises(LowbitError, match="permutation"):
        permute_qk_channels(model, 0, torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(LowbitError, match=r"\[2, 16\]"):
        permute_qk_channels(model, 0, torch.arange(16).expand(3, -1))


@pytest.mark.slow
def test_ksort_preserves_embedded_model_logits(embedded):
    import copy

    model = copy.deepcopy(embedded.model).float()
    ids = embedded.tokenizer(
        "The quick brown fox jumps over the lazy dog. " * 6, return_tensors="pt"
    )
    ids = ids["input_ids"][:, :64]
    ref = _logits(model, ids)
    ksort_qk(model)
    ksort_v(model)
    # measured: max |Δlogit| ≈ 6.7e-5 in fp32 (logits up to ~31; 30 layers of reordered sums)
    assert (_logits(model, ids) - ref).abs().max() < 1e-4
