"""Both clients send a request again after a lost connection, or an UNAVAILABLE with
retry (on a new connection: tests/integration/test_client_leaves_a_stopping_broker.py has
the rest of that rule), and cancel one, against a ROUTER that stands in for the broker
and answers by hand (protocol §6.1, §6.3, §6.5, §11)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from carpool.client import AsyncClient, Cancelled, Client, Unavailable
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


class Stand:
    """A ROUTER on ``endpoint`` that receives requests and answers them by hand; it can
    go away (close: the client's connection is lost) and come back on the same
    endpoint."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.context, self.endpoint = context, endpoint
        self.router = self._bind()

    def _bind(self) -> zmq.Socket[bytes]:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.endpoint)
        return router

    def away(self) -> None:
        self.router.close(linger=0)

    def back(self) -> None:
        self.router = self._bind()

    def recv(self, pump: Callable[[], object], timeout_s: float = SOON_S) -> list[bytes]:
        """The next message (routing id first), pumping the client meanwhile."""
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            pump()
            if self.router.poll(10):
                return self.router.recv_multipart()
        raise AssertionError("nothing came")

    def quiet(self, pump: Callable[[], object], for_s: float) -> None:
        """Nothing comes for ``for_s`` while the client is polled."""
        until = time.monotonic() + for_s
        while time.monotonic() < until:
            pump()
            assert not self.router.poll(10), "a message came"

    def reply(self, msg: list[bytes], output: np.ndarray) -> None:
        self.router.send_multipart(reply_to(msg, output))

    def error(self, msg: list[bytes], code: ErrorCode, *, retry: bool = False) -> None:
        self.router.send_multipart(error_to(msg, code, retry=retry))


def reply_to(msg: list[bytes], output: np.ndarray) -> list[Any]:
    """A ROUTER's REPLY to request ``msg`` (routing id first)."""
    meta = ReplyMeta(meta_of(msg)["id"], (TensorMeta("y", "float32", output.shape),))
    return [msg[0], *encode_reply(meta, [output.tobytes()], simple=False)]


def error_to(msg: list[bytes], code: ErrorCode, *, retry: bool = False) -> list[Any]:
    error = ErrorReply(meta_of(msg)["id"], code, "the broker is stopping; retry", retry=retry)
    return [msg[0], *encode_error(error)]


@pytest.fixture
def stand(nobody: str) -> Iterator[Stand]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = Stand(context, nobody)
    yield s
    s.router.close(linger=0)
    context.term()


def lost(client: Client, count: int = 1) -> None:
    """Pump the client until it has seen ``count`` connections close."""
    until = time.monotonic() + SOON_S
    while client.core.lost_connections < count:
        assert time.monotonic() < until, "the client never saw the connection close"
        client.poll(0.01)


def meta_of(msg: list[bytes]) -> dict[str, Any]:
    return decode_meta(msg[2])


def rid_of(future: object) -> int:
    rid = getattr(future, "request_id", None)
    assert isinstance(rid, int)
    return rid


def test_a_request_is_sent_again_when_the_broker_comes_back(stand: Stand) -> None:
    with Client(stand.endpoint, grace_s=0.5) as client:
        pump = lambda: client.poll(0)  # noqa: E731
        x = X.copy()
        future = client.submit("m", {"x": x}, timeout_s=5.0)
        first = stand.recv(pump)
        x[:] = -1  # the caller refills its buffer
        stand.away()
        lost(client)
        assert not future.done()  # kept: its budget allows
        stand.back()
        again = stand.recv(pump)
        assert parse_header(again[1]) is Command.REQUEST
        assert meta_of(again)["id"] == meta_of(first)["id"] == future.request_id
        assert meta_of(again)["client"] == meta_of(first)["client"] == client.core.resend.nonce
        assert 0 < meta_of(again)["timeout_ms"] < 5000  # what remains of its budget
        assert again[3] == X.tobytes()  # the request as made, not the refilled buffer
        stand.reply(again, X * 2)
        np.testing.assert_array_equal(future.result(SOON_S)["y"], X * 2)
        stand.quiet(pump, 0.2)  # sent again once
        assert client.core.resends == 1
        assert client.core.late_replies == 0


def test_with_too_little_budget_left_a_request_fails_at_once(stand: Stand) -> None:
    """The rule that replaced "every pending request fails when the connection closes":
    a request whose remaining budget does not exceed its model's observed latency."""
    with Client(stand.endpoint, grace_s=2.0) as client:
        pump = lambda: client.poll(0)  # noqa: E731
        future = client.submit("m", {"x": X}, timeout_s=5.0)
        msg = stand.recv(pump)
        stand.quiet(pump, 0.3)  # the answer takes 0.3 s: the latency seen for "m"
        stand.reply(msg, X)
        future.result(SOON_S)
        short = client.submit("m", {"x": X}, timeout_s=0.25)
        kept = client.submit("m", {"x": X}, timeout_s=5.0)
        stand.recv(pump)
        stand.recv(pump)
        stand.away()
        lost(client)
        assert short.done()  # at once, not at its timeout plus grace
        with pytest.raises(Unavailable, match="connection to the broker closed"):
            short.result(0)
        assert not kept.done()


def test_unavailable_with_retry_is_sent_again_at_once_on_a_new_connection(stand: Stand) -> None:
    with Client(stand.endpoint) as client:
        pump = lambda: client.poll(0)  # noqa: E731
        future = client.submit("m", {"x": X}, timeout_s=5.0)
        first = stand.recv(pump)
        stand.error(first, ErrorCode.UNAVAILABLE, retry=True)
        again = stand.recv(pump)
        assert again[0] != first[0]  # not on the connection of the broker that refused it
        assert not future.done()
        assert meta_of(again)["id"] == future.request_id
        assert meta_of(again)["client"] == meta_of(first)["client"]
        stand.reply(again, X)
        np.testing.assert_array_equal(future.result(SOON_S)["y"], X)
        assert client.core.lost_connections == 0


def test_cancel_sends_cancel_and_cancelled_resolves_the_future(stand: Stand) -> None:
    with Client(stand.endpoint) as client:
        pump = lambda: client.poll(0)  # noqa: E731
        future = client.submit("m", {"x": X}, timeout_s=5.0)
        msg = stand.recv(pump)
        assert future.cancel()
        cancel = stand.recv(pump)
        assert parse_header(cancel[1]) is Command.CANCEL
        assert meta_of(cancel) == {"id": future.request_id, "client": client.core.resend.nonce}
        stand.error(msg, ErrorCode.CANCELLED)
        with pytest.raises(Cancelled):
            future.result(SOON_S)
        assert not future.cancel()  # answered


def test_a_cancelled_request_that_already_ran_gets_its_result(stand: Stand) -> None:
    with Client(stand.endpoint) as client:
        pump = lambda: client.poll(0)  # noqa: E731
        future = client.submit("m", {"x": X}, timeout_s=5.0)
        msg = stand.recv(pump)
        assert client.cancel(future)
        stand.recv(pump)  # the CANCEL, for a request already at a worker
        stand.reply(msg, X)
        np.testing.assert_array_equal(future.result(SOON_S)["y"], X)


def test_the_async_client_sends_again_after_a_lost_connection_and_cancels(nobody: str) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.bind(nobody)
        try:
            async with AsyncClient(nobody, grace_s=0.5) as client:
                x = X.copy()
                future = await client.submit("m", {"x": x}, timeout_s=5.0)
                first = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                x[:] = -1
                router.close(linger=0)
                until = asyncio.get_running_loop().time() + SOON_S
                while client.core.lost_connections == 0:
                    assert asyncio.get_running_loop().time() < until
                    await asyncio.sleep(0.01)
                assert not future.done()
                router = context.socket(zmq.ROUTER)
                router.bind(nobody)
                again = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                assert meta_of(again)["id"] == meta_of(first)["id"] == rid_of(future)
                assert meta_of(again)["client"] == meta_of(first)["client"]
                assert again[3] == X.tobytes()
                await router.send_multipart(reply_to(again, X))
                result = await asyncio.wait_for(future, SOON_S)
                np.testing.assert_array_equal(result["y"], X)
                assert client.core.resends == 1

                # AsyncClient.cancel: CANCEL, and the broker's CANCELLED is the answer.
                future = await client.submit("m", {"x": X}, timeout_s=5.0)
                msg = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                assert client.cancel(future)
                cancel = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                assert parse_header(cancel[1]) is Command.CANCEL
                assert meta_of(cancel)["id"] == meta_of(msg)["id"]
                await router.send_multipart(error_to(msg, ErrorCode.CANCELLED))
                with pytest.raises(Cancelled):
                    await asyncio.wait_for(future, SOON_S)

                # Cancelling the asyncio future itself: CANCEL too, the answer dropped.
                future = await client.submit("m", {"x": X}, timeout_s=5.0)
                msg = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(future, 0.05)  # gives up: cancels it
                cancel = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                assert parse_header(cancel[1]) is Command.CANCEL
                assert meta_of(cancel)["id"] == meta_of(msg)["id"]
                await router.send_multipart(reply_to(msg, X))
                while client.in_flight:
                    assert asyncio.get_running_loop().time() < until + SOON_S
                    await asyncio.sleep(0.01)
                assert client.core.late_replies == 0  # awaited, and dropped
        finally:
            router.close(linger=0)
            context.term()

    asyncio.run(main())


def test_the_async_client_hears_each_socket_it_opens_afresh(nobody: str) -> None:
    """After each lost connection the reader polls a fresh socket and monitor, which may
    take the descriptor numbers of sockets closed before: it must be woken by them. (A
    registration of a closed monitor's descriptor, left with the event loop, once kept
    the reader deaf to a socket that took that number until its 1 s cap, past the budget
    of the request waiting to be sent again, which then failed "connection closed": on
    the fourth reopen here.)"""

    async def bound(context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        until = asyncio.get_running_loop().time() + SOON_S
        while True:  # (a ROUTER just closed lets go of the port in libzmq's I/O thread)
            router = context.socket(zmq.ROUTER)
            try:
                router.bind(nobody)
                return router
            except zmq.ZMQError:
                router.close(linger=0)
                assert asyncio.get_running_loop().time() < until
                await asyncio.sleep(0.01)

    async def main() -> None:
        context = zmq.asyncio.Context()
        router = await bound(context)
        loop = asyncio.get_running_loop()
        try:
            async with AsyncClient(nobody, grace_s=0.5) as client:
                for lost in range(1, 7):
                    future = await client.submit("m", {"x": X}, timeout_s=0.9)
                    first = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                    router.close(linger=0)
                    until = loop.time() + SOON_S
                    while client.core.lost_connections < lost:
                        assert loop.time() < until
                        await asyncio.sleep(0.01)
                    router = await bound(context)
                    again = await asyncio.wait_for(router.recv_multipart(), SOON_S)
                    assert meta_of(again)["id"] == meta_of(first)["id"]
                    await router.send_multipart(reply_to(again, X))
                    result = await asyncio.wait_for(future, SOON_S)
                    np.testing.assert_array_equal(result["y"], X)
        finally:
            router.close(linger=0)
            context.term()

    asyncio.run(main())


def test_a_cancel_from_another_thread_reaches_the_broker_while_one_waits(stand: Stand) -> None:
    """While one thread waits in result(), cancel() from another hands the CANCEL to the
    client's I/O thread, which sends it; the waiting thread gets the broker's answer."""
    with Client(stand.endpoint) as client:
        future = client.submit("m", {"x": X}, timeout_s=5.0)
        msg = stand.recv(lambda: None)
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                future.result(SOON_S)
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        try:
            assert future.cancel()
            cancel = stand.recv(lambda: None)
            assert parse_header(cancel[1]) is Command.CANCEL
            stand.error(msg, ErrorCode.CANCELLED)
        finally:
            waiter.join(SOON_S + 1)
        assert len(outcome) == 1
        assert isinstance(outcome[0], Cancelled)
