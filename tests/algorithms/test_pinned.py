"""The quantized weights of small fixed-seed problems, pinned bit for bit.

GPTQ, SpQR and the mixed 2/4/16 format share GPTQ's prologue (dead inputs, act-order, the
dampened Cholesky factor of ``H⁻¹``: :func:`lowbit.algorithms.gptq.prepare_hessian`). The
digests below were computed with the code before that prologue was written once; a refactor
that changes any bit of any result fails here. They are SHA-256s of the tensors' bytes (as
``lowbit.calibrate.resume.tensor_sha256`` hashes them), on CPU in float32/float64: a torch or
LAPACK build that rounds differently changes them, in which case recompute them from a commit
whose results are trusted (``PINNED_DIGESTS = {...}`` printed by running this file).
"""

import pytest
import torch

from lowbit.algorithms.gptq import gptq_quantize
from lowbit.algorithms.int_spec import IntWeightSpec
from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize
from lowbit.algorithms.spqr import SpQRSpec, spqr_quantize
from lowbit.calibrate.resume import tensor_sha256


def _problem(out_f: int, in_f: int, seed: int, dead: tuple[int, ...] = ()):
    """A heavy-tailed weight [out, in] and the Hessian [in, in] of correlated inputs of uneven
    energy, some of which (``dead``) never fire."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(out_f, in_f, generator=g)
    chi2 = torch.randn(3, out_f, in_f, generator=g).square().sum(0)
    weight = 0.02 * normal / (chi2 / 3).sqrt()  # [out, in] Student-t
    mix = torch.eye(in_f) + 0.5 * torch.randn(in_f, in_f, generator=g) / in_f**0.5
    x = torch.randn(4 * in_f, in_f, generator=g) @ mix * torch.linspace(0.2, 3.0, in_f)
    x[:, list(dead)] = 0.0
    return weight, 2 * x.T @ x / x.shape[0]  # [in, in]


def _indefinite(hessian: torch.Tensor) -> torch.Tensor:
    """``hessian`` minus 5% of its mean diagonal: dampening 0.01 fails, 0.1 succeeds."""
    return hessian - 0.05 * hessian.diagonal().mean() * torch.eye(hessian.shape[0])


def _gptq(case: str):
    weight, h = _problem(24, 96, seed=0, dead=(5, 70))
    if case == "int4-g32-act-order":
        r = gptq_quantize(weight, h, IntWeightSpec(4, 32), act_order=True, block_size=32)
    elif case == "int3-g32-asym-dynamic":
        r = gptq_quantize(weight, h, IntWeightSpec(3, 32, False), act_order=False, block_size=32)
    elif case == "int4-channel-mse-half":
        spec = IntWeightSpec(4, None, True, mse_clip=True, scale_rule="absmax_half")
        r = gptq_quantize(weight, h, spec, act_order=True)
    else:  # "int4-indefinite"
        r = gptq_quantize(weight, _indefinite(h), IntWeightSpec(4), act_order=True)
    q = r.quantized
    tensors = [("weight", r.weight), ("qdata", q.qdata), ("scale", q.scale)]
    return tensors + ([] if q.zero is None else [("zero", q.zero)]), r.damp, r.dead_columns


def _spqr(case: str):
    weight, h = _problem(32, 96, seed=1, dead=(3,))
    if case == "act-order":
        r = spqr_quantize(weight, h, SpQRSpec(), block_size=32)
    elif case == "natural-simplified-tau":
        spec = SpQRSpec(simplified=True, tau=0.5, outlier_fraction=0.02)
        r = spqr_quantize(weight, h, spec, act_order=False)
    elif case == "undamped":
        r = spqr_quantize(weight, h, SpQRSpec(bits=4, beta1=8, beta2=4), damp=0.0)
    else:  # "indefinite"
        r = spqr_quantize(weight, _indefinite(h), SpQRSpec())
    q = r.quantized
    tensors = [("weight", r.weight), ("codes", q.codes), ("second", q.second)]
    tensors += [] if q.perm is None else [("perm", q.perm)]
    return tensors, (r.damp, r.tau), r.dead_columns


def _mixed(case: str):
    weight, h = _problem(32, 104, seed=2, dead=(9, 40))  # 7 groups, the last of 8 columns
    spec = MixedWeightSpec(frac_4bit=0.3, outlier_fraction=0.01)
    if case == "static-act-order":
        r = mixed_quantize(weight, h, spec, block_size=32)
    elif case == "dynamic-act-order":
        r = mixed_quantize(weight, h, spec, block_size=32, dynamic=True)
    elif case == "natural-order":
        r = mixed_quantize(weight, h, spec, act_order=False)
    else:  # "indefinite"
        r = mixed_quantize(weight, _indefinite(h), spec)
    tensors = [("weight", r.weight), ("sensitivity", r.sensitivity), ("is4", r.is4)]
    return tensors, r.damp, None


ALGORITHMS = {"gptq": _gptq, "spqr": _spqr, "mixed": _mixed}

PINNED_DIGESTS = {
    "gptq/int4-g32-act-order": (
        "b2a73a83f4403114bb2f10edb602281b474a30f7c7ec7e889efde3e346bc2489",
        0.01,
        2,
    ),
    "gptq/int3-g32-asym-dynamic": (
        "d4321e6674167e1e254d46ee3cfaad399dffd0374bfd04e40cf7ff283f5166fa",
        0.01,
        2,
    ),
    "gptq/int4-channel-mse-half": (
        "0c3f23b6b0522339e7fcd2a37b91e9794aeabab81d59093f8003b8629db3eae3",
        0.01,
        2,
    ),
    "gptq/int4-indefinite": (
        "5e6be8fcee626f0d03fb01658ed278b537008fc97e5c67cd8951f03ca42b216a",
        0.1,
        0,
    ),
    "spqr/act-order": (
        "35667c498e40cc070a30cbf4ad0403ae763c6e90d57596db45309091f5f4c53b",
        (0.01, 0.002827965772238367),
        1,
    ),
    "spqr/natural-simplified-tau": (
        "76d1d57118ad91a96231e715641a2cdc812edd1581017280e040691f6a9e01a6",
        (0.01, 0.004649341572076082),
        1,
    ),
    "spqr/undamped": (
        "2564667653a4ef3e3e9305e7982ec730d143d1ce99ebdbffe3f0bafa3203a354",
        (0.0, 0.00027667516536905237),
        1,
    ),
    "spqr/indefinite": (
        "3202ed7ec673f7cefef10f5e21705e52c0a9f2cca71452ba6513235971c8606a",
        (0.1, 0.003133875132377588),
        0,
    ),
    "mixed/static-act-order": (
        "4f756ed7cd3364e355a37fcd453974fddee57fd3466b6494cfdc68ad19c64c72",
        0.01,
        None,
    ),
    "mixed/dynamic-act-order": (
        "a6fe231f6390ddc861805a2e5c86b6418a3b5526e0582d3c1e78b4803f52f12f",
        0.01,
        None,
    ),
    "mixed/natural-order": (
        "3ab7ed8f0c51bd7b44a1946042ce49b56fa00332ec0fa5d423941b021813f552",
        0.01,
        None,
    ),
    "mixed/indefinite": (
        "02580a06461d3e878eafb2df491a826bbf6bb3646de6f83a581d11be8bc4350e",
        0.1,
        None,
    ),
}


def _run(name: str):
    algorithm, case = name.split("/")
    tensors, damp, dead = ALGORITHMS[algorithm](case)
    return tensor_sha256(tensors), damp, dead


@pytest.mark.parametrize("name", sorted(PINNED_DIGESTS))
def test_results_are_bit_for_bit_the_pinned_ones(name):
    assert _run(name) == PINNED_DIGESTS[name]


if __name__ == "__main__":
    cases = {
        "gptq": ["int4-g32-act-order", "int3-g32-asym-dynamic", "int4-channel-mse-half",
                 "int4-indefinite"],
        "spqr": ["act-order", "natural-simplified-tau", "undamped", "indefinite"],
        "mixed": ["static-act-order", "dynamic-act-order", "natural-order", "indefinite"],
    }  # fmt: skip
    print("PINNED_DIGESTS = {")
    for algorithm, names in cases.items():
        for case in names:
            print(f"    {algorithm + '/' + case!r}: {_run(algorithm + '/' + case)!r},")
    print("}")
