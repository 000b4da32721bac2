"""Worker telemetry (worker/telemetry, worker/engines/base.py, protocol §8.2): the NVML and
Jetson parsers on recorded answers, the sampler behind its reader seams, the sources it
picks (NVML opened by the device CUDA names, a trial sample, the Jetson fallback), the
wire form, the core's sampling cadence, and ρ from an engine's own busy seconds."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from carpool.common.protocol import (
    ModelSpec,
    ResultMeta,
    Telemetry,
    TensorMeta,
    WorkerHeartbeat,
    WorkerResult,
    decode_from_worker,
)
from carpool.worker.core import JobOutcome, WorkerCore
from carpool.worker.engines.base import ReportedBusy, engines_busy_s
from carpool.worker.telemetry import TelemetrySampler, cuda_binding_installed, jetson, nvml
from carpool.worker.tensorrt.cache import Device
from carpool.worker.tensorrt.probe import GpuProbe, run_probe
from tests.unit.worker.fake_gpu import H100, L4, Gpu, install
from tests.unit.worker.fake_gpu import FakeNvml as NvmlModule

DATA = Path(__file__).parents[2] / "data" / "telemetry"
NVML = {k: v for k, v in json.loads((DATA / "nvml.json").read_text()).items() if k[0] != "_"}
JETSON = {
    k: v for k, v in json.loads((DATA / "jetson_sysfs.json").read_text()).items() if k[0] != "_"
}


class FakeNvml:
    """NVML's answers as pynvml returns them (objects with fields), from recorded data."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls = 0

    def memory(self) -> Any:
        self.calls += 1
        return SimpleNamespace(**self.answers["memory"])

    def utilization(self) -> Any:
        return SimpleNamespace(**self.answers["utilization"])


@pytest.mark.parametrize("board", sorted(NVML))
def test_nvml_answers_parse_into_device_fields(board: str) -> None:
    answers = NVML[board]
    memory, util = (SimpleNamespace(**answers[k]) for k in ("memory", "utilization"))
    assert nvml.parse(memory, util) == answers["expect"]


@pytest.mark.parametrize("board", sorted(JETSON))
def test_each_jetsons_load_file_is_found_and_parsed(board: str, tmp_path: Path) -> None:
    entry = JETSON[board]
    path = tmp_path / entry["path"]
    path.parent.mkdir(parents=True)
    path.write_text(entry["text"])
    assert jetson.find_load(tmp_path) == path
    assert jetson.read_load(path) == entry["percent"]


def test_no_load_file_or_an_unreadable_one_is_no_reading(tmp_path: Path) -> None:
    assert jetson.find_load(tmp_path) is None
    assert jetson.parse_load("busy\n") is None
    assert jetson.read_load(tmp_path / "gone") is None
    assert jetson.parse_load("1500") == 100.0  # clamped


def test_the_sampler_reports_the_host_always_and_the_device_where_it_reads() -> None:
    host = TelemetrySampler()()
    assert host.host_mem_total_mib is not None
    assert host.host_mem_used_mib is not None
    assert host.host_mem_total_mib > 0
    assert host.host_mem_used_mib <= host.host_mem_total_mib
    assert host.host_cpu_pct is not None
    assert 0.0 <= host.host_cpu_pct <= 100.0
    assert (host.device, host.gpu_util_pct, host.gpu_mem_total_mib) == (None, None, None)
    sample = TelemetrySampler(FakeNvml(NVML["a100-80gb"]))()
    assert (sample.device, sample.gpu_util_pct, sample.gpu_mem_used_mib) == ("nvml", 87.0, 32768)


def test_on_a_jetson_the_gpu_memory_is_the_unified_host_memory(tmp_path: Path) -> None:
    load = tmp_path / "load"
    load.write_text("537\n")
    sample = TelemetrySampler(jetson_load=load)()
    assert (sample.device, sample.gpu_util_pct) == ("jetson", 53.7)
    assert sample.gpu_mem_total_mib == sample.host_mem_total_mib


def test_a_device_that_stops_answering_leaves_the_host_fields() -> None:
    class Broken(FakeNvml):
        def memory(self) -> Any:
            raise RuntimeError("NVML: GPU is lost")

    sample = TelemetrySampler(Broken(NVML["h200-idle"]))()
    assert sample.device is None
    assert sample.host_mem_total_mib


def test_without_nvml_the_real_module_sees_no_device() -> None:
    """nvidia-ml-py is installed here but no NVML library or GPU is."""
    module = nvml.import_pynvml()
    assert module is not None
    assert nvml.device_count(module) == 0


def _detect(
    fake: NvmlModule | None,
    found: GpuProbe | None,
    sys_root: Path,
    environ: dict[str, str] | None = None,
) -> TelemetrySampler:
    return TelemetrySampler.detect(
        import_nvml=lambda: fake,
        find_gpu=lambda: found if found is not None else pytest.fail("the probe was asked"),
        sys_root=sys_root,
        binding_installed=lambda: False,
        environ=environ or {},
    )


def _found(gpu: Gpu, *, uuid: bool = True) -> GpuProbe:
    return GpuProbe(
        Device(gpu.name, gpu.cc),
        binding="cuda-bindings 12.9.1" if uuid else "pycuda 2025.1",
        runtime="12.9",
        driver="12.6",
        pci_bus_id=gpu.pci,
        uuid=gpu.nvml_uuid if uuid else "",
    )


def test_nvml_reports_the_gpu_cuda_visible_devices_names(tmp_path: Path) -> None:
    """Two GPUs and CUDA_VISIBLE_DEVICES=1: NVML's device 0 is not the worker's."""
    fake = NvmlModule([H100, L4])
    env = install(tmp_path / "fakes", visible="1")
    sampler = TelemetrySampler.detect(
        import_nvml=lambda: fake,
        find_gpu=lambda: run_probe(env=env),
        sys_root=tmp_path,
        binding_installed=lambda: False,
    )
    sample = sampler()
    assert (sample.device, sample.gpu_util_pct) == ("nvml", float(L4.util_pct))
    assert (sample.gpu_mem_used_mib, sample.gpu_mem_total_mib) == (L4.used_mib, L4.total_mib)
    assert (sample.cuda_binding, sample.cuda_runtime, sample.cuda_driver) == (
        "cuda-bindings 12.9.1",
        "12.9",
        "12.6",
    )
    assert ("nvmlDeviceGetHandleByUUID", L4.nvml_uuid) in fake.calls
    assert not [call for call in fake.calls if call[0] == "nvmlDeviceGetHandleByIndex"]


def test_without_a_uuid_nvml_is_opened_by_the_pci_bus_id(tmp_path: Path) -> None:
    """pycuda names no UUID."""
    fake = NvmlModule([H100, L4])
    sample = _detect(fake, _found(L4, uuid=False), tmp_path)()
    assert (sample.gpu_util_pct, sample.cuda_binding) == (float(L4.util_pct), "pycuda 2025.1")
    assert ("nvmlDeviceGetHandleByPciBusId", L4.pci) in fake.calls


def test_no_cuda_device_is_no_device_telemetry_but_the_versions(tmp_path: Path) -> None:
    """NVML sees two GPUs, CUDA none (a runtime newer than the driver): neither GPU is the
    worker's, and what CUDA said is reported."""
    why = "no GPU found (cuda-bindings 13.0.0 has CUDA runtime 13.0, which needs ...)"
    found = GpuProbe(None, why, "cuda-bindings 13.0.0", "13.0", "12.6")
    sampler = _detect(NvmlModule([H100, L4]), found, tmp_path)
    assert (sampler.nvml_reader, sampler.jetson_load) == (None, None)
    sample = sampler()
    assert sample.device is None
    assert (sample.cuda_binding, sample.cuda_runtime, sample.cuda_driver) == (
        "cuda-bindings 13.0.0",
        "13.0",
        "12.6",
    )


NO_BINDING = GpuProbe(None, "no GPU found (cuda-python is not installed; pycuda is not installed)")
TOO_NEW = GpuProbe(None, "no GPU found (... needs a newer driver ...)", "cuda-bindings 13.0.0")


@pytest.mark.parametrize(
    ("gpus", "environ", "found", "reported"),
    [
        ([L4], {}, NO_BINDING, True),
        ([H100, L4], {}, NO_BINDING, False),  # which one is the worker's?
        ([L4], {"CUDA_VISIBLE_DEVICES": "0"}, NO_BINDING, False),
        ([L4], {"CUDA_VISIBLE_DEVICES": ""}, NO_BINDING, False),  # (none visible)
        ([L4], {}, TOO_NEW, False),  # CUDA answered: no device for this worker
    ],
    ids=["one gpu", "two gpus", "visible devices named", "none visible", "a binding"],
)
def test_without_a_cuda_binding_nvmls_only_gpu_is_the_workers(
    tmp_path: Path, gpus: list[Gpu], environ: dict[str, str], found: GpuProbe, reported: bool
) -> None:
    """A worker with no CUDA binding (onnxruntime-gpu alone) has NVML's device 0 reported
    where nothing else can be its GPU; NVML's numbering is not CUDA's anywhere else."""
    fake = NvmlModule(gpus)
    sample = _detect(fake, found, tmp_path, environ)()
    opened = [call for call in fake.calls if call[0].startswith("nvmlDeviceGetHandle")]
    if reported:
        assert opened == [("nvmlDeviceGetHandleByIndex", 0)]
        assert (sample.device, sample.gpu_util_pct) == ("nvml", float(L4.util_pct))
        assert (sample.gpu_mem_used_mib, sample.gpu_mem_total_mib) == (L4.used_mib, L4.total_mib)
    else:
        assert (opened, sample.device) == ([], None)


def test_nvmls_only_gpu_is_reported_once_it_samples(tmp_path: Path) -> None:
    """The trial sample, as for the device CUDA names (under MIG NVML gives no utilization)."""
    fake = NvmlModule([H100], utilization=False)
    assert _detect(fake, NO_BINDING, tmp_path).nvml_reader is None
    assert ("nvmlDeviceGetHandleByIndex", 0) in fake.calls


def test_nvml_that_cannot_sample_falls_back_to_the_jetson_load(tmp_path: Path) -> None:
    """Under MIG, or on Jetson Thor, NVML answers but not with the utilization."""
    fake = NvmlModule([H100], utilization=False)
    assert _detect(fake, _found(H100), tmp_path).nvml_reader is None  # the host alone
    load = tmp_path / "class/devfreq/17000000.gpu/device/load"
    load.parent.mkdir(parents=True)
    load.write_text("537\n")
    sampler = _detect(fake, _found(H100), tmp_path)
    assert (sampler.nvml_reader, sampler.jetson_load) == (None, load)
    assert (sampler().device, sampler().gpu_util_pct) == ("jetson", 53.7)


@pytest.mark.parametrize("where", ["nvml", "jetson", "binding", "nothing"])
def test_the_probe_runs_only_where_there_may_be_a_gpu(tmp_path: Path, where: str) -> None:
    asked: list[int] = []

    def find_gpu() -> GpuProbe:
        asked.append(1)
        return GpuProbe(None, "no GPU found (cuda-python is not installed)")

    if where == "jetson":
        (tmp_path / "devices/gpu.0").mkdir(parents=True)
        (tmp_path / "devices/gpu.0/load").write_text("0\n")
    TelemetrySampler.detect(
        import_nvml=lambda: NvmlModule([H100] if where == "nvml" else []),
        find_gpu=find_gpu,
        sys_root=tmp_path,
        binding_installed=lambda: where == "binding",
    )
    assert asked == ([] if where == "nothing" else [1])


@pytest.fixture
def bare_path(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """``sys.path`` is ``tmp_path`` alone and no ``cuda`` or ``pycuda`` module is imported,
    both as they were afterwards."""

    def bindings() -> list[str]:
        return [name for name in sys.modules if name.split(".")[0] in ("cuda", "pycuda")]

    for name in bindings():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    importlib.invalidate_caches()
    yield tmp_path
    for name in bindings():
        del sys.modules[name]


@pytest.mark.parametrize(
    ("files", "installed"),
    [
        ({}, False),
        ({"cuda/pathfinder/__init__.py": ""}, False),  # cuda-pathfinder: a namespace
        ({"cuda/__init__.py": "raise ImportError('broken')"}, False),
        ({"cuda/bindings/__init__.py": "", "cuda/bindings/runtime.py": ""}, True),
        ({"cuda/__init__.py": "", "cuda/cudart.py": ""}, True),  # cuda-python before 12.6.1
        ({"pycuda/__init__.py": ""}, True),
    ],
    ids=["none", "cuda-pathfinder", "a cuda that fails", "cuda-bindings", "cudart", "pycuda"],
)
def test_a_binding_is_its_module_not_any_cuda_package(bare_path, files, installed) -> None:
    for name, text in files.items():
        (bare_path / name).parent.mkdir(parents=True, exist_ok=True)
        (bare_path / name).write_text(text)
    assert cuda_binding_installed() is installed


def test_a_cuda_module_without_a_spec_is_no_binding(bare_path, monkeypatch) -> None:
    """(``importlib.util.find_spec("cuda")`` raises ValueError for it.)"""
    monkeypatch.setitem(sys.modules, "cuda", ModuleType("cuda"))
    assert cuda_binding_installed() is False


def test_telemetry_round_trips_in_heartbeat_and_result() -> None:
    t = Telemetry(12.5, 2048, 8192, "nvml", 87.0, 32768, 81920, "cuda-bindings 12.9.1", "12.9")
    beat = decode_from_worker(WorkerHeartbeat(0.5, 0, t).to_frames())
    assert beat == WorkerHeartbeat(0.5, 0, t)
    meta = ResultMeta(7, 0.25, 3.0, (3,), None, t)
    assert ResultMeta.from_wire(meta.to_wire()) == meta
    assert "telemetry" not in ResultMeta(7, 0.25, 3.0, (3,)).to_wire()
    # Fields of the wrong type or range are dropped, not the message.
    raw = {"host_cpu_pct": 140, "host_mem_used_mib": -1, "device": "tpu", "gpu_util_pct": 3}
    assert Telemetry.from_wire(raw) == Telemetry(gpu_util_pct=3.0)
    assert Telemetry.from_wire("hot") is None
    assert Telemetry.from_wire({"host_cpu_pct": True}) is None
    raw = {"cuda_binding": "x" * 65, "cuda_runtime": "12.9\n", "cuda_driver": 12.6}
    assert Telemetry.from_wire({**raw, "gpu_util_pct": 3}) == Telemetry(gpu_util_pct=3.0)
    assert Telemetry.from_wire({"cuda_driver": "12.6"}) == Telemetry(cuda_driver="12.6")


SPEC = ModelSpec(
    "m", (TensorMeta("x", "float32", (-1, 4)),), (TensorMeta("y", "float32", (-1, 4)),), 8
)


def test_the_core_samples_at_heartbeat_cadence_onto_heartbeat_or_result() -> None:
    samples: list[Telemetry] = []

    def take() -> Telemetry:
        samples.append(Telemetry(host_cpu_pct=float(len(samples))))
        return samples[-1]

    core = WorkerCore("w", [SPEC], heartbeat_s=1.0, telemetry=take)
    core.on_connect(0.0)
    (beat,), _ = core.on_tick(1.0)
    assert beat.telemetry == Telemetry(host_cpu_pct=0.0)
    core.on_batch_queued(1.2)
    done = JobOutcome(core.epoch, 1, "m", 1.2, 1.3, (1,), [b""], 1)
    result = core.on_job_done(1.3, done)
    assert isinstance(result, WorkerResult)
    assert result.result.telemetry is None  # sampled 0.3 s ago: not again yet
    core.on_batch_queued(2.1)
    result = core.on_job_done(2.2, JobOutcome(core.epoch, 2, "m", 2.1, 2.2, (1,), [b""], 1))
    assert isinstance(result, WorkerResult)
    assert result.result.telemetry == Telemetry(host_cpu_pct=1.0)  # due: rides on RESULT
    (beat,), _ = core.on_tick(2.2)  # the heartbeat is due, the next sample is not
    assert beat.telemetry is None
    assert len(samples) == 2


def test_rho_uses_the_engines_own_busy_seconds_where_they_report_them() -> None:
    class EventTimed:
        """A fake engine whose device time is half its batches' wall-clock time."""

        busy = 0.0

        def busy_s(self) -> float:
            return self.busy

    engine = EventTimed()
    busy_s = engines_busy_s({"m": engine})
    assert busy_s is not None
    assert engines_busy_s({"m": engine, "other": object()}) is None  # not every engine
    core = WorkerCore("w", [SPEC], rho_window_s=1.0, busy_s=busy_s)
    core.on_connect(0.0)
    assert core.rho(0.0) == 0.0
    for i in range(1, 11):  # batches fill the wall clock; the device works half of it
        now = i * 0.1
        core.on_batch_queued(now - 0.1)
        engine.busy += 0.05
        core.on_job_done(now, JobOutcome(core.epoch, i, "m", now - 0.1, now, (1,), [b""], 1))
    assert core.rho(1.0) == pytest.approx(0.5)
    assert core.meter.rho(1.0) == pytest.approx(1.0)  # what wall-clock time would say
    # Idle for a window: the counter stops growing and ρ falls to 0.
    assert core.rho(2.5) == pytest.approx(0.0)


def test_reported_busy_keeps_few_marks() -> None:
    counter = [0.0]
    meter = ReportedBusy(lambda: counter[0], window_s=1.0)
    for i in range(10_000):
        counter[0] += 0.0002
        meter.rho(i * 0.001)
    assert len(meter._marks) <= 12
    assert meter.rho(10.0) == pytest.approx(0.2, rel=0.05)
