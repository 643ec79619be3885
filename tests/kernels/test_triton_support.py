"""Choosing a launch configuration by timing: the fastest one that launches and computes the
reference's product; errors other than a refused launch propagate."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.kernels import triton_support
from lowbit.kernels.triton_support import fastest_config, tuned_config

triton = pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402


def test_fastest_config_times_only_configs_that_launch_and_compute_the_product(monkeypatch):
    times = {"a": 3.0, "b": 1.0, "c": 2.0, "wrong": 0.5}
    expected = torch.ones(4)
    timed = []

    def time_call(fn):
        fn()
        return times[timed[-1]]

    def launch(config):
        timed.append(config)
        if config == "big":
            raise OutOfResources(237_568, 232_448, "shared memory")
        return expected * (1.5 if config == "wrong" else 1.0)

    monkeypatch.setattr(triton_support, "time_call", time_call)
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


def test_tuned_config_names_every_refusal_and_times_only_among_several(monkeypatch):
    refusals = {"s1": "it spills 16 bytes per thread to local memory", "s2": "shared memory"}
    config_of = {"s1": refusals["s1"], "s2": refusals["s2"], "s3": (3,), "s4": (4,)}.get
    references = []

    def expected():
        references.append(1)
        return torch.ones(2)

    with pytest.raises(LowbitError) as err:
        tuned_config(["s1", "s2"], config_of, torch.ones, expected, 0.0)
    assert "s1: it spills 16 bytes" in str(err.value) and "s2: shared memory" in str(err.value)
    # one shape: taken as it is, no reference computed, nothing timed
    assert tuned_config(["s3"], config_of, None, expected, 0.0) == (3,) and not references
    times = {(3,): 2.0, (4,): 1.0}
    launched = []
    monkeypatch.setattr(triton_support, "time_call", lambda fn: times[launched[-1]])

    def launch(config):
        launched.append(config)
        return torch.ones(2)

    assert tuned_config(["s1", "s3", "s4"], config_of, launch, expected, 0.0) == (4,)
    assert references == [1] and (3,) in launched


def test_fastest_config_inside_a_graph_capture_launches_nothing_and_takes_the_default(
    monkeypatch,
):
    launched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fastest_config(launched.append, ["default", "b"]) == "default"
    assert launched == []  # nothing added to the graph being captured


def test_tuned_config_inside_a_graph_capture_computes_no_reference(monkeypatch):
    references = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    config_of = {"s1": (1,), "s2": (2,)}.get
    assert tuned_config(["s1", "s2"], config_of, None, references.append, 0.0) == (1,)
    assert references == []


def test_a_configuration_chosen_inside_a_graph_capture_is_not_kept(monkeypatch):
    """Inside a capture a wrapper takes its default untimed; the first call outside it tunes
    and its choice is kept."""
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cache, chosen = {}, iter(["default", "tuned", "again"])
    assert triton_support.cached_config(cache, "k", lambda: next(chosen)) == "default"
    assert cache == {}
    capturing[0] = False
    assert triton_support.cached_config(cache, "k", lambda: next(chosen)) == "tuned"
    assert triton_support.cached_config(cache, "k", lambda: next(chosen)) == "tuned"
    assert cache == {"k": "tuned"}


def test_compile_ahead_runs_every_item_in_threads_and_drops_their_errors(monkeypatch):
    import threading

    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.setattr(triton_support.os, "cpu_count", lambda: 4)
    seen = []

    def compile_one(item):
        seen.append((item, threading.get_ident()))
        if item == "bad":
            raise RuntimeError("ptxas failed")  # the ordered pass meets it again

    triton_support.compile_ahead(compile_one, ["a", "bad", "b"])
    assert sorted(item for item, _ in seen) == ["a", "b", "bad"]
    assert threading.get_ident() not in {thread for _, thread in seen}


def test_tuned_config_compiles_the_candidates_ahead_then_times_them(monkeypatch):
    ahead = []
    monkeypatch.setattr(triton_support, "compile_ahead",
                        lambda fn, items: ahead.append(list(items)))  # fmt: skip
    monkeypatch.setattr(triton_support, "time_call", lambda fn: (fn(), 1.0)[1])
    config_of = {"s1": (1,), "s2": "it spills", "s3": (3,)}.get
    best = tuned_config(["s1", "s2", "s3"], config_of, lambda c: torch.ones(1),
                        lambda: torch.ones(1), 0.0, compile_only=print)  # fmt: skip
    assert best == (1,)  # equal times: the first
    assert ahead == [["s2", "s3"], [(1,), (3,)]]  # the shapes past the first, then configs
