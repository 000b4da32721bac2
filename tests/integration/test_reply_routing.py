"""Reply routing: a reply goes to the connection its request came by, never to a later
connection that took the routing id of one that has closed."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from carpool.broker.frontend import CONNECTION_PROPERTY, connection_number
from carpool.common.clock import MonotonicClock
from carpool.worker.engines.synthetic import SyntheticEngine

REQUEST = b"CP\x01\x01"
REPLY = 0x02
STATS = b"CP\x01\x04"


def _request(request_id: int) -> list[bytes]:
    meta = {
        "id": request_id,
        "model": "slow",
        "timeout_ms": 10_000,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}],
    }
    return [REQUEST, msgpack.packb(meta), np.ones((1, 4), np.float32).tobytes()]


def _dealer(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, rid: bytes) -> Any:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, rid)
    sock.connect(endpoint)
    return sock


@pytest.mark.timeout(60)
def test_a_newcomer_under_a_departed_clients_routing_id_gets_none_of_its_replies(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A client sends to a slow model and leaves; a newcomer connects under its routing id
    (the broker answers it, so the id is the newcomer's) before the batch ends. The reply
    is dropped and counted as ``departed``; the newcomer never sees it."""
    fleet = fleet_factory(max_batch=1, max_wait_s=0.001)
    engine = SyntheticEngine(fixed_cost_s=0.6, item_shape=(4,), max_batch=1)
    fleet.add_worker({"slow": lambda: engine}, warmup=False)
    client = fleet.ready()
    endpoint = fleet.broker.frontend_endpoint
    clock = MonotonicClock()

    def until(what: str, done: Any, limit_s: float = 10.0) -> None:
        end = clock.now() + limit_s
        while not done():
            assert clock.now() < end, f"{what} did not happen in {limit_s} s"
            client.poll(0.01)

    victim = _dealer(context, endpoint, b"victim")
    victim.send_multipart(_request(7))
    until("dispatch", lambda: client.stats()["inflight_batches"] == 1)
    victim.close(linger=0)

    newcomer = None
    end = clock.now() + 5
    while newcomer is None:  # the broker keeps the id while the victim's pipe stands
        assert clock.now() < end, "the newcomer never got the victim's routing id"
        sock = _dealer(context, endpoint, b"victim")
        sock.send_multipart([STATS, msgpack.packb({"id": 1})])
        if sock.poll(200):
            assert sock.recv_multipart()[0] == STATS
            newcomer = sock
        else:
            sock.close(linger=0)
    try:
        got: list[list[bytes]] = []

        def settled() -> bool:
            if newcomer.poll(0):
                got.append(newcomer.recv_multipart())
            assert not got, f"the newcomer received {got[0][0]!r}: the victim's reply"
            stats = client.stats()
            return bool(stats.get("departed")) and stats["inflight_batches"] == 0

        until("the batch's end", settled)
        assert client.stats()["departed"] == 1
        assert not newcomer.poll(0)
    finally:
        newcomer.close(linger=0)


@pytest.mark.timeout(60)
def test_a_clients_own_connection_number_does_not_replace_the_doors(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """libzmq puts the door's properties on a connection's messages ahead of the ones the
    peer sends itself (ZMTP metadata): a client that claims number 0, below every
    connection's floor, is still answered (its own claim would have its answers dropped,
    and a claimed number is how it could take another connection's)."""
    fleet = fleet_factory()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.METADATA, f"{CONNECTION_PROPERTY}:{connection_number(0)}".encode())
    sock.connect(fleet.broker.frontend_endpoint)
    try:
        sock.send_multipart([STATS, msgpack.packb({"id": 1})])
        assert sock.poll(10_000), "the client was not answered"
        assert sock.recv_multipart()[0] == STATS
    finally:
        sock.close(linger=0)


def _stepped_broker() -> tuple[Any, Any]:
    """A broker this test steps itself (so that events wait as they would behind a busy
    loop), and a worker of a 0.6 s model in a thread."""
    from carpool.broker.server import BrokerServer
    from carpool.common.testing import ServerThread
    from carpool.worker.server import WorkerServer
    from tests.conftest import loopback_config

    broker = BrokerServer(loopback_config(max_batch=1, max_wait_s=0.001))
    engine = SyntheticEngine(fixed_cost_s=0.6, item_shape=(4,), max_batch=1)
    worker = ServerThread(WorkerServer(broker.backend_endpoint, {"slow": lambda: engine}))
    worker.__enter__()
    clock = MonotonicClock()
    end = clock.now() + 20
    while not broker.core.registry.specs.get("slow"):
        assert clock.now() < end, "the worker never registered"
        broker.step(0.05)
    return broker, worker


def _newcomer_under(
    broker: Any, context: zmq.Context[zmq.Socket[bytes]], rid: bytes
) -> zmq.Socket[bytes]:
    """A connection that the broker has answered under routing id ``rid``."""
    clock = MonotonicClock()
    end = clock.now() + 10
    while True:
        assert clock.now() < end, "no newcomer got the routing id"
        sock = _dealer(context, broker.frontend_endpoint, rid)
        sock.send_multipart([STATS, msgpack.packb({"id": 1})])
        until = clock.now() + 0.2
        while clock.now() < until and not sock.poll(0):
            broker.step(0.01)
        if sock.poll(0):
            sock.recv_multipart()
            return sock
        sock.close(linger=0)


def _accepted(port: int) -> set[int]:
    """The connections accepted on loopback ``port`` that a descriptor still holds: the
    kernel's TCP table (/proc/net/tcp) by inode, not listening, inode 0 being one that
    no descriptor holds (not accepted yet, or closed)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text(encoding="ascii").splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], int(fields[9])
        if int(local.rsplit(":", 1)[1], 16) == port and state != _LISTEN and inode:
            found.add(inode)
    return found


_LISTEN = "0A"  # a socket's state in /proc/net/tcp


def _descriptor(inode: int) -> int:
    """This process's descriptor of the socket ``inode``."""
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(entry) == f"socket:[{inode}]":
                return int(entry.name)
        except FileNotFoundError:  # (a descriptor closed while listed)
            continue
    raise AssertionError(f"no descriptor holds socket {inode}")


def _holds(fd: int, inode: int) -> bool:
    """Whether descriptor ``fd`` is still socket ``inode``'s."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{inode}]"
    except FileNotFoundError:
        return False


def _hold_below(fd: int) -> list[int]:
    """Hold every free descriptor below ``fd`` (each on /dev/null), so that ``fd`` is
    the lowest free one: the next descriptor this process makes. ``fd`` must be free."""
    held: list[int] = []
    while True:
        got = os.open(os.devnull, os.O_RDONLY)
        if got >= fd:
            os.close(got)
            assert got == fd, f"descriptor {fd} is not free"
            return held
        held.append(got)


def _until(what: str, done: Callable[[], object], limit_s: float = 10.0) -> None:
    clock, pause = MonotonicClock(), threading.Event()
    end = clock.now() + limit_s
    while not done():
        assert clock.now() < end, f"{what}: not within {limit_s} s"
        pause.wait(0.002)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("descriptor", ["held", "reused"])
def test_a_request_read_after_its_connection_closed_is_answered_to_nobody(
    context: zmq.Context[zmq.Socket[bytes]], descriptor: str
) -> None:
    """The broker reads a client's request only after that client has gone: the monitor
    has said that its connection closed, and its descriptor is held by something else in
    the broker's process (``held``) or is already another connection's, which the
    monitor has said opened (``reused``). The reply must not reach a newcomer under its
    routing id."""
    broker, worker = _stepped_broker()
    others: list[zmq.Socket[bytes]] = []
    held: list[int] = []
    raw = socket.socket()  # (its descriptor made now: none when it connects below)
    # The victim's own context: ended, it holds no descriptor (none freed later, below
    # the one that the descriptors held below leave free).
    alone: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        # Nothing reads the frontend until the newcomer below: the server's own seams
        # answer the victim's handshake (the door) and read the monitor (the table).
        door, frontend = broker._door, broker._frontend
        table = frontend.clients.table
        port = int(broker.frontend_endpoint.rsplit(":", 1)[1])
        victim = _dealer(alone, broker.frontend_endpoint, b"victim")
        victim.send_multipart(_request(7))
        victim.close(linger=10_000)
        assert door.socket.poll(10_000), "the victim's handshake never asked the door"
        (inode,) = _accepted(port)  # its handshake waits for the door: it is open
        fd = _descriptor(inode)
        frontend.refresh()  # (libzmq said it opened before its handshake asked the door)
        assert table.open_on(fd) is not None, "the monitor has not said it opened"
        door.on_poll()
        alone.term()  # once its request is sent and its connection closed

        def closed() -> bool:  # its request sent: the monitor says so, then fd is free
            frontend.refresh()
            return table.open_on(fd) is None and not _holds(fd, inode)

        _until("the victim's connection closes", closed)
        held.extend(_hold_below(fd))
        if descriptor == "held":
            held.append(os.open(os.devnull, os.O_RDONLY))
            assert held[-1] == fd
        else:  # (nothing here opens a descriptor until the monitor says it opened)
            raw.connect(("127.0.0.1", port))  # accepted on fd; it never says a word

            def opened() -> bool:
                frontend.refresh()
                return len(table) == 1

            _until("the monitor says another connection opened", opened)
            assert table.open_on(fd) is not None, "it opened on another descriptor"
        newcomer = _newcomer_under(broker, context, b"victim")
        others.append(newcomer)
        clock = MonotonicClock()
        end = clock.now() + 10
        got: list[list[bytes]] = []
        while clock.now() < end and broker.core.stats.departed == 0:
            broker.step(0.01)
            while newcomer.poll(0):
                got.append(newcomer.recv_multipart())
        for _ in range(10):
            broker.step(0.01)
        while newcomer.poll(0):
            got.append(newcomer.recv_multipart())
        assert got == [], "the newcomer received the victim's reply"
        assert broker.core.stats.departed == 1
    finally:
        alone.destroy(linger=0)
        raw.close()
        for sock in others:
            sock.close(linger=0)
        for held_fd in held:
            os.close(held_fd)
        worker.__exit__(None, None, None)
        broker.close()
