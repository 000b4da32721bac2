"""Routing ids: peers that choose ids the broker's ROUTERs would generate, or a flood of
random ones, cannot abort the broker (libzmq asserts when a generated id is taken).

Each test starts a broker process of its own: libzmq draws where a ROUTER's generated ids
start when the socket is made, so only a fresh process shows what a peer could predict.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.client import Client
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer
from tests.bench_scripts import load_script
from tests.conftest import wait_for_workers

flood = load_script("flood.py")

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


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[Any]:
    """A fresh ``carpool broker`` on loopback, answering STATS; stopped at teardown."""
    with flood.broker_process(tmp_path) as broker:
        yield broker


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
    broker_process: Any,
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
    broker_process: Any, stack: contextlib.ExitStack
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


@contextlib.contextmanager
def _failing_with_logs(broker: Any) -> Iterator[None]:
    """A connection that failed (closed, timed out) fails the test with the broker's
    state and log."""
    try:
        yield
    except (OSError, EOFError) as exc:
        with contextlib.suppress(subprocess.TimeoutExpired):
            broker.proc.wait(timeout=1)  # (one that is dying, for the message)
        state = "alive" if broker.alive() else "dead"
        pytest.fail(f"{exc!r}; the broker is {state}\n{broker.logs()}")


@pytest.mark.timeout(60)
def test_a_flood_of_random_routing_ids_leaves_the_broker_serving(broker_process: Any) -> None:
    """1,000 connections, each under a random id in the generated ids' space (a zero byte
    and 4 random bytes) and sending STATS, all open at once: the broker reads every one
    and answers it on its own connection, and keeps serving: while the 1,000 hold their
    ids, a client that connects (its id generated) is answered, and the broker's request
    count says it read those 1,000 and that STATS, no more, no fewer. (bench/flood.py
    runs 10,000, 1,000 at a time, with the same peers.)"""
    host, port = broker_process.frontend.removeprefix("tcp://").rsplit(":", 1)
    with Client(broker_process.frontend, default_timeout_s=10.0) as client:
        seen = client.stats()["requests"]
        conns: list[socket.socket] = []
        try:
            with _failing_with_logs(broker_process):
                flood.open_peers(host, int(port), 1000, conns)
                for conn in conns:
                    assert flood.zmtp_message(conn)[0] == STATS, "not the answer to STATS"
            with Client(broker_process.frontend, default_timeout_s=10.0) as newcomer:
                n = newcomer.stats()["requests"]
            assert n == seen + 1000 + 1, f"the broker read {n - seen - 1} of 1000 messages"
        finally:
            for conn in conns:
                conn.close()
        assert broker_process.alive(), broker_process.logs()
        assert client.stats()["requests"] == n + 1
    assert broker_process.alive(), broker_process.logs()
