"""worker/tensorrt/probe.py and probe_child.py: the GPU probe's answer, its child against
fake CUDA installs (both cuda-python layouts, pycuda, a driver too old, no visible
device), the answer asked once per process, and the probe run here (no GPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from carpool.worker.engines.trt_load import TensorRT, Unavailable, find_plan
from carpool.worker.tensorrt import probe_child
from carpool.worker.tensorrt.build import BuildRequest
from carpool.worker.tensorrt.cache import Device
from carpool.worker.tensorrt.precision import OnnxPrecision
from carpool.worker.tensorrt.probe import GpuProbe, ProbeCache, parse, run_probe
from carpool.worker.tensorrt.profiles import InputRange, Profile
from tests.unit.worker.fake_gpu import H100, L4, Cuda, install, runtime_module
from tests.unit.worker.tensorrt.test_build import RecordingBuilder

SRC = Path(__file__).resolve().parents[4] / "src"
H200 = Device("NVIDIA H200", (9, 0))
CUDA_12_9 = {"binding": "cuda-bindings 12.9.1", "runtime": "12.9", "driver": "12.6"}


def test_a_cuda_answer_is_a_device_with_its_identity_and_versions() -> None:
    out = {"name": "NVIDIA H200", "cc": [9, 0], "pci_bus_id": "0000:17:00.0", "uuid": "GPU-1"}
    found = parse(0, json.dumps({**out, **CUDA_12_9}) + "\n")
    assert found == GpuProbe(H200, "", **CUDA_12_9, pci_bus_id="0000:17:00.0", uuid="GPU-1")
    assert found.ok
    assert found.via == "cuda-bindings"


def test_a_jetson_answer_carries_its_l4t_release() -> None:
    out = json.dumps({"name": "Orin", "cc": [8, 7], "binding": "pycuda 2025.1"})
    assert parse(0, out, "R36.4.3").device == Device("Orin", (8, 7), "R36.4.3")


@pytest.mark.parametrize(
    ("rc", "out", "words"),
    [
        (0, json.dumps({"error": "cuda-python is not installed"}), "no GPU found (cuda-python"),
        (-11, "", "exited with status -11 and no answer"),  # the child crashed
        (0, "garbage", "exited with status 0 and no answer"),
        (0, json.dumps({"name": "x"}), "answered"),
    ],
)
def test_a_missing_or_crashed_gpu_is_a_reason(rc, out, words) -> None:
    found = parse(rc, out)
    assert found.device is None
    assert not found.ok
    assert words in found.reason


def test_the_versions_are_kept_when_no_device_answers() -> None:
    found = parse(0, json.dumps({**CUDA_12_9, "error": "no visible CUDA device"}))
    assert (found.device, found.binding, found.runtime, found.driver) == (None, *CUDA_12_9.values())


# The child, in this process: the runtime API's answers, read as the probe reads them.


def _ask(cuda: Cuda, monkeypatch, visible: str | None = None) -> tuple[dict, dict]:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    told: dict = {}
    return told, probe_child.ask_runtime(runtime_module(cuda), "cuda-bindings 12.9.1", told)


def test_the_runtime_names_the_first_visible_device(monkeypatch) -> None:
    told, device = _ask(Cuda(), monkeypatch, visible="1")
    assert device == {
        "count": 1,
        "name": L4.name,
        "cc": list(L4.cc),
        "pci_bus_id": L4.pci,
        "uuid": L4.nvml_uuid,  # as NVML writes it
    }
    assert told == {"runtime": "12.9", "driver": "12.6"}
    assert _ask(Cuda(), monkeypatch)[1]["name"] == H100.name  # none hidden: device 0


@pytest.mark.parametrize(
    ("cuda", "visible", "says"),
    [
        (Cuda(), "", "no visible CUDA device (CUDA_VISIBLE_DEVICES='')"),
        (Cuda(driver=0), None, "no CUDA driver (cudaDriverGetVersion: 0)"),
        # cuda-python up to 12.6.0 raises from its driver calls where there is no driver.
        (Cuda(raises="Failed to dlopen libcuda.so.1"), None, "no CUDA driver (Failed to dlopen"),
        (Cuda(runtime=13000), None, "runtime 13.0, which needs a newer driver than this one"),
    ],
    ids=["none visible", "no driver", "cuda-python 12.6.0 without a driver", "driver too old"],
)
def test_the_runtime_says_why_no_device_answers(cuda, visible, says, monkeypatch) -> None:
    with pytest.raises(probe_child.NoDevice) as caught:
        _ask(cuda, monkeypatch, visible)
    assert says in str(caught.value)


def test_the_fake_runtime_gives_no_count_with_an_error(monkeypatch) -> None:
    """As cuda-bindings 12.9.0 and 13.0.0 answer: ``(cudaErrorInsufficientDriver, None)``."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runtime_module(Cuda(runtime=13000)).cudaGetDeviceCount() == (35, None)
    assert runtime_module(Cuda()).cudaGetDeviceCount() == (100, None)  # cudaErrorNoDevice


def test_the_uuid_and_versions_are_written_as_nvml_and_cuda_write_them() -> None:
    raw = bytes.fromhex("2b2e8e6d0d3c3a8f9e1b7c6d5e4f3a2b")
    assert probe_child.uuid_text(raw) == "GPU-2b2e8e6d-0d3c-3a8f-9e1b-7c6d5e4f3a2b"
    assert probe_child.uuid_text(bytes(16)) == ""
    assert [probe_child.version_text(v) for v in (12090, 12060, 13000, 0)] == [
        "12.9",
        "12.6",
        "13.0",
        "",
    ]


# The child as a process, with fake packages first on its path.


def test_the_child_asks_cuda_bindings_for_the_visible_device(tmp_path: Path) -> None:
    found = run_probe(env=install(tmp_path, visible="1"))
    assert found.device == Device(L4.name, L4.cc)
    assert (found.pci_bus_id, found.uuid) == (L4.pci, L4.nvml_uuid)
    assert (found.binding, found.runtime, found.driver) == tuple(CUDA_12_9.values())


def test_the_child_asks_the_layout_before_cuda_bindings(tmp_path: Path) -> None:
    """cuda-python up to 12.6.0 has ``cuda.cudart``, no ``cuda.bindings``."""
    found = run_probe(env=install(tmp_path, Cuda(version="12.6.0"), layout="cudart"))
    assert found.device == Device(H100.name, H100.cc)
    assert found.binding == "cuda-python 12.6.0"


def test_a_runtime_newer_than_the_driver_names_the_extras_to_install(tmp_path: Path) -> None:
    """cuda-bindings 13 on JetPack 6's CUDA 12.6 driver: cudaErrorInsufficientDriver."""
    found = run_probe(env=install(tmp_path, Cuda(runtime=13000, version="13.0.0")))
    assert found.device is None
    assert (found.binding, found.runtime, found.driver) == ("cuda-bindings 13.0.0", "13.0", "12.6")
    assert "needs a newer driver than this one (CUDA 12.6" in found.reason
    assert "carpool[jetpack6]" in found.reason
    assert "carpool[cu12]" in found.reason


def test_pycuda_answers_where_cuda_python_is_missing(tmp_path: Path) -> None:
    found = run_probe(env=install(tmp_path, layout=None, pycuda=True, visible="1"))
    assert found.device == Device(L4.name, L4.cc)
    assert (found.binding, found.runtime, found.driver) == ("pycuda 2025.1", "12.9", "12.6")
    assert (found.pci_bus_id, found.uuid) == (L4.pci, "")  # NVML is opened by the slot


def _machine_bindings(root: Path) -> Path:
    """This machine's own cuda-python (a regular ``cuda`` package, as cuda-python 12.6.x
    installs) and pycuda, each failing as it imports its device API."""
    files = {
        "cuda/__init__.py": "",
        "cuda_python-12.6.2.post1.dist-info/METADATA": "Name: cuda-python\nVersion: 12.6.2.post1\n",
        "cuda/bindings/__init__.py": "__version__ = '12.6.2.post1'\n",
        "cuda/bindings/runtime.py": "raise ImportError('the machine cuda-python')\n",
        "cuda/cudart.py": "raise ImportError('the machine cuda-python')\n",
        "pycuda/__init__.py": "VERSION_TEXT = '2024.1'\n",
        "pycuda/driver.py": "raise ImportError('the machine pycuda')\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("layout", "pycuda", "answer"),
    [
        ("bindings", False, "cuda-bindings 12.9.1"),
        (None, True, "pycuda 2025.1"),
        (None, False, "cuda-python is not installed; pycuda is not installed"),
    ],
)
def test_the_fakes_hide_the_machines_own_bindings(tmp_path, layout, pycuda, answer) -> None:
    """Bindings installed later on the path (site-packages) are never the child's."""
    env = install(tmp_path / "fakes", layout=layout, pycuda=pycuda, visible="1")
    env["PYTHONPATH"] += os.pathsep + str(_machine_bindings(tmp_path / "machine"))
    found = run_probe(env=env)
    if found.ok:
        assert (found.device, found.binding) == (Device(L4.name, L4.cc), answer)
    else:
        assert (found.reason, found.binding) == (f"no GPU found ({answer})", "")


def test_no_visible_device_and_no_builder_created(tmp_path: Path) -> None:
    """NVML still sees both GPUs; CUDA, with CUDA_VISIBLE_DEVICES="", none."""
    env = install(tmp_path / "fakes", visible="", pynvml=True)
    folder = tmp_path / "repo" / "m"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"an onnx file")
    profiles = (Profile((InputRange("x", (1, 3, 32, 32), (4, 3, 32, 32), (8, 3, 32, 32)),)),)
    request = BuildRequest(
        "m", folder / "model.onnx", folder, folder.parent, profiles, OnnxPrecision(False, False)
    )
    builders: list[RecordingBuilder] = []

    def new_builder() -> RecordingBuilder:
        builders.append(RecordingBuilder())
        return builders[-1]

    trt = TensorRT(
        installed=lambda: True,
        probe=lambda: run_probe(env=env),
        version=lambda: "10.3.0",
        new_builder=new_builder,
    )
    with pytest.raises(Unavailable, match="no visible CUDA device") as caught:
        find_plan(lambda: request, True, trt, "model 'm'")
    assert builders == []
    assert "cuda-bindings 12.9.1" in str(caught.value)


# Asked once per process.


def test_the_answer_is_asked_once_and_logged_once(caplog) -> None:
    runs: list[int] = []
    found = GpuProbe(H200, **CUDA_12_9, pci_bus_id="0000:17:00.0")

    def run() -> GpuProbe:
        runs.append(1)
        return found

    cache = ProbeCache(run)
    answers: list[GpuProbe] = []
    with caplog.at_level(logging.INFO, logger="carpool.worker.tensorrt.probe"):
        threads = [threading.Thread(target=lambda: answers.append(cache.get())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert answers == [found] * 8
    assert runs == [1]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "GPU: NVIDIA H200 (sm_90, PCI 0000:17:00.0) through cuda-bindings 12.9.1: "
            "CUDA runtime 12.9, driver 12.6",
        )
    ]


def test_a_binding_without_a_device_is_a_warning_and_no_binding_a_debug_line(caplog) -> None:
    reason = "no GPU found (cuda-bindings 13.0.0 has CUDA runtime 13.0, which needs ...)"
    found = GpuProbe(None, reason, "cuda-bindings 13.0.0", "13.0", "12.6")
    with caplog.at_level(logging.DEBUG, logger="carpool.worker.tensorrt.probe"):
        ProbeCache(lambda: found).get()
        ProbeCache(lambda: GpuProbe(None, "no GPU found (cuda-python is not installed)")).get()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"{reason}; CUDA runtime 13.0, driver 12.6"),
        (logging.DEBUG, "no GPU found (cuda-python is not installed)"),
    ]


def test_the_probe_runs_in_a_child_and_answers_either_way() -> None:
    found = run_probe(timeout_s=60)
    assert (found.device is None) == bool(found.reason)


# What the probe's module imports.

LOADED = """
import sys
import {module}
print(" ".join(sorted(m for m in sys.modules if m.startswith("carpool.worker."))))
"""


@pytest.mark.parametrize("module", ["carpool.worker.tensorrt.probe", "carpool.worker.telemetry"])
def test_the_probe_imports_none_of_the_worker_it_serves(module: str) -> None:
    """The probe's module, and the telemetry that imports it, load in a fresh interpreter
    without the worker's config, server or repository (which import the telemetry)."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", LOADED.format(module=module)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    loaded = set(done.stdout.split())
    assert "carpool.worker.tensorrt.probe" in loaded
    worker = {"carpool.worker.config", "carpool.worker.server", "carpool.worker.repository"}
    assert not loaded & worker, sorted(loaded)
