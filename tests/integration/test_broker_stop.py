"""A broker that is told to stop (SIGTERM, ``BrokerServer.stop``) answers every request
it holds: running batches' results when they come within ``stop_grace_s``, queued ones
dispatched and answered as usual when they can finish within it (their cost unknown yet,
they are given the chance), and tells its workers DISCONNECT; it never leaves a client
to its own timer (deadline plus grace: 11 s by default)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping

import numpy as np
import pytest

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.errors import Unavailable
from carpool.common.testing import ServerThread
from carpool.worker.engines.base import Array
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer
from tests.conftest import wait_for_workers

pytestmark = pytest.mark.timeout(60)


def test_a_stopping_broker_answers_everything_it_holds(caplog: pytest.LogCaptureFixture) -> None:
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        batching=BatchingConfig(max_batch=1, max_wait_s=0.0, policy="fixed"),
        stop_grace_s=20.0,
    )
    release = threading.Event()
    caplog.set_level(logging.WARNING, logger="carpool.worker.server")

    class Gated(SyntheticEngine):
        """Runs a batch only once the test says so: the batch is surely running."""

        def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
            assert release.wait(30)
            return super().run(inputs)

    broker = BrokerServer(config)
    with contextlib.ExitStack() as stack:
        thread = stack.enter_context(contextlib.closing(_Thread(broker)))
        worker = WorkerServer(
            broker.backend_endpoint, {"m": lambda: Gated(item_shape=(2,))}, slots=1, warmup=False
        )
        stack.enter_context(ServerThread(worker))
        client = stack.enter_context(Client(broker.frontend_endpoint, grace_s=30.0))
        wait_for_workers(client, 1)
        x = np.ones((1, 2), np.float32)
        futures = [client.submit("m", {"x": x * i}, timeout_s=30) for i in range(4)]
        clock = MonotonicClock()
        until = clock.now() + 10
        while broker.core.inflight_batches == 0 or broker.core.queued < 3:
            client.poll(0.01)
            assert clock.now() < until, "the batch never left"
        broker.stop()  # one request running, three queued
        # (stop() asks the loop; a request that reaches it before its next turn is
        # admitted as before the stop)
        until = clock.now() + 10
        while not broker.core.stopping:
            client.poll(0.01)
            assert clock.now() < until, "the broker did not begin to stop"
        with pytest.raises(Unavailable, match="the broker is stopping"):
            # A new one is refused at once. (With a budget too small to be sent again on
            # the next connection, the client fails it with the broker's answer.)
            client.infer("m", {"x": x}, timeout_s=0.04)
        assert not any(f.done() for f in futures)
        release.set()  # all four end within stop_grace_s: each client gets its result
        reference = SyntheticEngine(item_shape=(2,))
        for i, f in enumerate(futures):
            expected = np.asarray(reference.run({"x": x * i})["y"]).tolist()
            assert f.outputs(10)["y"].tolist() == expected
        thread.join()
        # The worker heard DISCONNECT (instead of waiting out three heartbeats).
        until = clock.now() + 10
        while "reconnecting: broker said DISCONNECT: broker stopping" not in caplog.text:
            assert clock.now() < until, "the worker was not told DISCONNECT"
            threading.Event().wait(0.01)


class _Thread:
    """serve() on a thread; close() joins it and closes the broker."""

    def __init__(self, broker: BrokerServer) -> None:
        self.broker = broker
        self._t = threading.Thread(target=broker.serve, daemon=True)
        self._t.start()

    def join(self) -> None:
        self._t.join(10)
        assert not self._t.is_alive(), "the broker did not stop"

    def close(self) -> None:
        self.broker.stop()
        self.join()
        self.broker.close()
