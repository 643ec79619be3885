import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.kv.fisher import collect_kv_fisher
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model


def _brute_force_grads(model, ids, layer, kind):
    """dL/d(activation) of one layer's keys or values by substituting a leaf tensor for the
    module output (no retain_grad, no embedding hook): [S, H_kv * D] per sample."""
    view = adapter_for(model).block(layer)
    module = {"k": view.k_norm or view.k_proj, "v": view.v_proj}[kind]
    grads = []
    for row in ids:
        leaf = {}

        def swap(mod, args, output, leaf=leaf):
            leaf["x"] = output.detach().clone().requires_grad_(True)
            return leaf["x"]

        handle = module.register_forward_hook(swap)
        try:
            with torch.enable_grad():
                logits = model(row[None], use_cache=False).logits[0, :-1]
                loss = torch.nn.functional.cross_entropy(logits, row[1:])
                (grad,) = torch.autograd.grad(loss, leaf["x"])
        finally:
            handle.remove()
        grads.append(grad[0].reshape(row.numel(), -1))
    return grads


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fisher_matches_brute_force_autograd(family):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (3, 50), generator=torch.Generator().manual_seed(0))
    calib = collect_kv_fisher(model, adapter_for(model), ids, max_tokens=10_000)
    assert calib.num_tokens == 3 * 50  # every token of each sample
    for kind in ("k", "v"):
        grads = _brute_force_grads(model, ids, layer=0, kind=kind)
        want = torch.cat(grads).square().view(-1, 2, 16)  # positions 0..S-1
        got = calib.key_fisher(0) if kind == "k" else calib.value_fisher(0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-12)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_first_token_is_kept_and_subset_is_bounded():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (4, 80), generator=torch.Generator().manual_seed(1))
    calib = collect_kv_fisher(model, adapter_for(model), ids, max_tokens=200)
    assert calib.num_tokens == 200
    assert calib.samples.bincount().tolist() == [50, 50, 50, 50]
    assert calib.samples[calib.positions == 0].tolist() == [0, 1, 2, 3]  # every sample's sink
    # a cache that keeps the sink in fp16 calibrates without it
    rest = calib.without_leading(1)
    assert rest.num_tokens == 196 and int(rest.positions.min()) >= 1
    keep = calib.positions >= 1
    assert torch.equal(rest.keys[1], calib.keys[1][keep])
    assert torch.equal(rest.value_fisher(0), calib.value_fisher(0)[keep])
    # kept activations are the model's own: the values at a kept position match a plain forward
    n, pos = int(calib.samples[0]), int(calib.positions[0])
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids[n : n + 1])
        normed = model.model.layers[0].input_layernorm(hidden)
        v = model.model.layers[0].self_attn.v_proj(normed)[0, pos].view(2, 16)
    torch.testing.assert_close(calib.values[0][0], v)


def test_post_rope_keys_rotate_activations_and_gradients():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(2))
    calib = collect_kv_fisher(model, adapter, ids)
    keys, fisher = calib.post_rope_keys(adapter, 1)
    i = 5
    pos = calib.positions[i : i + 1].view(1, 1)
    want = adapter.apply_rope(calib.keys[1][i][:, None, :].unsqueeze(0), pos)[0, :, 0]
    torch.testing.assert_close(keys[i], want)
    # a rotation keeps the squared norm of each RoPE pair of the gradient
    pair = fisher[i][:, :8] + fisher[i][:, 8:]
    pair_pre = calib.key_fisher(1)[i][:, :8] + calib.key_fisher(1)[i][:, 8:]
    torch.testing.assert_close(pair, pair_pre, rtol=1e-4, atol=1e-14)


def test_too_little_calibration_is_rejected():
    model = tiny_model("llama")
    with pytest.raises(LowbitError, match="needs at least 128"):
        collect_kv_fisher(model, adapter_for(model), torch.zeros(2, 40, dtype=torch.long))
    with pytest.raises(LowbitError, match="n_samples, seqlen"):
        collect_kv_fisher(model, adapter_for(model), torch.zeros(40, dtype=torch.long))


def test_post_rope_keys_at_chosen_positions():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(3))
    calib = collect_kv_fisher(model, adapter, ids, gradients=False)
    positions = torch.full((calib.num_tokens,), 400)
    keys, fisher = calib.post_rope_keys(adapter, 0, positions)
    assert fisher is None and not calib.has_gradients
    want = adapter.apply_rope(calib.keys[0].transpose(0, 1)[None], positions[None])[0]
    torch.testing.assert_close(keys, want.transpose(0, 1))
    with pytest.raises(LowbitError, match="without gradients"):
        calib.key_fisher(0)
