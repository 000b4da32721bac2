"""A broker that starts (or restarts) before its workers holds the requests for the models
it expects, its configuration's and its last trace's, until a worker registers them: over
real loopback sockets, a client that keeps sending through the gap gets every answer,
and no UNAVAILABLE for a request whose deadline allows."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from carpool.broker.config import BatchingConfig, BatchingOverride, BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.errors import RequestError
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer
from tests.conftest import wait_for_workers

pytestmark = pytest.mark.timeout(60)

#: Requests the client sends before the worker starts, and after.
BEFORE, AFTER = 15, 15


def _config(tmp_path: Path, **kw: object) -> BrokerConfig:
    return BrokerConfig(
        frontend=f"ipc://{tmp_path}/frontend",
        backend=f"ipc://{tmp_path}/backend",
        batching=BatchingConfig(max_batch=8, max_wait_s=0.002),
        register_grace_s=20.0,
        **kw,  # type: ignore[arg-type]
    )


def _worker(broker: BrokerServer) -> WorkerServer:
    return WorkerServer(
        broker.backend_endpoint, {"m": lambda: SyntheticEngine(item_shape=(2,))}, warmup=False
    )


def _outcomes(client: Client, broker: BrokerServer, stack: contextlib.ExitStack) -> Counter[str]:
    """Send BEFORE requests at a steady pace while no worker is connected (the broker
    holds them), start the worker, send AFTER more; return each answer's kind, and check
    each result is its own request's."""
    x = np.ones((1, 2), np.float32)
    clock = MonotonicClock()
    futures = []
    for i in range(BEFORE):
        futures.append(client.submit("m", {"x": x * i}, timeout_s=20))
        client.poll(0.005)  # (the pace of a client that keeps sending)
    until = clock.now() + 10
    while broker.core.stats.requests < BEFORE:  # all of them reached the broker
        assert clock.now() < until, "the requests never reached the broker"
        client.poll(0.01)
    stack.enter_context(ServerThread(_worker(broker)))
    for i in range(BEFORE, BEFORE + AFTER):
        futures.append(client.submit("m", {"x": x * i}, timeout_s=20))
        client.poll(0.005)
    kinds: Counter[str] = Counter()
    for i, future in enumerate(futures):
        try:
            y = future.outputs(20)["y"]
        except RequestError as exc:
            kinds[type(exc).__name__] += 1
        else:
            assert y.tolist() == [[2.0 * i + 1] * 2]
            kinds["ok"] += 1
    return kinds


def test_a_broker_started_before_its_worker_holds_requests_for_a_configured_model(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, models={"m": BatchingOverride()})
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(ServerThread(BrokerServer(config)))
        client = stack.enter_context(Client(broker.frontend_endpoint, grace_s=5.0))
        assert _outcomes(client, broker, stack) == Counter(ok=BEFORE + AFTER)


def test_a_restarted_broker_holds_requests_for_the_models_of_its_last_trace(
    tmp_path: Path,
) -> None:
    trace = str(tmp_path / "arrivals.jsonl")
    config = _config(tmp_path)  # no [models] table: only the trace names "m"
    x = np.ones((1, 2), np.float32)
    with contextlib.ExitStack() as first:
        broker = first.enter_context(ServerThread(BrokerServer(config, record=trace)))
        first.enter_context(ServerThread(_worker(broker)))
        client = first.enter_context(Client(broker.frontend_endpoint))
        wait_for_workers(client, 1)
        assert client.infer("m", {"x": x}, timeout_s=10)
    with contextlib.ExitStack() as second:  # the restart: its workers are not back yet
        broker = second.enter_context(ServerThread(BrokerServer(config, record=trace)))
        client = second.enter_context(Client(broker.frontend_endpoint, grace_s=5.0))
        assert _outcomes(client, broker, second) == Counter(ok=BEFORE + AFTER)
