"""Worker telemetry over real sockets (protocol §8.2, §6.4): a worker's HEARTBEAT carries
its host's CPU and memory, and its GPU's where a reader answers (NVML here through the
reader seam, with recorded answers); Client.stats() shows them per worker."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.telemetry import TelemetrySampler
from tests.conftest import Fleet
from tests.unit.worker.test_telemetry import NVML, FakeNvml

pytestmark = pytest.mark.timeout(60)


def _telemetry(client: Client, worker: str) -> dict[str, Any]:
    """The worker's telemetry in STATS, once it has reported some (within 10 s)."""
    clock = MonotonicClock()
    until = clock.now() + 10.0
    while True:
        entries = {w["name"]: w for w in client.stats()["workers"]}
        telemetry: dict[str, Any] = entries.get(worker, {}).get("telemetry", {})
        if telemetry:
            return telemetry
        assert clock.now() < until, f"no telemetry from {worker}: {entries}"
        client.poll(0.02)


def test_stats_show_each_workers_host_and_device(fleet_factory: Any) -> None:
    fleet: Fleet = fleet_factory(max_batch=4, max_wait_s=0.0)
    reader = FakeNvml(NVML["a100-80gb"])
    fleet.add_worker({"m": SyntheticEngine}, name="cpu-1", heartbeat_s=0.05, warmup=False)
    fleet.add_worker(
        {"m": SyntheticEngine},
        name="gpu-1",
        heartbeat_s=0.05,
        warmup=False,
        telemetry=TelemetrySampler(reader),
    )
    client = fleet.ready()
    host = _telemetry(client, "cpu-1")
    assert 0 <= host["host_cpu_pct"] <= 100
    assert 0 < host["host_mem_used_mib"] <= host["host_mem_total_mib"]
    assert "device" not in host  # no NVML library and no Jetson here: host fields only
    gpu = _telemetry(client, "gpu-1")
    assert gpu["device"] == "nvml"
    assert (gpu["gpu_util_pct"], gpu["gpu_mem_used_mib"], gpu["gpu_mem_total_mib"]) == (
        87.0,
        32768,
        81920,
    )
    assert gpu["host_mem_total_mib"] == host["host_mem_total_mib"]
    # Sampled at heartbeat cadence, not per batch: 40 batches cost few more readings.
    before = reader.calls
    for i in range(40):
        client.infer("m", {"x": np.full((1, 16), i, np.float32)}, timeout_s=30)
    assert reader.calls - before < 40
