"""bench/gpu_check.py's NVML step on fakes: it opens NVML as the worker does, by the
device CUDA named, and fails where NVML's device is not CUDA's or where the probe finds a
GPU that ``CUDA_VISIBLE_DEVICES`` hides (the step runs for real only on a GPU machine)."""

from __future__ import annotations

import sys

import pytest

from carpool.worker.tensorrt.cache import Device
from carpool.worker.tensorrt.probe import GpuProbe
from tests.bench_scripts import load_script
from tests.unit.worker.fake_gpu import H100, L4, FakeNvml

gc = load_script("gpu_check.py")


def _found(gpu) -> GpuProbe:
    return GpuProbe(
        Device(gpu.name, gpu.cc, None), binding="cuda-bindings 13.0.0", uuid=gpu.nvml_uuid
    )


@pytest.fixture
def nvml(monkeypatch):
    fake = FakeNvml([H100, L4])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(gc, "_has", lambda name: True)
    monkeypatch.setattr(gc, "run_probe", lambda env: GpuProbe(None, "no GPU found"))
    return fake


def test_nvml_is_opened_by_the_device_cuda_named_not_by_index(nvml):
    step, during = gc.nvml(_found(L4), lambda: {"status": "ok"})
    assert step["status"] == "ok", step
    assert step["name"] == L4.name
    assert step["same_device"] is True
    assert step["nvml_index_0_uuid"] == H100.nvml_uuid
    assert step["idle"]["gpu_util_pct"] == L4.util_pct
    assert step["no_visible_device"] == {"found_gpu": False, "reason": "no GPU found"}
    assert during == {"status": "ok"}
    assert ("nvmlDeviceGetHandleByUUID", L4.nvml_uuid) in nvml.calls
    assert nvml.calls[-1] == ("nvmlShutdown", None)


def test_a_gpu_found_with_none_visible_fails_the_step(nvml, monkeypatch):
    monkeypatch.setattr(gc, "run_probe", lambda env: _found(H100))
    step, _ = gc.nvml(_found(H100))
    assert step["status"] == "failed"
    assert step["no_visible_device"]["found_gpu"] is True


def test_a_device_nvml_does_not_know_fails_the_step(nvml):
    stranger = GpuProbe(Device("X", (9, 0), None), uuid="GPU-00000000-0000-0000-0000-000000000000")
    step, _ = gc.nvml(stranger)
    assert step["status"] == "failed"
    assert "did not open" in step["reason"]


def test_an_nvml_error_fails_the_step_and_the_pipeline_still_runs_once(nvml, monkeypatch):
    def broken(gpu):
        raise nvml.NVMLError("GPU is lost")

    monkeypatch.setattr(nvml, "nvmlDeviceGetUUID", broken)
    runs = []

    def pipeline():
        runs.append(1)
        return {"status": "ok"}

    step, during = gc.nvml(_found(L4), pipeline)
    assert step["status"] == "failed"
    assert "GPU is lost" in step["reason"]
    assert runs == [1]
    assert during == {"status": "ok"}
    assert nvml.calls[-1] == ("nvmlShutdown", None)


def _gil_runs(before_ticks=0.01, after_ticks=0.9, after_cpu=0.02, binding="cuda-bindings 12.9.0"):
    def run(name):
        return {
            "status": "ok",
            "binding": name,
            "before": {"ticks_ratio": before_ticks, "cpu_ratio": 0.98},
            "after": {"ticks_ratio": after_ticks, "cpu_ratio": after_cpu},
        }

    return {
        "calibration": {
            "status": "ok",
            "holds_gil_and_spins (sum)": {"ticks_ratio": 0.02, "cpu_ratio": 0.97},
            "releases_gil_and_blocks (sleep)": {"ticks_ratio": 1.3, "cpu_ratio": 0.0},
        },
        "machine_binding": run("cuda-bindings 13.0.0"),
        "cuda-bindings 12.9.0": run(binding),
    }


def test_the_gil_step_judges_its_figures():
    assert all(gc.verdicts(_gil_runs()).values())
    assert len(gc.verdicts(_gil_runs())) == 7
    failing = {
        "12.9.0 ran": _gil_runs(binding="cuda-bindings 13.0.0"),
        "12.9.0 event wait held the GIL": _gil_runs(before_ticks=0.9),
        "machine_binding: Cuda.wait let Python run": _gil_runs(after_ticks=0.05),
        "machine_binding: Cuda.wait did not spin": _gil_runs(after_cpu=0.95),
    }
    for name, runs in failing.items():
        verdict = gc.verdicts(runs)
        assert verdict[name] is False, name
