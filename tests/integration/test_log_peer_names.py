"""No log line carries a routing id the broker's ROUTERs generated (docs/security.md, "Logs
name peers by tag"): ids go up by one per connection, so a reader of the log could take
the next ones and make libzmq abort the broker.

An in-process broker, driven turn by turn (``step``) with every ``carpool`` logger at
DEBUG, is made to write each line a peer can cause; the routing ids come from the
broker's side: every message its two ROUTERs hand it (recorded where it reads them,
:func:`carpool.common.sockets.recv_frames`) and its worker registry. No captured record,
formatted, holds one of those ids raw, as ``repr`` or in hex.

The ROUTERs of the plain broker are on ``inproc://``: there a queue holds the ROUTER's
high-water mark (10,000) plus the peer's receive mark (1 here) and no kernel buffers, so
a peer that reads nothing makes "not reading" after a known number of replies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

import carpool.common.sockets
from carpool.broker.config import CurveConfig
from carpool.broker.server import BrokerServer
from carpool.client import ClientOptions
from carpool.client.core import ClientCore
from carpool.common.clock import MonotonicClock
from carpool.common.curve import ClientKeys, connect_keys, create_keypair, load_keypair
from carpool.common.peer_names import peer_tag
from carpool.common.protocol import ModelSpec, Ready, TensorMeta, WorkerReady
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)

STATS_V2 = [b"CP\x02\x04", b"\x80"]  # STATS under a protocol version the broker lacks
HEARTBEAT = [b"CP\x01\x11", b"\x80"]  # from a stranger: answered DISCONNECT
# Replies it takes to fill an inproc ROUTER's queue to a peer whose RCVHWM is 1.
FILL = 10_000 + 1 + 50

# Each line a peer can cause: (name, logger, what its message holds).
LINES = [
    ("version mismatch", "carpool.broker.intake", "sent protocol version 2"),
    ("client not reading", "carpool.broker.frontend", "on frontend is not reading"),
    ("client gone", "carpool.broker.frontend", "on frontend is gone"),
    ("worker not reading", "carpool.broker.transports.zeromq", "on the backend is not reading"),
    ("worker gone", "carpool.broker.transports.zeromq", "on backend is gone"),
    ("refused READY", "carpool.broker.workers", "refused: model spec differs"),
    ("protocol error", "carpool.broker.workers", "protocol error: worker messages have"),
    ("worker joined", "carpool.broker.workers", "worker joined name="),
    ("worker left", "carpool.broker.workers", "worker left name="),
    ("key mismatch (CURVE)", "carpool.broker.auth", "spoke with key"),
]


class RoutingIds:
    """The routing id of every message the broker's ROUTERs hand it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.routers: list[zmq.Socket[bytes]] = []
        self.seen: set[bytes] = set()
        recv = carpool.common.sockets.recv_frames

        def spy(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
            frames = recv(sock, flags)
            if any(sock is router for router in self.routers):
                self.seen.add(frames[0].bytes)
            return frames

        monkeypatch.setattr(carpool.common.sockets, "recv_frames", spy)

    def watch(self, broker: BrokerServer) -> BrokerServer:
        self.routers += [broker.frontend, broker.backend]
        return broker

    def generated(self) -> set[bytes]:
        """The ids libzmq generated (``00`` and a 32-bit counter), not ones a peer chose."""
        return {rid for rid in self.seen if len(rid) == 5 and rid[0] == 0}


def _forms(rid: bytes) -> list[str]:
    """How a routing id could appear in a line: raw, as repr (whole, or inside a
    longer one), in hex (whole, or its counter)."""
    return [rid.decode("latin-1"), repr(rid), repr(rid)[2:-1], rid.hex(), rid[1:].hex()]


def _text(record: logging.LogRecord) -> str:
    text = record.getMessage()
    if record.exc_info:
        text += "\n" + logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        text += "\n" + record.exc_text
    return text


def _lines(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    logger, part = next((lg, p) for n, lg, p in LINES if n == name)
    return [_text(r) for r in caplog.records if r.name == logger and part in r.getMessage()]


def _written(caplog: pytest.LogCaptureFixture, name: str) -> Callable[[], bool]:
    return lambda: bool(_lines(caplog, name))


def _steps(broker: BrokerServer, done: Callable[[], bool], s: float) -> bool:
    """Run the broker's loop until ``done()``, at most ``s`` seconds; whether it came."""
    clock = MonotonicClock()
    until = clock.now() + s
    while not done():
        if clock.now() >= until:
            return False
        broker.step(0.01)
    return True


def _step_until(broker: BrokerServer, done: Callable[[], bool], what: str, s: float = 5) -> None:
    assert _steps(broker, done, s), f"not within {s} s: {what}"


def _dealer(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    *,
    rcvhwm: int = 1000,
    keys: ClientKeys | None = None,
    routing_id: bytes = b"",
) -> zmq.Socket[bytes]:
    """A raw DEALER; it leaves its routing id to the ROUTER unless given one."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if keys is not None:
        connect_keys(sock, keys)
    sock.connect(endpoint)
    return sock


def _ready(name: str, model: str, width: int, heartbeat_ms: int = 60_000) -> list[Any]:
    spec = ModelSpec(
        model,
        (TensorMeta("x", "float32", (-1, width)),),
        (TensorMeta("y", "float32", (-1, width)),),
        4,
    )
    return WorkerReady(Ready(name, 1, (spec,), heartbeat_ms)).to_frames()


def _got_message(sock: zmq.Socket[bytes]) -> Callable[[], bool]:
    return lambda: bool(sock.poll(0))


def _registered(broker: BrokerServer, name: str) -> bytes | None:
    """The routing id the registry holds for worker ``name``."""
    return next((w.wid for w in broker.core.registry.all() if w.name == name), None)


@dataclasses.dataclass
class Keys:
    curve: CurveConfig
    pairs: dict[str, ClientKeys]


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    """The broker's key pair, a client key, and two worker keys."""
    made = {
        name: create_keypair(tmp_path / sub, name)[1]
        for sub, name in [
            ("broker", "broker"),
            ("clients", "client"),
            ("workers", "worker"),
            ("workers", "other-worker"),
        ]
    }
    curve = CurveConfig(
        enabled=True,
        server_key=str(made["broker"]),
        clients=str(tmp_path / "clients"),
        workers=str(tmp_path / "workers"),
    )
    public = load_keypair(made["broker"]).public
    return Keys(curve, {n: ClientKeys(public, load_keypair(p)) for n, p in made.items()})


@pytest.fixture
def ids(monkeypatch: pytest.MonkeyPatch) -> RoutingIds:
    return RoutingIds(monkeypatch)


@pytest.fixture
def dealer(
    context: zmq.Context[zmq.Socket[bytes]],
) -> Iterator[Callable[..., zmq.Socket[bytes]]]:
    """Makes raw DEALERs (:func:`_dealer`), closed at the end."""
    made: list[zmq.Socket[bytes]] = []

    def make(endpoint: str, **kwargs: Any) -> zmq.Socket[bytes]:
        made.append(_dealer(context, endpoint, **kwargs))
        return made[-1]

    yield make
    for sock in made:
        sock.close(linger=0)


def _plain_lines(
    broker: BrokerServer, dealer: Callable[..., zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """Every line a peer can cause without CURVE, each peer a DEALER without a chosen id."""
    front, back = broker.frontend_endpoint, broker.backend_endpoint
    # worker joined: w1 serves m (and stays: a heartbeat a minute).
    w1 = dealer(back)
    w1.send_multipart(_ready("w1", "m", 3))
    _step_until(broker, lambda: _registered(broker, "w1") is not None, "w1 registered")
    # refused READY: m again, with other shapes.
    w2 = dealer(back)
    w2.send_multipart(_ready("w2", "m", 4))
    _step_until(broker, _got_message(w2), "w2 refused")
    # protocol error: one frame of garbage.
    bad = dealer(back)
    bad.send_multipart([b"garbage"])
    _step_until(broker, _got_message(bad), "the garbage answered")
    # version mismatch.
    old = dealer(front)
    old.send_multipart(STATS_V2)
    _step_until(broker, _got_message(old), "the old version answered")
    # client gone: its request reaches w1 (which never answers), then the client closes;
    # the answer at the request's deadline finds nobody.
    client = ClientCore.from_options(ClientOptions())
    gone = dealer(front)
    gone.send_multipart(client.request(0.0, "m", {"x": np.zeros((1, 3), np.float32)}, 0.2)[1])
    _step_until(broker, _got_message(w1), "the request dispatched to w1")
    gone.close(linger=0)
    _step_until(broker, _written(caplog, "client gone"), "client gone")
    # worker gone, worker left: w3 registers and closes; its next heartbeat finds nobody.
    w3 = dealer(back)
    w3.send_multipart(_ready("w3", "g", 3, heartbeat_ms=50))
    _step_until(broker, lambda: _registered(broker, "w3") is not None, "w3 registered")
    w3.close(linger=0)
    _step_until(broker, _written(caplog, "worker gone"), "worker gone")
    # client not reading: more replies than its queue holds.
    deaf = dealer(front, rcvhwm=1)
    for _ in range(FILL):
        deaf.send_multipart(STATS_V2, zmq.NOBLOCK)
    _step_until(broker, _written(caplog, "client not reading"), "client not reading", 20)
    # worker not reading: a stranger's heartbeats, each answered DISCONNECT.
    deaf = dealer(back, rcvhwm=1)
    for _ in range(FILL):
        deaf.send_multipart(HEARTBEAT, zmq.NOBLOCK)
    _step_until(broker, _written(caplog, "worker not reading"), "worker not reading", 20)


def _curve_lines(
    broker: BrokerServer, dealer: Callable[..., zmq.Socket[bytes]], keys: Keys
) -> bytes:
    """The lines under CURVE; returns the id a worker key took from another's worker."""
    front, back = broker.frontend_endpoint, broker.backend_endpoint
    # version mismatch: the client's id is its key, its connection, its routing id.
    old = dealer(front, keys=keys.pairs["client"])
    old.send_multipart(STATS_V2)
    _step_until(broker, _got_message(old), "the old version answered (CURVE)")
    first = dealer(back, keys=keys.pairs["worker"])
    first.send_multipart(_ready("first", "m", 3))
    _step_until(broker, lambda: _registered(broker, "first") is not None, "first registered")
    # key mismatch: another worker key takes first's id, read from the registry, while
    # first is registered. While the ROUTER still holds first's connection, a newcomer
    # under its id is not heard: it tries again with a new one.
    taken = _registered(broker, "first")
    assert taken is not None
    first.close(linger=0)
    keyed = broker._zmq.keys
    assert keyed is not None
    for _ in range(20):
        thief = dealer(back, keys=keys.pairs["other-worker"], routing_id=taken)
        thief.send_multipart(_ready("thief", "m", 3))
        if _steps(broker, lambda: keyed.refused > 0, 0.5):
            return taken
        thief.close(linger=0)
    raise AssertionError("no connection under the taken id was heard")


def test_no_log_line_a_peer_causes_names_a_generated_routing_id(
    context: zmq.Context[zmq.Socket[bytes]],
    caplog: pytest.LogCaptureFixture,
    ids: RoutingIds,
    keys: Keys,
    dealer: Callable[..., zmq.Socket[bytes]],
) -> None:
    caplog.set_level(logging.DEBUG, logger="carpool")
    for _, name, _ in LINES:  # (each of them too: a test before may have raised one's level)
        caplog.set_level(logging.DEBUG, logger=name)
    suffix = os.urandom(4).hex()
    plain = dataclasses.replace(
        loopback_config(),
        frontend=f"inproc://logs-front-{suffix}",
        backend=f"inproc://logs-back-{suffix}",
    )
    with ids.watch(BrokerServer(plain, context=context)) as broker:
        _plain_lines(broker, dealer, caplog)
    curve = dataclasses.replace(loopback_config(), curve=keys.curve)
    with ids.watch(BrokerServer(curve, context=context)) as broker:
        taken = _curve_lines(broker, dealer, keys)

    generated = ids.generated()
    # One per DEALER that left its id to the ROUTER: 8 on the plain broker, 2 under CURVE
    # (the thieves chose first's).
    assert len(generated) >= 10, generated
    assert taken in generated
    for name, _, _ in LINES:
        assert _lines(caplog, name), f"the {name} line was not written"
    leaks = [
        (record.name, text)
        for record in caplog.records
        for text in [_text(record)]
        if any(form in text for rid in generated for form in _forms(rid))
    ]
    assert not leaks, leaks
    # The lines still say who: the key mismatch names the registered worker by its tag.
    assert any(f"peer={peer_tag(taken)}" in line for line in _lines(caplog, "key mismatch (CURVE)"))
