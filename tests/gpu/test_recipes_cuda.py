"""Every recipe and preset on CUDA against the same recipe on the CPU (marked ``gpu``; skipped
without CUDA by the conftest).

The model is a tiny fp32 Llama built on the CPU from one seed (then moved), calibrated on the
same CPU token ids, so the two runs differ only by where they compute. Float results differ in
rounding (reduction order of matmuls, Hessian sums, quantiles), and a quantizer rounding a
value that sits near a level boundary can then pick the neighbouring code, so recipes that
calibrate or quantize activations and KV caches get a looser tolerance than weight-only RTN,
whose codes are elementwise IEEE arithmetic.
"""

from __future__ import annotations

import gc

import pytest
import torch

import lowbit
from lowbit.eval.evaluate import evaluate
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import PRESETS, list_recipes

pytestmark = pytest.mark.gpu

#: head_dim 32 and widths 128/256, so every preset's default groups and blocks fit
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    head_dim=32,
    max_position_embeddings=256,
)
RECIPES = sorted(list_recipes()) + sorted(PRESETS)
#: float weights or RTN weights with float activations and cache: only matmul rounding differs
EXACT = {"fp", "rtn", "w8a16", "w4a16", "w4a16-g128", "w4a16-g64"}
# tolerance: relative L2 error of the logits, ||cuda - cpu|| / ||cpu||: 1e-4 for EXACT, 5e-2
# for the others (a few codes may round the other way), 0.15 for SpQR. What rounding alone
# does, on the CPU: weights times (1 + 1e-6 noise) move the logits of these tiny models by
# 2.6e-2 through GPTQ and by 5.8e-2 through SpQR (its outlier choices and quantized statistics
# flip), which is what the H200 run of 2026-11-26 failed SpQR's three presets on at 5e-2
SPQR = {"spqr", "spqr-w3-0.5pct", "spqr-w3-1pct"}
EXACT_TOLERANCE, TOLERANCE, SPQR_TOLERANCE = 1e-4, 5e-2, 0.15


def _calibration(samples: int = 8, seqlen: int = 48) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(3, 256, (samples, seqlen), generator=generator, device="cpu")


def _quantized(name: str, model_device: str, calibration: torch.Tensor, **options):
    model = tiny_model("llama", seed=0, **SHAPE).to(model_device)
    return lowbit.quantize(model, name, calibration=calibration, progress=False, **options)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.double().cpu(), expected.double().cpu()
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_on_cuda_gives_the_cpu_result(name):
    calibration = _calibration()  # CPU token ids for both: the CUDA run moves them itself
    ids = calibration[:2]
    on_cpu = _quantized(name, "cpu", calibration)
    on_cuda = _quantized(name, "cuda", calibration)
    assert {p.device.type for p in on_cuda.parameters()} == {"cuda"}
    with torch.no_grad():
        expected = on_cpu(ids).logits  # [2, S, V]
        got = on_cuda(ids.cuda()).logits
    tolerance = EXACT_TOLERANCE if name in EXACT else SPQR_TOLERANCE if name in SPQR else TOLERANCE
    error = _relative_error(got, expected)
    assert error <= tolerance, f"{name}: relative logit error {error:.3g} > {tolerance}"
    # evaluation through the quantized cache, windows given on the CPU
    cpu_eval = evaluate(on_cpu, calibration[:2, :32], chunk=16, progress=False)
    cuda_eval = evaluate(on_cuda, calibration[:2, :32], chunk=16, progress=False)
    assert cuda_eval.nll == pytest.approx(cpu_eval.nll, rel=tolerance)


@pytest.mark.parametrize("name", ["gptq", "w4a16-g64-gptq", "quarot", "kvquant"])
def test_a_model_on_the_cpu_calibrates_on_cuda_and_stays_on_the_cpu(name):
    """device="cuda" with the model on the CPU: one block at a time goes to the GPU and back;
    the result is the CPU run's (within the tolerance above) and nothing stays on the GPU."""
    calibration = _calibration()
    gc.collect()
    before = torch.cuda.memory_allocated()
    offloaded = _quantized(name, "cpu", calibration, device="cuda")
    gc.collect()
    assert torch.cuda.memory_allocated() == before  # every tensor made on the GPU was freed
    tensors = [*offloaded.parameters(), *offloaded.buffers()]
    containers = [
        module.quantized_weight
        for module in offloaded.modules()
        if getattr(module, "quantized_weight", None) is not None
    ]
    tensors += [t for c in containers for t in (c.qdata, c.scale, c.zero) if t is not None]
    assert {t.device.type for t in tensors} == {"cpu"}
    on_cpu = _quantized(name, "cpu", calibration)
    ids = calibration[:2]
    with torch.no_grad():
        error = _relative_error(offloaded(ids).logits, on_cpu(ids).logits)
    assert error <= TOLERANCE, f"{name}: relative logit error {error:.3g} > {TOLERANCE}"


def test_kv_fisher_block_by_block_on_cuda_matches_the_whole_model_pass_on_the_cpu():
    from lowbit.kv.fisher import collect_kv_fisher
    from lowbit.models.adapter import adapter_for

    model = tiny_model("llama", seed=0, **SHAPE)
    adapter = adapter_for(model)
    calibration = _calibration()
    whole = collect_kv_fisher(model, adapter, calibration, max_tokens=200)
    blocks = collect_kv_fisher(model, adapter, calibration, max_tokens=200, device="cuda")
    assert blocks.device.type == "cpu" and torch.equal(whole.positions, blocks.positions)
    for a, b in zip(whole.keys + whole.key_grads, blocks.keys + blocks.key_grads, strict=True):
        # tolerance: relative 1e-4 (fp32 forward/backward on another device); not yet measured
        assert _relative_error(b, a) <= 1e-4
