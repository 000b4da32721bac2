"""Raw TCP peers on the broker's two endpoints, and a peer posing as the broker to a
worker: what they send is refused or dropped, nothing stops or stalls, and valid traffic
is answered right after (protocol.md §1, §11; docs/security.md).

The junk: random bytes (their first byte makes libzmq take them for a ZMTP 1.0 peer's
messages, unless ZAP is on), a truncated ZMTP greeting, a ZMTP 1.0 greeting followed by
junk, and a ZMTP 3 greeting with a NULL handshake and a frame that declares 2^40 bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.broker.admission import layout_of
from carpool.broker.server import BrokerFault, BrokerServer
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.protocol import decode_from_worker
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config, wait_for_workers

pytestmark = pytest.mark.timeout(60)

X = np.arange(4, dtype=np.float32).reshape(1, 4)


def zmtp3_greeting(as_server: bool = False) -> bytes:
    """A ZMTP 3.0 greeting for the NULL mechanism (RFC 23)."""
    return (
        b"\xff"
        + b"\x00" * 8
        + b"\x7f"
        + b"\x03\x00"
        + b"NULL".ljust(20, b"\x00")
        + bytes([as_server])
        + b"\x00" * 31
    )


def ready_command(socket_type: bytes) -> bytes:
    """A NULL handshake's READY command with its Socket-Type property."""
    body = b"\x05READY\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return bytes([0x04, len(body)]) + body


def junk(kind: str, *, socket_type: bytes = b"DEALER", seed: int = 27) -> bytes:
    rng = random.Random(seed)
    tail = bytes(rng.getrandbits(8) for _ in range(4096))
    if kind == "random-bytes":
        return b"\x2a" + tail[1:]  # not 0xFF: read as a ZMTP 1.0 peer's, unless ZAP is on
    if kind == "truncated-greeting":
        return zmtp3_greeting()[:7]
    if kind == "zmtp1-greeting-then-junk":
        return b"\x01\x00" + tail  # ZMTP 1.0: an empty identity, then junk frames
    if kind == "zmtp3-frame-of-2^40-bytes":
        huge = b"\x02" + (1 << 40).to_bytes(8, "big")  # a long frame of 2^40 bytes
        return zmtp3_greeting() + ready_command(socket_type) + huge + tail
    raise AssertionError(kind)


JUNK = [
    "random-bytes",
    "truncated-greeting",
    "zmtp1-greeting-then-junk",
    "zmtp3-frame-of-2^40-bytes",
]
#: What a connecting DEALER (a worker's) takes for a ZMTP 1.0 peer's messages: no ZAP
#: guards that side, so the worker drops them itself.
HEARD_AS_MESSAGES = ("random-bytes", "zmtp1-greeting-then-junk")


def tcp_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def send_raw(port: int, data: bytes, *, wait_s: float = 0.2) -> None:
    """Connect a plain TCP socket, send ``data`` (what the peer takes of it), and close
    once the peer has closed or ``wait_s`` of silence has passed."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        contextlib.suppress(OSError),  # the broker may close first
    ):
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(wait_s)
        while wait_s and sock.recv(65536):
            pass


def assert_serving(broker: BrokerServer, thread: ServerThread, client: Client) -> None:
    y = client.infer("syn", {"x": X}, timeout_s=10)["y"]
    np.testing.assert_array_equal(y, synthetic_output(X))
    assert thread.error is None
    assert thread._thread.is_alive()


@pytest.fixture
def fleet() -> Iterator[tuple[BrokerServer, ServerThread, Client]]:
    with contextlib.ExitStack() as stack:
        thread = ServerThread(BrokerServer(loopback_config(max_batch=4, max_wait_s=0.001)))
        broker = stack.enter_context(thread)
        engines = {"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=4)}
        worker = WorkerServer(broker.backend_endpoint, engines, heartbeat_s=0.1)
        stack.enter_context(ServerThread(worker))
        client = stack.enter_context(Client(broker.frontend_endpoint))
        wait_for_workers(client, 1)
        yield broker, thread, client


@pytest.mark.parametrize("kind", JUNK)
@pytest.mark.parametrize("endpoint", ["frontend", "backend"])
def test_junk_from_a_raw_tcp_peer_leaves_the_broker_serving(
    fleet: tuple[BrokerServer, ServerThread, Client], endpoint: str, kind: str
) -> None:
    broker, thread, client = fleet
    ep = broker.frontend_endpoint if endpoint == "frontend" else broker.backend_endpoint
    send_raw(tcp_port(ep), junk(kind))
    assert_serving(broker, thread, client)
    send_raw(tcp_port(ep), junk(kind, seed=28))  # twice: the first left nothing behind
    assert_serving(broker, thread, client)
    stats = client.stats()
    assert stats["workers"][0]["name"]  # the worker stayed registered
    assert sum(stats["dropped_unreadable"][endpoint].values()) == 0  # refused, not read


# ---------------------------------------------------------------- any bytes at all

#: Streams that stop at every stage: in the greeting, in the handshake, past it.
RAW_STREAMS = st.one_of(
    st.binary(max_size=2048),
    st.binary(max_size=64).map(lambda tail: zmtp3_greeting()[:11] + tail),
    st.binary(max_size=2048).map(lambda tail: zmtp3_greeting() + ready_command(b"DEALER") + tail),
    st.binary(max_size=2048).map(lambda tail: b"\x01\x00" + tail),  # ZMTP 1.0
)


@pytest.mark.parametrize("endpoint", ["frontend", "backend"])
def test_no_byte_stream_stops_the_broker(
    fleet: tuple[BrokerServer, ServerThread, Client], endpoint: str
) -> None:
    """Hypothesis over raw byte streams into one endpoint, each on a connection of its
    own; valid traffic is checked every 10 examples and at the end."""
    broker, thread, client = fleet
    port = tcp_port(broker.frontend_endpoint if endpoint == "frontend" else broker.backend_endpoint)
    examples = itertools.count(1)

    @settings(
        max_examples=50,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(RAW_STREAMS)
    def feed(data: bytes) -> None:
        send_raw(port, data, wait_s=0)
        if next(examples) % 10 == 0:
            assert_serving(broker, thread, client)

    feed()
    assert_serving(broker, thread, client)
    assert client.stats()["workers"]


# ---------------------------------------------------------------- faults while reading


def _raw_dealer(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _stats_frames(sid: int) -> list[bytes]:
    return [b"CP\x01\x04", msgpack.packb({"id": sid})]


def _fails_first(calls: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that its first ``calls`` calls raise (a fault injected)."""
    left = [calls]

    def call(*args: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected fault")
        return real(*args)

    return call


def test_a_fault_while_reading_a_client_message_drops_it_and_the_loop_goes_on(
    fleet: tuple[BrokerServer, ServerThread, Client],
    context: zmq.Context[zmq.Socket[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker, thread, client = fleet
    caplog.set_level("WARNING", logger="carpool.broker.faults")
    # The server's own seam: how a message's connection is told (SRCFD, the table).
    frontend = broker._frontend
    frontend.key = _fails_first(2, frontend.key)
    sock = _raw_dealer(context, broker.frontend_endpoint)
    try:
        for sid in (1, 2, 3):
            sock.send_multipart(_stats_frames(sid))
        assert sock.poll(10_000)
        answer = msgpack.unpackb(sock.recv_multipart()[1])
        assert answer["id"] == 3  # the first two were dropped, unanswered
        assert answer["dropped_unreadable"]["frontend"]["connection"] == 2
        assert not sock.poll(200)
    finally:
        sock.close()
    assert_serving(broker, thread, client)
    lines = [r for r in caplog.records if "could not be read (connection)" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].exc_info is not None  # the first of its kind with its traceback
    assert lines[1].exc_info is None


def test_a_fault_while_reading_a_worker_message_drops_it_and_the_loop_goes_on(
    fleet: tuple[BrokerServer, ServerThread, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's next heartbeat (every 0.1 s here) is the message dropped: a dropped
    RESULT would hold its batch until the engine watchdog gave up on it."""
    broker, thread, client = fleet
    failing = _fails_first(1, decode_from_worker)
    monkeypatch.setattr("carpool.broker.transports.zeromq.decode_from_worker", failing)
    clock = MonotonicClock()
    until = clock.now() + 10
    while not client.stats()["dropped_unreadable"]["backend"]["decode"]:
        assert clock.now() < until
        client.poll(0.02)
    assert client.stats()["dropped_unreadable"]["backend"] == {
        "receive": 0,
        "connection": 0,
        "decode": 1,
    }
    assert_serving(broker, thread, client)


# ---------------------------------------------------------------- faults inside the core


def test_a_fault_inside_the_core_that_changed_nothing_is_answered_internal(
    fleet: tuple[BrokerServer, ServerThread, Client],
    context: zmq.Context[zmq.Socket[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker, thread, client = fleet
    monkeypatch.setattr("carpool.broker.intake.layout_of", _fails_first(1, layout_of))
    sock = _raw_dealer(context, broker.frontend_endpoint)
    meta = {
        "id": 41,
        "model": "syn",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}],
    }
    try:
        sock.send_multipart([b"CP\x01\x01", msgpack.packb(meta), X.tobytes()])
        assert sock.poll(10_000)
        header, error = sock.recv_multipart()
        assert header == b"CP\x01\x03"
        assert msgpack.unpackb(error)["id"] == 41
        assert msgpack.unpackb(error)["code"] == 6  # INTERNAL
        sock.send_multipart([b"CP\x01\x01", msgpack.packb(meta), X.tobytes()])
        assert sock.poll(10_000)
        assert sock.recv_multipart()[0] == b"CP\x01\x02"  # the same request, run
    finally:
        sock.close()
    assert_serving(broker, thread, client)
    assert client.stats()["core_faults"] == 1
    (line,) = [r for r in caplog.records if "fault inside the broker's core" in r.getMessage()]
    assert line.exc_info is not None


@contextlib.contextmanager
def _serving(broker: BrokerServer) -> Iterator[tuple[threading.Thread, list[BaseException]]]:
    """``broker.serve()`` on a thread, what it raises collected; stopped, joined and
    closed after."""
    faults: list[BaseException] = []

    def serve() -> None:
        try:
            broker.serve()
        except BaseException as exc:
            faults.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield thread, faults
    finally:
        broker.stop()
        thread.join(10)
        broker.close()


def test_a_fault_inside_the_core_after_a_state_change_winds_the_broker_down(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The request the fault left queued is answered (UNAVAILABLE, retry) by the
    wind-down, and serve() raises BrokerFault: the process exits 1 and systemd restarts
    it."""
    config = dataclasses.replace(loopback_config(max_batch=4, max_wait_s=0.05), stop_grace_s=0.2)
    broker = BrokerServer(config)
    meta = {
        "id": 7,
        "model": "syn",
        "timeout_ms": 30_000,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}],
    }
    engines = {"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=4)}
    with (
        _serving(broker) as (serving, faults),
        ServerThread(WorkerServer(broker.backend_endpoint, engines)),
    ):
        with Client(broker.frontend_endpoint) as client:
            wait_for_workers(client, 1)
        backlog = broker.core.backlog
        real_add = backlog.add

        def add_then_fail(req: Any) -> Any:
            real_add(req)
            raise RuntimeError("injected fault after the request was queued")

        backlog.add = add_then_fail  # type: ignore[method-assign]
        sock = _raw_dealer(context, broker.frontend_endpoint)
        try:
            sock.send_multipart([b"CP\x01\x01", msgpack.packb(meta), X.tobytes()])
            assert sock.poll(10_000)
            header, error = sock.recv_multipart()
            serving.join(10)
            assert not serving.is_alive()  # it stopped by itself
            assert not sock.poll(100)  # and answered the request once
        finally:
            sock.close()
    answer = msgpack.unpackb(error)
    assert answer["id"] == 7
    if header == b"CP\x01\x03":  # (or its batch ran in the grace, and it is answered)
        assert (answer["code"], answer["retry"]) == (5, True)  # UNAVAILABLE, retry
    else:
        assert header == b"CP\x01\x02"
    assert len(faults) == 1
    assert isinstance(faults[0], BrokerFault)


def test_a_fault_in_a_tick_winds_the_broker_down(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A fault out of a loop turn that is no message's (the core's tick) stops the
    broker the same way: wound down, and serve() raises BrokerFault."""
    broker = BrokerServer(loopback_config(max_batch=4, max_wait_s=0.001))
    broker.core.on_tick = _fails_first(1, broker.core.on_tick)  # type: ignore[method-assign]
    with _serving(broker) as (serving, faults):
        with contextlib.closing(_raw_dealer(context, broker.frontend_endpoint)):
            serving.join(10)  # (a connection wakes the loop: that turn's tick fails)
        assert not serving.is_alive()  # it stopped by itself
    assert broker.core.stopping
    assert len(faults) == 1
    assert isinstance(faults[0], BrokerFault)
    assert "injected fault" in str(faults[0])


# ---------------------------------------------------------------- a peer posing as the broker


@pytest.mark.parametrize("kind", JUNK)
def test_a_worker_survives_a_peer_posing_as_its_broker(kind: str) -> None:
    """The fake takes the worker's connection, sends junk, and closes; a real broker then
    listens on the same port, and the worker registers there and serves."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    engines = {"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=4)}
    worker = WorkerServer(f"tcp://127.0.0.1:{port}", engines, heartbeat_s=0.1)
    with ServerThread(worker) as running:
        listener.settimeout(10)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            assert conn.recv(4096)  # the worker's greeting has begun
            with contextlib.suppress(OSError):  # (the worker may close first)
                conn.sendall(junk(kind, socket_type=b"ROUTER"))
            if kind in HEARD_AS_MESSAGES:  # until the worker has read them (bounded)
                clock = MonotonicClock()
                until = clock.now() + 10
                while not worker.core.unreadable["malformed"] and clock.now() < until:
                    threading.Event().wait(0.01)
        listener.close()
        config = loopback_config(max_batch=4, max_wait_s=0.001)
        config = dataclasses.replace(config, backend=f"tcp://127.0.0.1:{port}")
        with (
            ServerThread(BrokerServer(config)) as broker,
            Client(broker.frontend_endpoint) as client,
        ):
            wait_for_workers(client, 1)
            y = client.infer("syn", {"x": X}, timeout_s=10)["y"]
            np.testing.assert_array_equal(y, synthetic_output(X))
        assert running is worker
    if kind in HEARD_AS_MESSAGES:
        assert worker.core.unreadable["malformed"] > 0  # heard as messages, and dropped


def test_a_fault_on_the_brokers_message_makes_the_worker_start_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault inside the worker on a message from its broker (a bug of ours) is logged
    with its traceback, and the worker starts over on a new connection (the broker
    requeues what it held), so no half-done state outlives it; it serves on."""
    caplog.set_level("ERROR", logger="carpool.worker.server")
    engines = {"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=4)}
    with ServerThread(BrokerServer(loopback_config(max_batch=4, max_wait_s=0.001))) as broker:
        worker = WorkerServer(broker.backend_endpoint, engines, heartbeat_s=0.1)
        with ServerThread(worker), Client(broker.frontend_endpoint) as client:
            wait_for_workers(client, 1)
            epoch = worker.core.epoch
            worker.core.on_broker = _fails_first(1, worker.core.on_broker)  # type: ignore[method-assign]
            clock = MonotonicClock()
            until = clock.now() + 10
            while worker.core.epoch == epoch:  # the broker's next heartbeat meets the fault
                assert clock.now() < until, "the worker did not start over"
                client.poll(0.02)
            y = client.infer("syn", {"x": X}, timeout_s=10)["y"]
            np.testing.assert_array_equal(y, synthetic_output(X))
    (line,) = [r for r in caplog.records if "a fault on the broker's message" in r.getMessage()]
    assert line.exc_info is not None
