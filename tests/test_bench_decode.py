"""The cost accounting of ``benchmarks/bench_decode.py`` (Table 3 of Li et al., 2024), without
a GPU: the NVML energy meter against a fake NVML, the cost per million tokens by hand, the table."""

import sys
import time
import types

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_decode")


def _fake_nvml(energy_mj=None, watts=300.0):
    """A pynvml whose energy counter adds ``energy_mj`` per read (None: no counter)."""
    state = {"mj": 0.0}

    class NVMLError(Exception):
        pass

    def energy(handle):
        if energy_mj is None:
            raise NVMLError("not supported")
        state["mj"] += energy_mj
        return state["mj"]

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetTotalEnergyConsumption=energy,
        nvmlDeviceGetPowerUsage=lambda handle: watts * 1e3,  # mW
    )


def test_energy_meter_reads_the_counter_or_the_power(bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(energy_mj=5000.0))
    with bench.EnergyMeter() as meter:
        time.sleep(0.05)
    assert meter.joules == pytest.approx(5.0)  # two reads of the counter, 5000 mJ apart
    assert 0 < meter.watts <= 5.0 / 0.05  # over at least the 0.05 s slept
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(energy_mj=None, watts=300.0))
    with bench.EnergyMeter() as meter:
        while not meter.samples:  # the sampling thread reads every 10 ms
            time.sleep(0.01)
    assert meter.watts == pytest.approx(300.0)  # no counter: the mean power sample
    assert meter.joules > 0


def test_energy_meter_without_nvml(bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with bench.EnergyMeter() as meter:
        pass
    assert not meter.available and meter.joules is None and meter.watts is None


def test_cost_per_million_tokens_and_the_table(bench):
    got = {"tokens_per_s": 50.0, "peak_mb": 100.0, "watts": 400.0, "joules_per_token": 8.0}
    # 1e6 tokens: 2e4 s at $0.685/h = $3.806, plus 8e6 J = 2.222 kWh at $0.09 = $0.200
    assert bench.usd_per_million(got, 0.685, 0.09) == pytest.approx(3.8056 + 0.2000, abs=1e-3)
    assert bench.usd_per_million({"tokens_per_s": 50.0}, 0.685, 0.09) is None
    results = [
        {"row": "fp16", "compile": False, "batches": {"1": dict(got, tokens_per_s=25.0)}},
        {"row": "2/4/16 mixed", "compile": False, "batches": {"1": got}},
    ]
    text = bench.table(results, [1], cost=(0.685, 0.09))
    assert "| $/Mtok B=1 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| 2/4/16 mixed"))
    # tok/s, x fp16, model MB (not measured here), peak MB, W, J/token, $/Mtok
    assert row.split(" | ")[2:] == ["50.0", "2.00", "—", "100", "400", "8.00", "4.006 |"]
