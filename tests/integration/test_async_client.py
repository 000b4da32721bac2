"""The asyncio client: same results and typed errors as the blocking one."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from carpool.client import AsyncClient, NotFound, Unavailable
from carpool.common.errors import CarpoolError
from carpool.common.protocol import Command, decode_meta, encode
from carpool.worker.engines.synthetic import SyntheticEngine


@pytest.mark.timeout(30)
def test_async_client_many_in_flight(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.002)
    fleet.add_worker({"m": lambda: SyntheticEngine(item_shape=(3,), max_batch=8)})
    fleet.ready()
    endpoint = fleet.broker.frontend_endpoint

    async def main() -> None:
        async with AsyncClient(endpoint) as client:
            futures = [
                await client.submit("m", {"x": np.full((1, 3), i, np.float32)}) for i in range(200)
            ]
            results = await asyncio.gather(*futures)
            for i, result in enumerate(results):
                np.testing.assert_array_equal(result["y"], np.full((1, 3), 2 * i + 1))
            single = await client.infer("m", {"x": np.ones((2, 3), np.float32)})
            np.testing.assert_array_equal(single["y"], np.full((2, 3), 3.0))
            with pytest.raises(NotFound):
                await client.infer("missing", {"x": np.ones((1, 3), np.float32)})
            stats = await client.stats()
            assert stats["replies"] == 201
            assert max(int(s) for s in stats["batch_sizes"]["m"]) > 1

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_closing_with_requests_in_flight_fails_them_typed(tmp_path: Any) -> None:
    from carpool.client import Unavailable

    async def main() -> None:
        client = AsyncClient(f"ipc://{tmp_path}/nobody")  # no broker: nothing will answer
        future = await client.submit("m", {"x": np.ones((1, 3), np.float32)}, timeout_s=5)
        await client.close()
        with pytest.raises(Unavailable):
            await future

    asyncio.run(main())


X = {"x": np.ones((1, 3), np.float32)}


@pytest.mark.timeout(60)
def test_a_client_moves_to_a_new_loop_once_the_old_one_has_stopped(fleet_factory: Any) -> None:
    """Its reader is a task of the first loop; once that loop has closed, the client
    moves to a new one, and a request made there is answered."""
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    fleet.add_worker({"m": lambda: SyntheticEngine(item_shape=(3,), max_batch=8)})
    fleet.ready()
    client = AsyncClient(fleet.broker.frontend_endpoint)
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(client.submit("m", X, timeout_s=5))  # left unanswered
    finally:
        first.close()

    async def main() -> dict[str, Any]:
        try:
            return await asyncio.wait_for(client.infer("m", X, timeout_s=2), 20)
        finally:
            await client.close()

    out = asyncio.run(main())
    np.testing.assert_array_equal(out["y"], np.full((1, 3), 3.0))


@pytest.mark.timeout(60)
def test_a_client_refuses_a_second_loop_while_the_first_runs(tmp_path: Any) -> None:
    """Two threads, each with its own loop, on one client: the second loop is refused
    while the first runs (its futures would be completed by the first one's reader,
    across threads, or never)."""
    client = AsyncClient(f"ipc://{tmp_path}/nobody")
    started, release = threading.Event(), threading.Event()

    async def hold() -> None:
        await client.submit("m", X, timeout_s=30)
        started.set()
        await asyncio.to_thread(release.wait, 30)  # its loop runs meanwhile
        await client.close()

    thread = threading.Thread(target=asyncio.run, args=(hold(),))
    thread.start()
    try:
        assert started.wait(20)
        with pytest.raises(RuntimeError, match="another running event loop"):
            asyncio.run(client.infer("m", X, timeout_s=1))
    finally:
        release.set()
        thread.join(20)
    assert not thread.is_alive()


@pytest.mark.timeout(60)
def test_close_ends_a_submit_waiting_for_room_with_its_answer_not_a_cancel(nobody: str) -> None:
    """The broker away and ZeroMQ's queue full: a submit waits for room. close() ends it
    with its future, failed 'closed', not with CancelledError (TaskGroup and asyncio.run
    would read that as a cancel of its task)."""

    async def main() -> None:
        client = AsyncClient(nobody)
        for _ in range(1000):  # ZeroMQ's high-water mark: the next send waits
            await client.submit("m", X, timeout_s=30)
        waiting = asyncio.create_task(client.submit("m", X, timeout_s=30))
        await asyncio.sleep(0)  # one turn of the loop: the task runs up to its send
        assert len(client.core.pending) == 1001  # its request made, and its send waits
        events = client.socket.get(zmq.EVENTS)
        assert isinstance(events, int)
        assert not events & zmq.POLLOUT  # for room: the socket has none
        assert not waiting.done()
        await client.close()
        future = await asyncio.wait_for(waiting, 10)  # not CancelledError
        assert not waiting.cancelled()
        with pytest.raises(Unavailable, match="closed"):
            await future
        with pytest.raises(CarpoolError, match="closed"):
            await client.submit("m", X)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_close_answers_a_pending_stats_at_once() -> None:
    """close() answers a stats() that waits for the broker at once, not at its timeout:
    the broker (a bare ROUTER) has the STATS and never answers."""

    async def main() -> None:
        context = zmq.asyncio.Context()
        broker = context.socket(zmq.ROUTER)
        try:
            port = broker.bind_to_random_port("tcp://127.0.0.1")
            client = AsyncClient(f"tcp://127.0.0.1:{port}")
            pending = asyncio.create_task(client.stats(30))
            await asyncio.wait_for(broker.recv_multipart(), 10)  # sent: it awaits its answer
            assert not pending.done()
            await client.close()
            with pytest.raises(CarpoolError, match="closed"):
                await asyncio.wait_for(pending, 10)
        finally:
            broker.close(linger=0)
            context.term()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_stats_calls_in_flight_together_each_get_their_own_reply() -> None:
    """Two stats() at once, answered in the reverse order: each call returns the reply
    that echoes its own id."""

    async def main() -> None:
        context = zmq.asyncio.Context()
        broker = context.socket(zmq.ROUTER)
        try:
            port = broker.bind_to_random_port("tcp://127.0.0.1")
            async with AsyncClient(f"tcp://127.0.0.1:{port}") as client:
                calls = [asyncio.create_task(client.stats(5)) for _ in range(2)]
                asks = [await asyncio.wait_for(broker.recv_multipart(), 10) for _ in calls]
                ids = [decode_meta(frames[2])["id"] for frames in asks]
                for (identity, *_), sid in reversed(list(zip(asks, ids, strict=True))):
                    reply = encode(Command.STATS, {"id": sid, "answer_to": sid})
                    await broker.send_multipart([identity, *reply])
                got = await asyncio.gather(*calls)
            assert [g["answer_to"] for g in got] == ids  # in the order the calls began
            assert len(set(ids)) == 2
        finally:
            broker.close(linger=0)
            context.term()

    asyncio.run(main())
