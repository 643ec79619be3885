"""Choosing a launch configuration by timing: the fastest one that launches and computes the
reference's product; errors other than a refused launch propagate."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.kernels.triton_support import fastest_config

triton = pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402


def test_fastest_config_times_only_configs_that_launch_and_compute_the_product(monkeypatch):
    import triton.testing

    times = {"a": 3.0, "b": 1.0, "c": 2.0, "wrong": 0.5}
    expected = torch.ones(4)
    timed = []

    def do_bench(fn, warmup, rep):
        fn()
        return times[timed[-1]]

    def launch(config):
        timed.append(config)
        if config == "big":
            raise OutOfResources(237_568, 232_448, "shared memory")
        return expected * (1.5 if config == "wrong" else 1.0)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    with pytest.warns(UserWarning, match="off the reference"):
        best = fastest_config(launch, ["a", "big", "wrong", "b", "c"], expected, 1e-3)
    assert best == "b"
    assert "big" in timed and timed.count("wrong") == 1  # checked once, never timed
    with pytest.raises(LowbitError, match="no launch configuration"):
        fastest_config(launch, ["big"], expected, 1e-3)  # never the one that cannot launch


def test_fastest_config_lets_other_errors_through():
    def launch(config):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        fastest_config(launch, ["a", "b"])
