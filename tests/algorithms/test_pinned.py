"""The quantized weights of small fixed-seed problems, pinned.

GPTQ, SpQR and the mixed 2/4/16 format share GPTQ's prologue (dead inputs, act-order, the
dampened Cholesky factor of ``H⁻¹``: :func:`lowbit.algorithms.gptq.prepare_hessian`); a
refactor of any of them that changes a result fails here. The integer results (codes, zero
points, 4-bit masks, permutations) are pinned bit for bit by a SHA-256 of their bytes (as
``lowbit.calibrate.resume.tensor_sha256`` hashes them), with the chosen dampening and the dead
columns. The float results (updated weights, scales, sensitivities, second-stage statistics) are
pinned by their sum and absolute sum to 1e-6 relative, and SpQR's outlier threshold to 1e-3:
MKL and ATen choose their kernels by CPU, so the last bits of float results differ between
machines (an AMD AVX2 and an Intel AVX-512 machine gave different float bytes; the integer
digests stayed the same under ``ATEN_CPU_CAPABILITY=avx2`` and ``MKL_CBWR=COMPATIBLE``, and the
threshold moved by 6e-4 relative). Running this file prints ``PINNED = {...}`` to recompute
them from a commit whose results are trusted.
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


def _summary(tensors):
    """``(SHA-256 of the integer tensors, {float tensor: (sum, absolute sum)})``."""
    ints = [(n, t) for n, t in tensors if not t.is_floating_point()]
    sums = {n: (t.double().sum().item(), t.double().abs().sum().item())
            for n, t in tensors if t.is_floating_point()}  # fmt: skip
    return tensor_sha256(ints), sums


ALGORITHMS = {"gptq": _gptq, "spqr": _spqr, "mixed": _mixed}

PINNED = {
    "gptq/int4-g32-act-order": (
        "95bf7d5ca4757b2369bb356bee1321f87b98dfec0be40c36cdee356f278eb397",
        {
            "weight": (2.138286590576172, 49.43826675415039),
            "scale": (1.0226364135742188, 1.0226364135742188),
        },
        0.01,
        None,
        2,
    ),
    "gptq/int3-g32-asym-dynamic": (
        "12894faece87b2dc44424f6db843aa8664f521ff783a8e2a98ca1cedb8c11866",
        {
            "weight": (2.2707138061523438, 46.90483856201172),
            "scale": (1.5978546142578125, 1.5978546142578125),
            "zero": (240.0, 240.0),
        },
        0.01,
        None,
        2,
    ),
    "gptq/int4-channel-mse-half": (
        "02cc1f0ec0ce9c1444f73f557633e7291c6387941a97945b19134c2f15a5c8c7",
        {
            "weight": (1.6866912841796875, 48.95838928222656),
            "scale": (0.43289947509765625, 0.43289947509765625),
        },
        0.01,
        None,
        2,
    ),
    "gptq/int4-indefinite": (
        "d5aef590675851fec7f5f3e27c69709eaca22ce4a21938394757b24242b55766",
        {
            "weight": (2.4447555541992188, 48.47187042236328),
            "scale": (0.5131988525390625, 0.5131988525390625),
        },
        0.1,
        None,
        0,
    ),
    "spqr/act-order": (
        "949fe93b5e1e11c9ad9f5228f468b56575e0e22e4851e6070144c841642fdde8",
        {
            "weight": (1.6518863439559937, 71.34154999256134),
            "second": (-61.00738716125488, 74.23870658874512),
        },
        0.01,
        0.0028279659756891085,
        1,
    ),
    "spqr/natural-simplified-tau": (
        "f89462e3b16b3686237b48525163adddbcb9ebae224c8ea26ac84c7f5a9b3296",
        {
            "weight": (1.4770224690437317, 69.8112695813179),
            "second": (-57.27056694030762, 71.02728462219238),
        },
        0.01,
        0.0046493420377373695,
        1,
    ),
    "spqr/undamped": (
        "071389adaf18e5d2d525f084a990d1e79a14829c36feb7546340ff95585698fb",
        {
            "weight": (1.470211684703827, 70.47198814153671),
            "second": (-1174.1025922894478, 1366.992088496685),
        },
        0.0,
        0.0002766751497663946,
        1,
    ),
    "spqr/indefinite": (
        "c6d320cc44b729840a1ca016c366fc201b971626acc36b8c3dffd8803cb1b0d3",
        {
            "weight": (1.1975523829460144, 71.04454547166824),
            "second": (-62.54366207122803, 75.91141605377197),
        },
        0.1,
        0.003133874763917386,
        0,
    ),
    "mixed/static-act-order": (
        "2db1006647a9d1bf29234ed6c2cfd5e6be85fdcf891804a4b3eb604cda456949",
        {
            "weight": (0.09648680686950684, 68.34364771842957),
            "sensitivity": (87.92297099158168, 87.92297099158168),
        },
        0.01,
        None,
        None,
    ),
    "mixed/dynamic-act-order": (
        "2db1006647a9d1bf29234ed6c2cfd5e6be85fdcf891804a4b3eb604cda456949",
        {
            "weight": (0.18213868141174316, 69.45775961875916),
            "sensitivity": (87.92297099158168, 87.92297099158168),
        },
        0.01,
        None,
        None,
    ),
    "mixed/natural-order": (
        "2db1006647a9d1bf29234ed6c2cfd5e6be85fdcf891804a4b3eb604cda456949",
        {
            "weight": (1.2204530239105225, 64.5673439502716),
            "sensitivity": (87.92297099158168, 87.92297099158168),
        },
        0.01,
        None,
        None,
    ),
    "mixed/indefinite": (
        "2db1006647a9d1bf29234ed6c2cfd5e6be85fdcf891804a4b3eb604cda456949",
        {
            "weight": (-0.00022459030151367188, 67.99510145187378),
            "sensitivity": (117.79526214301586, 117.79526214301586),
        },
        0.1,
        None,
        None,
    ),
}


def _run(name: str):
    """``(integer digest, float sums, dampening, SpQR's tau or None, dead columns)``."""
    algorithm, case = name.split("/")
    tensors, damp, dead = ALGORITHMS[algorithm](case)
    damp, tau = damp if isinstance(damp, tuple) else (damp, None)
    return (*_summary(tensors), damp, tau, dead)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_results_are_the_pinned_ones(name):
    ints, sums, damp, tau, dead = _run(name)
    pinned_ints, pinned_sums, pinned_damp, pinned_tau, pinned_dead = PINNED[name]
    assert (ints, damp, dead) == (pinned_ints, pinned_damp, pinned_dead)
    assert (tau is None) == (pinned_tau is None)
    if tau is not None:
        assert tau == pytest.approx(pinned_tau, rel=1e-3)
    assert sums.keys() == pinned_sums.keys()
    for key, (total, absolute) in sums.items():
        pinned_total, pinned_absolute = pinned_sums[key]
        assert absolute == pytest.approx(pinned_absolute, rel=1e-6), key
        assert abs(total - pinned_total) <= 1e-6 * pinned_absolute, key


if __name__ == "__main__":
    cases = {
        "gptq": ["int4-g32-act-order", "int3-g32-asym-dynamic", "int4-channel-mse-half",
                 "int4-indefinite"],
        "spqr": ["act-order", "natural-simplified-tau", "undamped", "indefinite"],
        "mixed": ["static-act-order", "dynamic-act-order", "natural-order", "indefinite"],
    }  # fmt: skip
    print("PINNED = {")
    for algorithm, names in cases.items():
        for case in names:
            print(f"    {algorithm + '/' + case!r}: {_run(algorithm + '/' + case)!r},")
    print("}")
