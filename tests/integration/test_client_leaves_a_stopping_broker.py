"""Both clients leave a connection on the first UNAVAILABLE with retry (protocol §11): they
send nothing more on it, send the refused request again on a new connection at once, and
keep reading the old one until every request sent on it is answered, or it closes.

The broker is a ROUTER answered by hand, with a ZAP handler in its context that admits new
connections, or, while the broker is "stopping", holds them at the handshake ("300", as
a stopping broker's door does: docs/security.md) until the ROUTER closes, when they
connect to the one bound next; each message is recorded with the routing id of the
connection it came by (a new connection: a new routing id). The blocking client runs its
own I/O thread (the test's pump only polls it); the asyncio one runs on an event loop in
a thread of its own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import pytest
import zmq

from carpool.client import AsyncClient, Client, InferResult, Unavailable
from carpool.client.calls import ReplyFuture
from carpool.client.core import ClientCore
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Command,
    ErrorReply,
    ReplyMeta,
    TensorMeta,
    decode_meta,
    encode_error,
    encode_reply,
    parse_header,
)

pytestmark = pytest.mark.timeout(30)

X = np.arange(4, dtype=np.float32).reshape(1, 4)
#: How long a test waits for something that should happen at once (bounded, never slept).
SOON_S = 10.0
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class Broker:
    """A ROUTER on ``endpoint`` answered by hand, behind a ZAP handler that admits new
    connections while :attr:`admitting` (else holds them at the handshake, as a stopping
    broker does)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.zap = self.context.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.admitting = True
        self.handshakes: Counter[str] = Counter()  # "admitted", "held"
        self.seen: list[tuple[bytes, Command, int]] = []  # (routing id, command, id)
        router = self._bind()
        assert router is not None
        self.router = router
        self._listening = True

    def _bind(self) -> zmq.Socket[bytes] | None:
        """A ROUTER bound to the endpoint; None while the port is still held (a ROUTER
        closed a moment ago lets go of it in libzmq's I/O thread)."""
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ZAP_DOMAIN, b"carpool-test")  # (NULL security asks ZAP then)
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            if exc.errno != zmq.EADDRINUSE:
                raise
            return None
        return router

    def restart(self) -> None:
        """Close (every connection to it is lost) and listen again on the same endpoint,
        admitting, as soon as the port is free (the next turn): the broker started next.
        The connections held at the handshake drop, and connect again to it."""
        self.router.close(linger=0)
        self.admitting = True
        self._listening = False

    def close(self) -> None:
        self.zap.close(linger=0)
        self.context.destroy(linger=0)

    def _turn(self, wait_ms: int) -> list[bytes] | None:
        """Answer the handshakes waiting, then the next message within ``wait_ms``."""
        if not self._listening:
            router = self._bind()
            if router is None:
                self.zap.poll(wait_ms)  # (the wait, on the handshakes)
                return None
            self.router, self._listening = router, True
        while self.zap.poll(0):
            request = self.zap.recv_multipart()  # version, request id, domain, ...
            verdict = "admitted" if self.admitting else "held"
            self.handshakes[verdict] += 1
            status = b"200" if self.admitting else b"300"  # (300: try later)
            self.zap.send_multipart([request[0], request[1], status, verdict.encode(), b"", b""])
        if not self.router.poll(wait_ms):
            return None
        msg = self.router.recv_multipart()
        self.seen.append((msg[0], parse_header(msg[1]), decode_meta(msg[2])["id"]))
        return msg

    def recv(self, pump: Callable[[], object], timeout_s: float = SOON_S) -> list[bytes]:
        """The next message (routing id first), pumping the client meanwhile."""
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            pump()
            msg = self._turn(10)
            if msg is not None:
                return msg
        raise AssertionError("nothing came")

    def until(self, what: str, done: Callable[[], bool], pump: Callable[[], object]) -> None:
        """Pump the client and answer handshakes until ``done()``; no message may come."""
        until = time.monotonic() + SOON_S
        while not done():
            assert time.monotonic() < until, f"never: {what}"
            pump()
            assert self._turn(10) is None, "a message came"

    def quiet(self, pump: Callable[[], object], for_s: float) -> None:
        """Nothing comes for ``for_s`` while the client is polled."""
        until = time.monotonic() + for_s
        while time.monotonic() < until:
            pump()
            assert self._turn(10) is None, "a message came"

    def reply(self, msg: list[bytes], output: np.ndarray) -> None:
        meta = ReplyMeta(decode_meta(msg[2])["id"], (TensorMeta("y", "float32", output.shape),))
        self.router.send_multipart([msg[0], *encode_reply(meta, [output.tobytes()], simple=False)])

    def refuse(self, msg: list[bytes]) -> None:
        """UNAVAILABLE with retry, as a broker told to stop answers a REQUEST."""
        error = ErrorReply(
            decode_meta(msg[2])["id"],
            ErrorCode.UNAVAILABLE,
            "the broker is stopping; retry",
            retry_after_ms=2000,
            retry=True,
        )
        self.router.send_multipart([msg[0], *encode_error(error)])


class Twin(Protocol):
    """What these tests do with either client."""

    core: ClientCore
    settled: Counter[int]  # times each future resolved, by request id

    def submit(self, x: np.ndarray, timeout_s: float = 5.0) -> Any: ...
    def result(self, future: Any) -> InferResult: ...
    def cancel(self, future: Any) -> bool: ...
    def pump(self) -> None: ...
    def close(self) -> None: ...


class Blocking:
    def __init__(self, endpoint: str, settled: Counter[int]) -> None:
        self.client = Client(endpoint, grace_s=0.5)
        self.core, self.settled = self.client.core, settled

    def submit(self, x: np.ndarray, timeout_s: float = 5.0) -> ReplyFuture:
        return self.client.submit("m", {"x": x}, timeout_s=timeout_s)

    def result(self, future: ReplyFuture) -> InferResult:
        return future.result(SOON_S)

    def cancel(self, future: ReplyFuture) -> bool:
        return self.client.cancel(future)

    def pump(self) -> None:
        self.client.poll(0)

    def close(self) -> None:
        self.client.close()


class OnLoop:
    """An AsyncClient on an event loop in a thread of its own; each call runs there."""

    def __init__(self, endpoint: str, settled: Counter[int]) -> None:
        self.settled = settled
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = self._run(self._open(endpoint))
        self.core = self.client.core

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(SOON_S + 1)

    @staticmethod
    async def _open(endpoint: str) -> AsyncClient:
        return AsyncClient(endpoint, grace_s=0.5)

    async def _submit(self, x: np.ndarray, timeout_s: float) -> asyncio.Future[InferResult]:
        future = await self.client.submit("m", {"x": x}, timeout_s=timeout_s)
        rid = rid_of(future)
        future.add_done_callback(lambda _: self.settled.update([rid]))
        return future

    def submit(self, x: np.ndarray, timeout_s: float = 5.0) -> asyncio.Future[InferResult]:
        return self._run(self._submit(x, timeout_s))

    def result(self, future: asyncio.Future[InferResult]) -> InferResult:
        async def wait() -> InferResult:
            return await asyncio.wait_for(asyncio.shield(future), SOON_S)

        return self._run(wait())

    def cancel(self, future: asyncio.Future[InferResult]) -> bool:
        async def cancel() -> bool:
            return self.client.cancel(future)

        return self._run(cancel())

    def pump(self) -> None:
        pass  # (its reader runs on its loop)

    def close(self) -> None:
        try:
            self._run(self.client.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(SOON_S)
            self.loop.close()


@pytest.fixture
def broker(nobody: str) -> Iterator[Broker]:
    b = Broker(nobody)
    yield b
    b.close()


@pytest.fixture(params=["Client", "AsyncClient"])
def twin(
    request: pytest.FixtureRequest, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Twin]:
    settled: Counter[int] = Counter()
    if request.param == "Client":
        resolve = ReplyFuture._set

        def counting(self: ReplyFuture, outcome: Any) -> None:
            settled[self.request_id] += 1
            resolve(self, outcome)

        monkeypatch.setattr(ReplyFuture, "_set", counting)
        t: Twin = Blocking(broker.endpoint, settled)
    else:
        t = OnLoop(broker.endpoint, settled)
    yield t
    t.close()


def meta_of(msg: list[bytes]) -> dict[str, Any]:
    return decode_meta(msg[2])


def rid_of(future: object) -> int:
    rid = getattr(future, "request_id", None)
    assert isinstance(rid, int)
    return rid


def test_the_first_refusal_moves_the_client_to_a_new_connection_and_the_old_one_still_answers(
    broker: Broker, twin: Twin
) -> None:
    pump = twin.pump
    a, b = twin.submit(X * 1), twin.submit(X * 2)
    first_a, first_b = broker.recv(pump), broker.recv(pump)
    old = first_a[0]
    assert first_b[0] == old
    broker.admitting = False  # stopping: new connections are held at the handshake
    broker.refuse(first_a)
    # At once, a new socket, held at the handshake; nothing more on the old connection.
    broker.until("a new connection", lambda: broker.handshakes["held"] == 1, pump)
    assert twin.core.switches == 1
    # The old connection still delivers what its broker ran within its grace...
    broker.reply(first_b, X * 20)
    np.testing.assert_array_equal(twin.result(b)["y"], X * 20)
    assert not twin.core.retiring  # ...and, with nothing more to wait for there, closes
    broker.quiet(pump, 0.1)  # (a waits in the client for a connection that is up)
    broker.restart()  # the stopping broker closes; the next one listens
    again = broker.recv(pump)
    assert again[0] != old  # a new connection
    assert (parse_header(again[1]), meta_of(again)["id"]) == (Command.REQUEST, rid_of(a))
    assert meta_of(again)["client"] == meta_of(first_a)["client"] == twin.core.resend.nonce
    assert 0 < meta_of(again)["timeout_ms"] < 5000  # what remains of its budget
    assert again[3] == first_a[3]
    # New requests go on the new connection.
    c = twin.submit(X * 3)
    msg_c = broker.recv(pump)
    assert (msg_c[0], meta_of(msg_c)["id"]) == (again[0], rid_of(c))
    broker.reply(again, X * 10)
    broker.reply(msg_c, X * 30)
    np.testing.assert_array_equal(twin.result(a)["y"], X * 10)
    np.testing.assert_array_equal(twin.result(c)["y"], X * 30)
    broker.quiet(pump, 0.2)
    after_refusal = broker.seen[2:]
    assert [rid for _, _, rid in after_refusal] == [rid_of(a), rid_of(c)]
    assert all(routing_id != old for routing_id, _, _ in after_refusal)
    assert twin.settled == {rid_of(a): 1, rid_of(b): 1, rid_of(c): 1}
    assert (twin.core.resends, twin.core.lost_connections, twin.core.late_replies) == (1, 0, 0)


def test_a_request_still_on_the_old_connection_when_it_closes_is_sent_again_on_the_new_one(
    broker: Broker, twin: Twin
) -> None:
    pump = twin.pump
    a, b = twin.submit(X * 1), twin.submit(X * 2)
    first_a, first_b = broker.recv(pump), broker.recv(pump)
    broker.admitting = False
    broker.refuse(first_a)
    broker.until("a new connection", lambda: broker.handshakes["held"] == 1, pump)
    assert twin.core.retiring  # b waits there
    broker.restart()  # the old connection closes with b still on it; the next broker
    got = {meta_of(msg)["id"]: msg for msg in (broker.recv(pump), broker.recv(pump))}
    assert set(got) == {rid_of(a), rid_of(b)}
    assert got[rid_of(a)][0] == got[rid_of(b)][0] != first_b[0]  # one new connection
    assert got[rid_of(b)][3] == first_b[3]
    for msg in got.values():
        broker.reply(msg, X)
    for future in (a, b):
        np.testing.assert_array_equal(twin.result(future)["y"], X)
    broker.quiet(pump, 0.2)
    assert twin.settled == {rid_of(a): 1, rid_of(b): 1}
    assert (twin.core.resends, twin.core.lost_connections, twin.core.late_replies) == (2, 1, 0)


def test_a_cancel_of_a_request_on_the_old_connection_sends_nothing_and_keeps_its_answer(
    broker: Broker, twin: Twin
) -> None:
    pump = twin.pump
    a, b = twin.submit(X * 1), twin.submit(X * 2)
    first_a, first_b = broker.recv(pump), broker.recv(pump)
    broker.refuse(first_a)
    again = broker.recv(pump)  # (this broker admits the new connection)
    assert again[0] != first_a[0]
    assert twin.cancel(b)  # b is on the old connection, which gets nothing more
    broker.quiet(pump, 0.2)  # no CANCEL, on either connection
    assert twin.core.resend.cancels == 0
    broker.reply(first_b, X * 2)  # the stopping broker had run it
    np.testing.assert_array_equal(twin.result(b)["y"], X * 2)
    broker.reply(again, X)
    np.testing.assert_array_equal(twin.result(a)["y"], X)
    assert twin.settled == {rid_of(a): 1, rid_of(b): 1}


def test_a_broker_that_admits_the_new_connection_and_refuses_again_is_not_left_again(
    broker: Broker, twin: Twin
) -> None:
    """A broker that admits new connections while it stops (as brokers did before they
    refused them) answers the new one as it did the old: the client waits for that
    connection to close rather than open a socket and send again each round trip."""
    pump = twin.pump
    a = twin.submit(X)
    first = broker.recv(pump)
    broker.refuse(first)
    again = broker.recv(pump)
    assert again[0] != first[0]
    broker.refuse(again)
    broker.quiet(pump, 0.3)
    assert broker.handshakes == {"admitted": 2}  # no third connection
    assert twin.core.switches == 1
    assert twin.core.resend.kept[rid_of(a)].stage.name == "PARKED"
    broker.restart()  # it closes; the next one
    last = broker.recv(pump)
    assert last[0] not in (first[0], again[0])
    assert meta_of(last)["id"] == rid_of(a)
    broker.reply(last, X)
    np.testing.assert_array_equal(twin.result(a)["y"], X)
    assert twin.settled == {rid_of(a): 1}


def test_unavailable_with_retry_fails_with_the_brokers_answer_when_no_connection_follows(
    broker: Broker, twin: Twin
) -> None:
    pump = twin.pump
    future = twin.submit(X, timeout_s=0.4)
    msg = broker.recv(pump)
    broker.admitting = False  # nothing admits the new connection
    broker.refuse(msg)
    with pytest.raises(Unavailable, match="stopping"):
        twin.result(future)  # when its budget ran out, not at its local deadline
    assert twin.settled == {rid_of(future): 1}
