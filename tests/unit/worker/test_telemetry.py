"""Worker telemetry (worker/telemetry, worker/load.py, protocol §8.2): the NVML and
Jetson parsers on recorded answers, the sampler behind its reader seams, the wire form,
the core's sampling cadence, and ρ from an engine's own busy seconds."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
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
from carpool.worker.load import ReportedBusy, engines_busy_s
from carpool.worker.telemetry import TelemetrySampler, jetson, nvml

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


def test_without_nvml_the_real_reader_answers_none() -> None:
    """nvidia-ml-py is installed here but no NVML library or GPU is: no reader."""
    assert nvml.PynvmlReader.open() is None


def test_telemetry_round_trips_in_heartbeat_and_result() -> None:
    t = Telemetry(12.5, 2048, 8192, "nvml", 87.0, 32768, 81920)
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
