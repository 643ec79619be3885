"""Every recipe on any device, checked on the CPU.

A tensor made without ``device=`` lands on the default device. Under
:func:`device_mixing_check` that default is ``meta`` while the model and data are real CPU
tensors, so such a tensor is the odd one out: every aten op that receives tensors of two
devices raises :class:`DeviceMixingError` naming the op (torch itself lets some meta/CPU mixes
through, a matmul for one, so the check is a dispatch mode). On CUDA those tensors would have
been CPU tensors meeting CUDA ones. Explicit copies (``.to()``, ``copy_``) and 0-dim tensors
may cross devices (though torch's own meta kernels refuse a 0-dim meta tensor beside a CPU one,
which on CUDA would be an allowed CPU scalar); a meta tensor that reaches ``.item()`` fails
too. It cannot see ``.cpu()`` results mixed back with device tensors (here those are CPU
tensors like everything else): the comparisons on a real GPU are in
``tests/gpu/test_recipes_cuda.py``.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lowbit
from lowbit.errors import LowbitError
from lowbit.eval.evaluate import evaluate
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import PRESETS, get_recipe, list_recipes

#: ops whose job is to move data between devices
_CROSSING = {
    torch.ops.aten._to_copy,
    torch.ops.aten.copy_,
    torch.ops.aten._copy_from,
    torch.ops.aten._copy_from_and_resize,
}


class DeviceMixingError(AssertionError):
    """An op received tensors on two devices."""


class _DeviceMixing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in _CROSSING:
            devices = {
                t.device
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.dim() > 0
            }
            if len(devices) > 1:
                names = ", ".join(sorted(str(d) for d in devices))
                raise DeviceMixingError(f"{func} got tensors on {names}")
        return func(*args, **kwargs)


@contextmanager
def device_mixing_check():
    """Within: tensors made without ``device=`` are meta, and an op mixing devices raises."""
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        with _DeviceMixing():
            yield
    finally:
        torch.set_default_device(previous)


#: head_dim 32 and widths 128/256, so every preset's default groups and blocks fit
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    head_dim=32,
    max_position_embeddings=256,
)
RECIPES = sorted(list_recipes()) + sorted(PRESETS)


def calibration(samples: int = 8, seqlen: int = 48) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(3, 256, (samples, seqlen), generator=generator, device="cpu")


def test_the_check_sees_a_tensor_made_on_the_default_device():
    x = torch.randn(4, 4)
    with device_mixing_check(), pytest.raises(DeviceMixingError):
        x @ torch.eye(4)  # made without device=; torch alone returns a CPU tensor here
    with device_mixing_check(), pytest.raises((DeviceMixingError, RuntimeError)):
        x + torch.ones(4)
    with device_mixing_check():
        assert (x + torch.ones(4, device=x.device)).device == x.device
        assert (x.to("meta") + 1).device.type == "meta"  # explicit moves and Python scalars


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_quantizes_and_runs_with_every_tensor_where_the_model_is(name):
    model = tiny_model("llama", **SHAPE)
    ids = calibration()
    recipe = get_recipe(name)
    if hasattr(recipe, "steps"):  # a training loop (learn-rotate): each step runs every op
        recipe = recipe.with_settings(steps=3)
    with device_mixing_check():
        lowbit.quantize(model, recipe, calibration=ids, progress=False)
        logits = model(ids[:2]).logits  # [2, S, V]
        result = evaluate(model, ids[:2, :32], chunk=16, progress=False)  # through the cache
    assert logits.device.type == "cpu" and torch.isfinite(logits).all()
    assert result.tokens == 64


@pytest.mark.parametrize(
    ("family", "name", "settings"),
    [
        ("qwen3", "kvquant", dict(pre_rope=False, channel_codebooks=False)),
        ("qwen2", "kvquant", dict(channel_codebooks=True, share_outliers=False)),
        ("qwen3", "quarot", dict(rotation="random", w_group=32)),
        ("mistral", "gptq", dict(act_order=False, w_group=32, w_symmetric=False)),
        ("qwen2", "ksort-bfp", dict(permute_v=True, v_mantissa_bits=4)),
    ],
)
def test_variants_of_other_families_make_no_stray_tensor(family, name, settings):
    model = tiny_model(family, **SHAPE)
    ids = calibration()
    with device_mixing_check():
        lowbit.quantize(model, get_recipe(name).with_settings(**settings), calibration=ids,
                        progress=False)  # fmt: skip
        assert torch.isfinite(model(ids[:2]).logits).all()


@pytest.mark.parametrize("name", ["gptq", "quarot", "kvquant"])
def test_device_cpu_gives_the_result_of_device_none_bit_for_bit(name):
    ids = calibration()
    logits = []
    for device in (None, "cpu"):
        model = tiny_model("llama", **SHAPE)
        lowbit.quantize(model, name, calibration=ids, progress=False, device=device)
        logits.append(model(ids[:2]).logits)
    assert torch.equal(*logits)


def test_a_device_torch_does_not_know_is_one_sentence():
    with pytest.raises(LowbitError, match="not a torch device name"):
        lowbit.quantize(tiny_model("llama"), "gptq", calibration=calibration(), device="gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_sentence():
    with pytest.raises(LowbitError, match="no CUDA"):
        lowbit.quantize(tiny_model("llama"), "gptq", calibration=calibration(), device="cuda")


def test_evaluate_reads_token_ids_from_anywhere_and_scores_on_the_model():
    """Windows are moved to the model's device; with a model and windows on the CPU that is a
    no-op, so the result equals the plain forward's NLL."""
    model = tiny_model("llama")
    ids = calibration(2, 24)
    result = evaluate(model, ids, progress=False)
    with torch.no_grad():
        logprobs = model(ids).logits[:, :-1].log_softmax(-1)  # [2, S-1, V]
    nll = -logprobs.gather(-1, ids[:, 1:, None]).mean()
    assert result.nll == pytest.approx(float(nll), rel=1e-5)
