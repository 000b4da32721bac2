"""Routing ids: peers that choose ids the broker's ROUTERs would generate, or a flood of
random ones, cannot abort the broker (libzmq asserts when a generated id is taken).

Each test starts a broker process of its own: libzmq draws where a ROUTER's generated ids
start when the socket is made, so only a fresh process shows what a peer could predict.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer
from tests.conftest import wait_for_workers

CARPOOL = [sys.executable, "-m", "carpool"]
STATS = b"CP\x01\x04"
HEARTBEAT = b"CP\x01\x11"  # from a peer the broker does not know: it answers DISCONNECT

# What a fresh process that never seeds libc's rand() generates first on its first two
# ROUTERs (the broker's frontend, then its backend).
_PROBE = """
import zmq
ctx = zmq.Context()
ids = []
for _ in range(2):
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"x")
    ids.append(router.recv_multipart()[0].hex())
print(" ".join(ids))
"""


def _unseeded_first_ids() -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=30, check=True
    )
    front, back = (bytes.fromhex(h) for h in done.stdout.split())
    assert len(front) == len(back) == 5
    assert front[0] == back[0] == 0
    return struct.unpack(">I", front[1:])[0], struct.unpack(">I", back[1:])[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class BrokerProcess:
    proc: subprocess.Popen[bytes]
    frontend: str
    backend: str
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A fresh ``carpool broker`` on loopback, answering STATS; stopped at teardown."""
    frontend = f"tcp://127.0.0.1:{_free_port()}"
    backend = f"tcp://127.0.0.1:{_free_port()}"
    log = tmp_path / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CARPOOL, "broker", "--frontend", frontend, "--backend", backend,
             "--log-level", "WARNING"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    broker = BrokerProcess(proc, frontend, backend, log)
    try:
        # Raw sockets, not a Client: an ordinary client would take a generated id.
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as probe:
            probe.setsockopt(zmq.LINGER, 0)
            probe.setsockopt(zmq.ROUTING_ID, b"probe")
            probe.connect(frontend)
            clock = MonotonicClock()
            until = clock.now() + 30
            probe.send(STATS)
            while not probe.poll(200):
                assert broker.alive(), broker.logs()
                assert clock.now() < until, "the broker never answered\n" + broker.logs()
                probe.send(STATS)
        yield broker
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _squat(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, ids: list[bytes], hello: bytes
) -> list[zmq.Socket[bytes]]:
    """DEALERs under ``ids`` that each said ``hello`` and got an answer (so the ROUTER
    holds each id)."""
    socks = []
    for rid in ids:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, rid)
        sock.connect(endpoint)
        sock.send(hello)
        socks.append(sock)
    for sock in socks:
        assert sock.poll(10_000), "the broker did not answer a squatter"
        sock.recv_multipart()
    return socks


def _predicted(first: int, count: int) -> list[bytes]:
    return [b"\x00" + struct.pack(">I", (first + k) & 0xFFFFFFFF) for k in range(count)]


@pytest.mark.timeout(60)
def test_peers_holding_the_ids_the_frontend_would_generate_do_not_abort_the_broker(
    broker_process: BrokerProcess,
) -> None:
    """50 DEALERs take the ids an unseeded frontend generates next; ordinary clients (whose
    ids the frontend generates) still get answers, and the broker lives."""
    first, _ = _unseeded_first_ids()
    with zmq.Context() as ctx:
        socks = _squat(ctx, broker_process.frontend, _predicted(first, 50), STATS)
        try:
            for _ in range(3):
                with Client(broker_process.frontend, default_timeout_s=5.0) as client:
                    assert client.stats()["requests"] >= 50
            assert broker_process.alive(), broker_process.logs()
        finally:
            for sock in socks:
                sock.close(linger=0)


@pytest.mark.timeout(60)
def test_peers_holding_the_ids_the_backend_would_generate_do_not_abort_the_broker(
    broker_process: BrokerProcess, stack: contextlib.ExitStack
) -> None:
    """The same on the worker socket: a worker that connects after 50 squatters registers
    and serves."""
    _, first = _unseeded_first_ids()
    with zmq.Context() as ctx:
        socks = _squat(ctx, broker_process.backend, _predicted(first, 50), HEARTBEAT)
        try:
            engine = SyntheticEngine(item_shape=(2,), max_batch=4)
            worker = WorkerServer(broker_process.backend, {"m": lambda: engine}, warmup=False)
            stack.enter_context(ServerThread(worker))
            with Client(broker_process.frontend, default_timeout_s=5.0) as client:
                wait_for_workers(client, 1, timeout_s=20)
                x = np.ones((1, 2), np.float32)
                np.testing.assert_array_equal(client.infer("m", {"x": x})["y"], x * 3)
            assert broker_process.alive(), broker_process.logs()
        finally:
            for sock in socks:
                sock.close(linger=0)


# A ZMTP 3.0 peer in a few bytes (rfc.zeromq.org/spec/23) on a plain TCP socket, which
# costs the flood a fraction of what a zmq socket does: the greeting (NULL mechanism) and
# a READY command with the routing id; then, once the broker's greeting and READY have
# come, one message (libzmq ends a handshake in which a message comes before its READY).
_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04  # a frame's flags
# Connections opened before their handshakes are finished: fewer than libzmq's listen
# backlog (ZMQ_BACKLOG, 100), past which the kernel drops a connection's SYN and the
# connect waits 1 s or more to try again.
_WAVE = 50


def _zmtp_property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _zmtp_dealer_hello(routing_id: bytes) -> bytes:
    ready = b"\x05READY" + _zmtp_property(b"Socket-Type", b"DEALER")
    ready += _zmtp_property(b"Identity", routing_id)
    return _GREETING + bytes([_COMMAND, len(ready)]) + ready


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError(f"the broker closed a connection ({bytes(data)!r} of {size} bytes)")
        data += chunk
    return bytes(data)


def _zmtp_frame(conn: socket.socket) -> tuple[int, bytes]:
    flags = _recv_exactly(conn, 1)[0]
    size = _recv_exactly(conn, 8 if flags & _LONG else 1)
    return flags, _recv_exactly(conn, int.from_bytes(size, "big"))


def _zmtp_send_after_handshake(conn: socket.socket, body: bytes) -> None:
    """Read the broker's greeting and READY (the handshake is over), then send ``body``
    as a one-frame message."""
    greeting = _recv_exactly(conn, len(_GREETING))
    assert greeting[:1] + greeting[9:11] == b"\xff\x7f\x03", greeting
    flags, command = _zmtp_frame(conn)
    assert flags & _COMMAND, (flags, command)
    assert command.startswith(b"\x05READY"), command
    conn.sendall(bytes([0, len(body)]) + body)


def _zmtp_message(conn: socket.socket) -> list[bytes]:
    """The next message's frames (commands, such as a heartbeat's PING, skipped)."""
    frames = []
    while True:
        flags, body = _zmtp_frame(conn)
        if flags & _COMMAND:
            continue
        frames.append(body)
        if not flags & _MORE:
            return frames


def _flood(host: str, port: int, count: int, conns: list[socket.socket]) -> None:
    """``count`` connections under random ids, each sending STATS, added to ``conns``
    and left open: ``_WAVE`` opened at a time, then their handshakes finished."""
    for first in range(0, count, _WAVE):
        wave = []
        for rid in _random_ids(min(_WAVE, count - first)):
            conn = socket.create_connection((host, port), timeout=10)
            conns.append(conn)
            wave.append(conn)
            conn.sendall(_zmtp_dealer_hello(rid))
        for conn in wave:
            _zmtp_send_after_handshake(conn, STATS)


@contextlib.contextmanager
def _failing_with_logs(broker: BrokerProcess) -> Iterator[None]:
    """A connection that failed (closed, timed out) fails the test with the broker's
    state and log."""
    try:
        yield
    except (OSError, EOFError) as exc:
        with contextlib.suppress(subprocess.TimeoutExpired):
            broker.proc.wait(timeout=1)  # (one that is dying, for the message)
        state = "alive" if broker.alive() else "dead"
        pytest.fail(f"{exc!r}; the broker is {state}\n{broker.logs()}")


@pytest.mark.timeout(120)
def test_a_flood_of_random_routing_ids_leaves_the_broker_serving(
    broker_process: BrokerProcess,
) -> None:
    """10,000 connections, each under a random id in the generated ids' space (a zero byte
    and 4 random bytes) and sending STATS, 1,000 open at a time: the broker reads every
    one and answers it on its own connection, and keeps serving: while each 1,000 hold
    their ids, a client that connects (its id generated) is answered, and the broker's
    request count says it read those 1,000 and that STATS, no more, no fewer."""
    host, port = broker_process.frontend.removeprefix("tcp://").rsplit(":", 1)
    with Client(broker_process.frontend, default_timeout_s=10.0) as client:
        seen = client.stats()["requests"]
        for _ in range(10):
            conns: list[socket.socket] = []
            try:
                with _failing_with_logs(broker_process):
                    _flood(host, int(port), 1000, conns)
                    for conn in conns:
                        assert _zmtp_message(conn)[0] == STATS, "not the answer to STATS"
                with Client(broker_process.frontend, default_timeout_s=10.0) as newcomer:
                    n = newcomer.stats()["requests"]
                assert n == seen + 1000 + 1, f"the broker read {n - seen - 1} of 1000 messages"
                seen = n
            finally:
                for conn in conns:
                    conn.close()
            assert broker_process.alive(), broker_process.logs()
        assert client.stats()["requests"] == seen + 1
    assert broker_process.alive(), broker_process.logs()


def _random_ids(count: int) -> list[bytes]:
    raw = os.urandom(4 * count)
    return [b"\x00" + raw[4 * k : 4 * k + 4] for k in range(count)]
