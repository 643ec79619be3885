"""Choosing a launch configuration by timing: the fastest one, failures skipped."""

import pytest

from lowbit.kernels.triton_support import fastest_config

triton = pytest.importorskip("triton")


def test_fastest_config_takes_the_smallest_time_and_skips_failures(monkeypatch):
    import triton.testing

    times = {"a": 3.0, "b": 1.0, "c": 2.0}
    seen = []

    def do_bench(fn, warmup, rep):
        return fn()

    def launch(config):
        seen.append(config)
        if config == "bad":
            raise RuntimeError("out of shared memory")
        return times[config]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    assert fastest_config(launch, ["a", "bad", "b", "c"]) == "b"
    assert seen == ["a", "bad", "b", "c"]
    assert fastest_config(launch, ["bad"]) == "bad"  # nothing ran: the first stands
