"""The broker's worker transports at their seam, on real sockets: a recording Upstream in
place of the core, a real ROUTER on loopback, a real unix listener, and fake embedded
workers."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from carpool.broker.core import Outgoing, ToWorker
from carpool.broker.joining import JoinWindow
from carpool.broker.transports import Upstream, WorkerTransport
from carpool.broker.transports.inprocess import InProcessWorkers
from carpool.broker.transports.local import LinkWorkers
from carpool.broker.transports.zeromq import ZmqWorkers, bind_router
from carpool.common.errors import ConfigError
from carpool.common.link import Link, LinkListener
from carpool.common.protocol import (
    BrokerDisconnect,
    Command,
    FromBroker,
    FromWorker,
    ResultMeta,
    ToBroker,
    WorkerHeartbeat,
    WorkerResult,
    encode,
)


@dataclass
class Recorder:
    """What a transport reported: each message (id, typed message), each send of the
    core's answer, each unreachable worker. ``answer`` makes the core's answer."""

    now_s: float = 0.0
    received: list[tuple[bytes, FromWorker]] = field(default_factory=list)
    sent: list[list[Outgoing]] = field(default_factory=list)
    lost: list[bytes] = field(default_factory=list)
    known: set[bytes] = field(default_factory=set)
    answer: Callable[[bytes, FromWorker], list[Outgoing]] = lambda wid, msg: []
    routes: dict[bytes, WorkerTransport] = field(default_factory=dict)
    later: list[Callable[[], None]] = field(default_factory=list)

    def upstream(self) -> Upstream:
        return Upstream(
            now=lambda: self.now_s,
            on_worker=self.on_worker,
            send=self.sent.append,
            knows=lambda wid: wid in self.known,
            unreachable=self.lost.append,
            routes=self.routes,
            later=self.later,
        )

    def on_worker(self, now: float, wid: bytes, msg: FromWorker) -> list[Outgoing]:
        self.received.append((wid, msg))
        return self.answer(wid, msg)


def beat(rho: float) -> list[bytes]:
    """A HEARTBEAT whose load tells messages apart."""
    return encode(Command.HEARTBEAT, {"rho": rho})


@dataclass
class Raw:
    """A message for a worker, given as the frames a socket transport sends; a worker in
    the broker's process gets a DISCONNECT whose reason is the first frame (a label)."""

    frames: list[Any]

    def to_frames(self) -> list[Any]:
        return self.frames

    def to_message(self) -> FromBroker:
        return BrokerDisconnect(bytes(self.frames[0]).decode())


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _poll(poller: zmq.Poller, timeout_ms: int = 2000) -> dict[Any, int]:
    return dict(poller.poll(timeout_ms))


# ---------------------------------------------------------------- ZeroMQ


def test_a_router_that_cannot_bind_says_so(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(ConfigError, match="cannot bind"):
        bind_router(zctx, "tcp://nowhere:*")


def test_zeromq_messages_reach_the_core_and_answers_reach_the_peer(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    rec = Recorder(answer=lambda wid, msg: [ToWorker(wid, Raw([b"ok"]))])
    poller = zmq.Poller()
    workers = ZmqWorkers(bind_router(zctx, "tcp://127.0.0.1:*"), poller, rec.upstream())
    peer = zctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.ROUTING_ID, b"w1")
    peer.connect(workers.endpoint)
    peer.send_multipart(beat(0.5))
    assert workers.on_poll(_poll(poller)) == 1
    assert rec.received == [(b"w1", WorkerHeartbeat(0.5))]
    (answer,) = rec.sent
    (to_worker,) = answer
    assert isinstance(to_worker, ToWorker)
    workers.send(to_worker.identity, to_worker.message)
    assert peer.poll(2000)
    assert peer.recv_multipart() == [b"ok"]
    assert workers.on_poll({}) == 0
    peer.close(0)
    workers.close(0)


def test_a_zeromq_peer_with_a_reserved_id_is_not_heard_nor_sent_to(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    rec = Recorder()
    poller = zmq.Poller()
    router = bind_router(zctx, "tcp://127.0.0.1:*")
    workers = ZmqWorkers(router, poller, rec.upstream(), reserved=(b"\x00link-",))
    spoof = zctx.socket(zmq.DEALER)
    spoof.setsockopt(zmq.ROUTING_ID, b"\x00link-1")
    spoof.connect(workers.endpoint)
    spoof.send_multipart(beat(0.5))
    assert workers.on_poll(_poll(poller)) == 1
    assert rec.received == []
    workers.send(b"\x00link-1", Raw([b"for the local worker"]))
    assert spoof.poll(200) == 0
    assert rec.lost == []
    spoof.close(0)
    workers.close(0)


def test_a_send_to_a_zeromq_peer_that_is_gone_reports_it(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    rec = Recorder()
    workers = ZmqWorkers(bind_router(zctx, "tcp://127.0.0.1:*"), zmq.Poller(), rec.upstream())
    workers.send(b"\x00nobody", Raw([b"x"]))
    assert rec.lost == [b"\x00nobody"]
    workers.close(0)


# ---------------------------------------------------------------- unix links


@pytest.fixture
def links(tmp_path: Path) -> Iterator[tuple[LinkWorkers, Recorder, zmq.Poller, str]]:
    rec = Recorder()
    poller = zmq.Poller()
    path = str(tmp_path / "w.sock")
    workers = LinkWorkers(LinkListener(path), poller, rec.upstream(), JoinWindow(within_s=5.0))
    yield workers, rec, poller, path
    workers.close(0)


def _turn(workers: LinkWorkers, poller: zmq.Poller, timeout_ms: int = 200) -> int:
    workers.before_poll()
    return workers.on_poll(dict(poller.poll(timeout_ms)))


def test_a_link_is_a_worker_with_an_id_of_its_own(
    links: tuple[LinkWorkers, Recorder, zmq.Poller, str],
) -> None:
    workers, rec, poller, path = links
    with contextlib.closing(Link.connect(path)) as peer:
        _turn(workers, poller)
        (wid,) = workers.peers
        assert wid.startswith(workers.id_prefix)
        assert rec.routes == {wid: workers}
        peer.send(beat(0.25))
        for _ in range(10):
            if _turn(workers, poller):
                break
        assert rec.received == [(wid, WorkerHeartbeat(0.25))]
        workers.send(wid, Raw([b"answer", memoryview(b"payload")]))
        got: list[list[memoryview]] = []
        for _ in range(50):
            got += peer.receive()
            if got:
                break
            poller_peer = zmq.Poller()
            poller_peer.register(peer.fileno(), zmq.POLLIN)
            poller_peer.poll(100)
        assert [[bytes(f) for f in m] for m in got] == [[b"answer", b"payload"]]


def test_a_link_that_closes_is_a_lost_worker(
    links: tuple[LinkWorkers, Recorder, zmq.Poller, str],
) -> None:
    workers, rec, poller, path = links
    peer = Link.connect(path)
    _turn(workers, poller)
    (wid,) = workers.peers
    peer.send(beat(0.75))
    peer.close()
    for _ in range(10):
        _turn(workers, poller)
        if rec.lost:
            break
    assert rec.received == [(wid, WorkerHeartbeat(0.75))]  # what it sent comes first
    assert rec.lost == [wid]
    assert workers.peers == []
    assert rec.routes == {}


def test_a_link_that_does_not_register_within_its_window_is_closed(
    links: tuple[LinkWorkers, Recorder, zmq.Poller, str],
) -> None:
    workers, rec, poller, path = links
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(path)
    rec.now_s = 100.0
    _turn(workers, poller)
    (wid,) = workers.peers
    assert workers.next_wakeup(100.0) == 105.0
    workers.after_turn(104.9)
    assert workers.peers == [wid]
    workers.after_turn(105.0)
    assert workers.peers == []
    assert rec.lost == [wid]
    assert workers.next_wakeup(105.0) is None
    raw.close()


def test_a_registered_link_lasts_until_the_core_forgets_its_worker(
    links: tuple[LinkWorkers, Recorder, zmq.Poller, str],
) -> None:
    workers, rec, poller, path = links
    with contextlib.closing(Link.connect(path)) as peer:
        _turn(workers, poller)
        (wid,) = workers.peers
        rec.known.add(wid)  # the core registers it on its first message
        peer.send(beat(0.0))
        for _ in range(10):
            if _turn(workers, poller):
                break
        assert workers.next_wakeup(0.0) is None
        workers.after_turn(1000.0)
        assert workers.peers == [wid]
        rec.known.clear()
        workers.after_turn(1000.0)
        assert workers.peers == []
        assert rec.lost == [wid]


def test_a_send_to_a_link_that_is_gone_is_skipped(
    links: tuple[LinkWorkers, Recorder, zmq.Poller, str],
) -> None:
    workers, rec, _poller, _path = links
    workers.send(b"\x00link-9", Raw([b"x"]))
    assert rec.lost == []


# ---------------------------------------------------------------- in process


def results(rec: Recorder) -> list[tuple[bytes, WorkerResult]]:
    return [(wid, m) for wid, m in rec.received if isinstance(m, WorkerResult)]


class FakeEmbedded:
    """An embedded worker: a first message in its outbox (a heartbeat standing in for
    READY); each delivery (a :class:`Raw`'s DISCONNECT, its label the reason) is answered
    at once with a RESULT whose one reply frame is the label, as the typed message an
    embedded worker passes."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.r, self.w = socket.socketpair()
        self.delivered: list[str] = []
        self.outbox: list[ToBroker] = [WorkerHeartbeat(0.1 if name == b"e0" else 0.2)]
        self.due: float | None = None

    @property
    def results_fd(self) -> int:
        return self.r.fileno()

    def deliver(self, message: FromBroker) -> list[ToBroker]:
        assert isinstance(message, BrokerDisconnect)
        self.delivered.append(message.reason)
        batch_id = len(self.delivered)
        return [WorkerResult(ResultMeta(batch_id, 0.0, 1.0, (1,)), [message.reason.encode()])]

    def service(self, results_ready: bool) -> list[ToBroker]:
        if results_ready:
            self.r.recv(64)
            return [WorkerHeartbeat(0.9)]
        return []

    def take_outbox(self) -> list[ToBroker]:
        out, self.outbox = self.outbox, []
        return out

    def next_wakeup(self, now: float) -> float | None:
        return self.due

    def close(self) -> None:
        self.r.close()
        self.w.close()


def test_embedded_workers_say_ready_and_take_deliveries_after_the_sends() -> None:
    e0, e1 = FakeEmbedded(b"e0"), FakeEmbedded(b"e1")
    rec = Recorder()
    poller = zmq.Poller()
    workers = InProcessWorkers([e0, e1], poller, rec.upstream())
    ids = list(workers.workers)
    assert all(wid.startswith(workers.id_prefix) for wid in ids)
    assert set(rec.routes) == set(ids)
    workers.start()
    assert rec.received == [(ids[0], WorkerHeartbeat(0.1)), (ids[1], WorkerHeartbeat(0.2))]
    rec.received.clear()
    workers.send(ids[1], Raw([b"B1"]))
    workers.send(ids[0], Raw([b"B0"]))
    assert e0.delivered == e1.delivered == []  # not before the server runs `later`
    (deliver,) = rec.later
    deliver()
    assert e1.delivered == ["B1"]
    assert e0.delivered == ["B0"]
    assert [(wid, m.result.batch_id, list(m.replies)) for wid, m in results(rec)] == [
        (ids[1], 1, [b"B1"]),
        (ids[0], 1, [b"B0"]),
    ]
    e1.due = 7.0
    assert workers.next_wakeup(0.0) == 7.0
    e1.w.send(b"!")
    events = dict(poller.poll(2000))
    workers.on_poll(events)
    assert rec.received[-1] == (ids[1], WorkerHeartbeat(0.9))
    e0.close()
    e1.close()


def test_answers_of_an_embedded_worker_queue_behind_the_delivery() -> None:
    """A delivery whose answer makes the core send that worker more: the second message
    is delivered after the first, in the same run, without recursing."""
    e0 = FakeEmbedded(b"e0")
    rec = Recorder()

    def send(out: list[Outgoing]) -> None:  # the server's: to the transport it routes to
        rec.sent.append(out)
        for msg in out:
            assert isinstance(msg, ToWorker)
            workers.send(msg.identity, msg.message)

    up = rec.upstream()
    up.send = send
    workers = InProcessWorkers([e0], zmq.Poller(), up)
    (wid,) = workers.workers

    rec.answer = lambda w, msg: (
        [ToWorker(w, Raw([b"again"]))]
        if isinstance(msg, WorkerResult) and list(msg.replies) == [b"first"]
        else []
    )
    workers.send(wid, Raw([b"first"]))
    (deliver,) = rec.later
    rec.later.clear()
    deliver()
    assert e0.delivered == ["first", "again"]
    assert rec.later == []
    e0.close()
