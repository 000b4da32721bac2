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
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from carpool.broker.config import BatchingConfig, BatchingOverride, BrokerConfig
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

    def join(self, timeout_s: float = 10.0) -> None:
        self._t.join(timeout_s)
        assert not self._t.is_alive(), "the broker did not stop"

    def close(self) -> None:
        self.broker.stop()
        self.join()
        self.broker.close()


def _raw(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _raw_watched(
    context: zmq.Context[zmq.Socket[bytes]],
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A DEALER, not connected yet, and a monitor of its connects and handshakes."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    events = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
    return sock, sock.get_monitor_socket(events)


def _connected_not_shaken(monitor: zmq.Socket[bytes]) -> bool:
    """The DEALER's connection is up (CONNECTED within 5 s) and no handshake succeeded."""
    seen: set[int] = set()
    while zmq.EVENT_CONNECTED not in seen and monitor.poll(5_000):
        seen.add(recv_monitor_message(monitor)["event"])
    while monitor.poll(100):
        seen.add(recv_monitor_message(monitor)["event"])
    return zmq.EVENT_CONNECTED in seen and zmq.EVENT_HANDSHAKE_SUCCEEDED not in seen


def _request(rid: int) -> list[bytes]:
    meta = {
        "id": rid,
        "model": "m",
        "timeout_ms": 20_000,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 2]}],
    }
    return [b"CP\x01\x01", msgpack.packb(meta), np.ones((1, 2), np.float32).tobytes()]


def test_a_stopping_broker_answers_every_message_and_admits_no_new_connection(
    tmp_path: Path, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """While a broker stops, a client that keeps sending on its open connection has every
    request answered UNAVAILABLE with ``retry`` and ``retry_after_ms``, after the grace too
    (the frontend stays open until its connections are quiet, stop_drain_s at most); a
    DEALER that connects meanwhile is held at the handshake (the door answers "300") and
    gets nothing from it, and the broker started next on the same endpoint answers it."""
    config = BrokerConfig(
        frontend=f"ipc://{tmp_path}/fe",
        backend=f"ipc://{tmp_path}/be",
        batching=BatchingConfig(max_batch=4, max_wait_s=0.001),
        models={"m": BatchingOverride()},  # held at the next broker until its worker is back
        register_grace_s=10.0,
        stop_grace_s=0.2,
        stop_quiet_s=1.0,  # (the talker answers each reply: a loaded machine may pause it)
        stop_drain_s=10.0,
    )
    engines = {"m": lambda: SyntheticEngine(item_shape=(2,))}
    worker = WorkerServer(config.backend, engines, heartbeat_s=0.2)
    with ServerThread(worker):
        first = BrokerServer(config)
        thread = _Thread(first)
        talker = _raw(context, config.frontend)
        late = _raw_watched(context)
        try:
            with Client(config.frontend) as client:
                wait_for_workers(client, 1)
            talker.send_multipart(_request(1))
            assert talker.poll(10_000)
            assert talker.recv_multipart()[0] == b"CP\x01\x02"  # served
            first.stop()
            # (stop() asks the loop: a request that reaches it before its next turn is
            # still admitted and answered as before the stop)
            clock = MonotonicClock()
            until = clock.now() + 10
            while not first.core.stopping:
                assert clock.now() < until, "the broker did not begin to stop"
                threading.Event().wait(0.005)
            answers: list[dict[str, object]] = []
            begun = clock.now()
            rid = 2
            # Keep talking: past the grace, each request is still read and answered.
            while clock.now() - begun < 1.0:
                talker.send_multipart(_request(rid))
                rid += 1
                assert talker.poll(5_000), "a request of an open connection went unanswered"
                header, meta = talker.recv_multipart()
                assert header == b"CP\x01\x03"
                answers.append(msgpack.unpackb(meta))
                if rid == 4:  # the stop has begun: a newcomer now meets the door
                    late[0].connect(config.frontend)
                    late[0].send_multipart(_request(100))
            assert all(a["code"] == 5 and a["retry"] is True for a in answers)
            hints = [int(a["retry_after_ms"]) for a in answers]  # type: ignore[call-overload]
            assert 0 < hints[-1] < hints[0] <= 10_200
            assert _connected_not_shaken(late[1])  # held at the handshake
            assert not late[0].poll(0)
            # Quiet now: the broker closes after stop_quiet_s, long before stop_drain_s.
            thread.join(5)
            assert not late[0].poll(0)  # nothing from the stopping broker
            first.close()  # (as its process would exit: the door goes with it)
            second = BrokerServer(config)
            with contextlib.closing(_Thread(second)):
                assert late[0].poll(10_000)
                header, meta = late[0].recv_multipart()[:2]
                assert header == b"CP\x01\x02"
                assert msgpack.unpackb(meta)["id"] == 100
                second.stop()
        finally:
            talker.close()
            late[0].close()
            late[1].close()
            thread.close()
