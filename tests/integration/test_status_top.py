"""``carpool status`` and ``carpool top`` drawn against a live fleet on loopback (broker
and worker on threads), into rich's recording console."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from carpool.broker.config import BatchingOverride
from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.testing import ServerThread
from carpool.ops.fleet import HEALTHY, NO_WORKER
from carpool.ops.status import run_status
from carpool.ops.top import run_top
from carpool.worker.config import ModelConfig
from carpool.worker.factory import engine_factory
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config, wait_for_workers


def recording() -> Console:
    return Console(record=True, force_terminal=True, width=200, color_system=None)


@pytest.mark.timeout(60)
def test_top_refreshes_per_model_and_per_worker(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=8)
    fleet.add_worker(
        {"synthetic": engine_factory(ModelConfig.synthetic("synthetic", 1, 0.1, 8))}, name="w0"
    )
    client = fleet.ready()
    for _ in range(5):
        client.infer("synthetic", {"x": np.ones((1, 16), np.float32)})
    console = recording()
    assert run_top(client, interval_s=0.05, count=3, timeout_s=2.0, console=console) == 0
    text = console.export_text()
    assert "synthetic" in text
    assert "w0" in text
    assert "req/s" in text
    assert "problem" not in text


@pytest.mark.timeout(60)
def test_status_of_a_configured_model_without_a_worker_is_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = dataclasses.replace(loopback_config(), models={"ghost": BatchingOverride(max_batch=4)})
    with ServerThread(BrokerServer(config)) as broker, Client(broker.frontend_endpoint) as client:
        worker = engine_factory(ModelConfig.synthetic("synthetic", 1, 0.1, 8))
        with ServerThread(WorkerServer(broker.backend_endpoint, {"synthetic": worker})):
            wait_for_workers(client, 1)
            stats = client.stats()
            assert stats["models"]["ghost"]["workers"] == 0
            console = recording()
            assert run_status(stats, "", json_out=False, console=console) == NO_WORKER
            assert "ghost: no live worker serves it" in console.export_text()
            healthy = {**stats, "models": {"synthetic": stats["models"]["synthetic"]}}
            assert run_status(healthy, "", json_out=False, console=recording()) == HEALTHY
    capsys.readouterr()
