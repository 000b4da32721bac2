"""One blocking Client shared by threads (a camera loop per thread) and signal handlers:
every request gets its own answer, and nothing crashes or hangs (the client's one I/O
thread uses its zmq socket, as libzmq requires). Time bounds here only guard hangs."""

from __future__ import annotations

import gc
import math
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.client import Client, ReplyFuture, Unavailable
from carpool.common.errors import Cancelled, CarpoolError
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output

pytestmark = pytest.mark.timeout(60)

X = {"x": np.ones((1, 4), np.float32)}


def _in_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Run ``work(i)`` in ``count`` threads; the exceptions they raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_threads_sharing_a_client_each_get_their_own_answers(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    fleet.add_worker({"m": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)})
    client = fleet.ready()

    def camera(i: int) -> None:
        for k in range(150):
            x = np.full((1, 4), 1000 * i + k, np.float32)
            np.testing.assert_array_equal(client.infer("m", {"x": x}, 10)["y"], synthetic_output(x))
            if k % 50 == 0:
                assert client.stats()["replies"] >= 0  # STATS from several threads at once

    assert _in_threads(4, camera) == []
    assert client.stats()["replies"] == 600
    assert client.in_flight == 0


def test_a_future_may_be_waited_for_in_another_thread(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    fleet.add_worker({"m": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)})
    client = fleet.ready()
    xs = [np.full((1, 4), i, np.float32) for i in range(200)]
    futures = [client.submit("m", {"x": x}, 10) for x in xs]  # submitted here

    def waiter(i: int) -> None:  # ... answered there, two threads taking turns
        for f, x in list(zip(futures, xs, strict=True))[i::2]:
            np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))

    assert _in_threads(2, waiter) == []


def test_threads_facing_no_broker_fail_on_time_and_close_answers_the_rest(
    nobody: str,
) -> None:
    """No broker: each thread's request fails Unavailable at its own deadline (well within
    the 20 s its result() may wait); close() from another thread answers the requests
    still waiting at once (their own timeout is 30 s)."""
    client = Client(nobody, grace_s=0.2)

    def short(i: int) -> None:
        with pytest.raises(Unavailable):
            client.submit("m", X, 0.5).result(20)  # (not TimeoutError: answered by then)

    assert _in_threads(3, short) == []

    waiting = [client.submit("m", X, 30) for _ in range(4)]
    assert not any(f.done() for f in waiting)
    ready = [threading.Event() for _ in waiting]

    def waiter(i: int) -> None:
        ready[i].set()
        with pytest.raises(Unavailable, match="closed"):
            waiting[i].result(20)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert all(r.wait(10) for r in ready)
    client.close()  # while the threads wait (or are about to)
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert all(f.done() for f in waiting)
    with pytest.raises(CarpoolError, match="closed"):
        client.submit("m", X)


def _until(what: str, done: Callable[[], bool]) -> None:
    """Wait (at most 10 s: a hang guard) until ``done()``, a fact of the client's."""
    pause = threading.Event()
    for _ in range(10_000):
        if done():
            return
        pause.wait(0.001)
    raise AssertionError(f"never: {what}")


def _unsent(client: Client) -> int:
    """Requests and queries the I/O thread holds until the socket takes them."""
    return sum(len(link.unsent) for link in client._io.links)


def test_the_client_has_one_io_thread_a_daemon_that_close_joins(nobody: str) -> None:
    client = Client(nobody)
    thread = client._io.thread
    assert thread.daemon
    assert thread.is_alive()
    assert thread.name.startswith("carpool-client-io-")
    names = [t.name for t in threading.enumerate() if t.name == thread.name]
    assert names == [thread.name]  # one, named for this client
    future = client.submit("m", X, 30)
    client.close()
    assert not thread.is_alive()
    with pytest.raises(Unavailable, match="closed"):
        future.result(0)
    with pytest.raises(CarpoolError, match="closed"):
        client.poll(0)
    assert client.cancel(future) is False
    client.close()  # a second close does nothing


def test_many_threads_submitting_at_once_get_unique_ids_in_their_own_order(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """16 threads submit 100 requests each at once: every request reaches the broker
    with an id of its own under the client's one nonce, and each thread's requests
    arrive in the order it submitted them (submit returns once the socket took it)."""
    from carpool.common.protocol import decode_meta

    broker = context.socket(zmq.ROUTER)
    broker.setsockopt(zmq.LINGER, 0)
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    client = Client(f"tcp://127.0.0.1:{port}", context=context)
    submitted: dict[int, list[int]] = {}

    def submit(i: int) -> None:
        submitted[i] = [client.submit("m", X, 30).request_id for _ in range(100)]

    try:
        assert _in_threads(16, submit) == []
        metas = []
        for _ in range(1600):
            assert broker.poll(10_000)
            metas.append(decode_meta(broker.recv_multipart()[2]))
    finally:
        client.close()
        broker.close()
    arrived = [meta["id"] for meta in metas]
    assert len(set(arrived)) == 1600
    assert {meta["client"] for meta in metas} == {client.core.resend.nonce}
    assert sorted(arrived) == sorted(rid for rids in submitted.values() for rid in rids)
    position = {rid: n for n, rid in enumerate(arrived)}
    for rids in submitted.values():
        assert [position[rid] for rid in rids] == sorted(position[rid] for rid in rids)


def test_interrupts_at_any_point_leave_the_client_usable(nobody: str) -> None:
    """Ctrl-C (any exception from a signal handler) may strike anywhere in a call: the
    caller holds no lock the I/O thread needs (it waits on its call's own), so the next
    call, close() included, still works."""
    code = f"""
import signal, numpy as np
from carpool.client import Client
c = Client({nobody!r}, grace_s=0.2, send_timeout_s=0.0)
x = {{"x": np.ones((1, 4), np.float32)}}
hits = 0
def boom(*a):
    global hits
    hits += 1
    if hits >= 400:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return
    raise KeyboardInterrupt
def spin():
    while hits < 400:
        try:
            c.submit("m", x, 5)
            c.poll(0)
        except KeyboardInterrupt:
            pass
signal.signal(signal.SIGALRM, boom)
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
for _ in range(1000):  # (an interrupt may land outside spin's try, too)
    try:
        spin()
        break
    except KeyboardInterrupt:
        pass
f = c.submit("m", x, 0.1)  # still usable in this thread
c.poll(0)
c.close()
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], timeout=40, capture_output=True, text=True, check=False
    )
    assert done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_submit_keeps_its_timeout_while_another_threads_send_waits(nobody: str) -> None:
    """No broker, its queue full: the next submit returns at once, its request waiting in
    the I/O thread for room (up to 30 s); a submit then waits, for its own request to be
    taken (up to 30 s too); a submit with 0.2 s meanwhile fails Unavailable on its own
    time, and close() makes the waiting submit return (its future answered 'closed')."""
    client = Client(nobody, grace_s=0.2)
    for _ in range(1000):  # fills ZeroMQ's high-water mark: the broker is away
        client.submit("m", X, 30)
    first = client.submit("m", X, 30)
    assert not first.done()
    _until(
        "the I/O thread holds a request the socket has no room for", lambda: _unsent(client) == 1
    )
    returned: list[ReplyFuture] = []
    blocked = threading.Thread(target=lambda: returned.append(client.submit("m", X, 30)))
    blocked.start()
    _until("the other thread's request waits for room", lambda: _unsent(client) == 2)
    future = client.submit("m", X, 0.2)
    with pytest.raises(Unavailable, match="not taking"):
        future.result(0)
    assert blocked.is_alive()  # its request still waits: the submit did not wait for it
    assert _unsent(client) == 2
    closer = threading.Thread(target=client.close)  # the waiting submit returns
    closer.start()
    closer.join(10)
    blocked.join(10)
    assert not closer.is_alive()
    assert not blocked.is_alive()
    for answered in (first, returned[0]):
        with pytest.raises(Unavailable, match="closed"):
            answered.result(0)


def test_a_request_cancelled_before_it_was_sent_is_never_sent(nobody: str) -> None:
    """No broker, its queue full: a request the I/O thread holds for room, cancelled, is
    answered Cancelled at once and leaves the I/O thread; no CANCEL is queued to go ahead
    of it (a CANCEL before its REQUEST finds nothing at the broker, which then runs it)."""
    client = Client(nobody, grace_s=0.2)
    for _ in range(1000):  # fills ZeroMQ's high-water mark: the broker is away
        client.submit("m", X, 30)
    held = client.submit("m", X, 30)
    _until("the I/O thread holds the request for room", lambda: _unsent(client) == 1)
    assert held.cancel()
    with pytest.raises(Cancelled, match="before it was sent"):
        held.result(10)
    assert _unsent(client) == 0
    assert not client.core.resend.has_outgoing  # no CANCEL waits for the socket
    assert held.request_id not in client.core.pending
    client.close()


def _hammer(
    client: Client, stop: threading.Event, ended: list[BaseException]
) -> tuple[threading.Thread, threading.Event]:
    """A thread that submits in a tight loop (and never polls) until ``stop``, or until a
    submit raises; what it raised goes in ``ended``. The event: its first submit returned."""
    started = threading.Event()

    def run() -> None:
        try:
            while not stop.is_set():
                client.submit("m", X, 5)
                started.set()
        except BaseException as exc:  # reported to the test
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started


def test_close_is_not_starved_by_a_thread_that_submits_in_a_loop(nobody: str) -> None:
    """A thread that submits in a tight loop does not keep close() from closing (within
    the 20 s hang guard), and the looping thread's next submit raises 'closed'."""
    client = Client(nobody, grace_s=0.2)
    stop = threading.Event()
    ended: list[BaseException] = []
    thread, started = _hammer(client, stop, ended)
    assert started.wait(10)
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    closer.join(20)
    thread.join(10)  # (it ends by itself: its next submit raises)
    stop.set()
    assert not closer.is_alive()
    assert not thread.is_alive()
    assert len(ended) == 1
    assert isinstance(ended[0], CarpoolError)
    assert "closed" in str(ended[0])  # its next submit: the client is closed


def test_a_thread_waiting_for_its_reply_is_not_starved_by_one_that_submits(
    nobody: str,
) -> None:
    """A thread submitting in a tight loop does not keep a waiting thread's 0.3 s request
    from failing Unavailable at its deadline (not TimeoutError after the 20 s wait)."""
    client = Client(nobody, grace_s=0.2, send_timeout_s=0.0)
    stop = threading.Event()
    ended: list[BaseException] = []
    thread, started = _hammer(client, stop, ended)
    try:
        assert started.wait(10)
        future = client.submit("m", X, 0.3)
        with pytest.raises(Unavailable):
            future.result(20)
    finally:
        stop.set()
        thread.join(10)
        client.close()
    assert ended == []


def test_an_infinite_wait_under_contention(fleet_factory: Any) -> None:
    """result(math.inf) while another thread waits for another future returns the result
    (a lock's wait refuses math.inf with OverflowError)."""
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    engine = {"m": lambda: SyntheticEngine(item_shape=(4,), max_batch=8, fixed_cost_s=0.2)}
    fleet.add_worker(engine)
    client = fleet.ready()
    first, second = client.submit("m", X, 5), client.submit("m", X, 5)
    waiting = threading.Event()

    def other() -> None:
        waiting.set()
        first.result()

    owner = threading.Thread(target=other)
    owner.start()
    assert waiting.wait(10)
    assert second.result(math.inf)["y"].shape == (1, 4)
    owner.join(10)
    assert not owner.is_alive()
    assert first.done()


def test_calls_racing_close_are_answered_or_refused_never_stranded(nobody: str) -> None:
    """Threads submit and ask for STATS while another closes the client: each call
    returns (a future, answered by close if not before) or raises 'closed'; none waits
    for ever for a thread that ended."""
    client = Client(nobody, grace_s=0.2)
    started = threading.Event()
    futures: list[ReplyFuture] = []

    refusals: list[str] = []

    def busy(i: int) -> None:
        for _ in range(200):
            try:
                if i % 2:
                    futures.append(client.submit("m", X, 30))
                else:
                    client.stats(30)
            except CarpoolError as exc:
                refusals.append(str(exc))
                return
            finally:
                started.set()

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    assert started.wait(10)
    client.close()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert all(f.done() for f in futures)
    assert refusals == ["the client is closed"] * len(refusals)


def test_a_forked_child_is_refused_the_parents_client(nobody: str) -> None:
    """The I/O thread stays in the parent: in a child, the parent's client refuses calls
    (rather than hand them to a thread that is not there), and neither a pending future
    nor poll() waits for it."""
    client = Client(nobody)
    try:
        pending = client.submit("m", X, 30)
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            code = 0
            for step, attempt in enumerate(
                (
                    lambda: client.submit("m", X, 1),
                    lambda: pending.result(10),
                    lambda: client.poll(10),
                ),
                start=1,
            ):
                try:
                    attempt()
                    code = code or step
                except CarpoolError as exc:
                    code = code or (0 if "fork" in str(exc) else 10 + step)
                except BaseException:
                    code = code or 20 + step
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not pending.done()
        assert not client.submit("m", X, 30).done()  # the parent's still works
    finally:
        client.close()


def test_a_fault_in_the_io_thread_answers_the_call_it_was_taking(nobody: str) -> None:
    """A bug that ends the I/O thread while it takes a call (here, a query) still
    answers that call's caller: the client closes, and the caller hears so."""
    client = Client(nobody)

    def fault(call: object, now: float) -> None:
        raise RuntimeError("injected fault")

    client._io._query = fault  # type: ignore[method-assign]
    heard: list[BaseException] = []

    def ask() -> None:
        try:
            client.stats(30)
        except BaseException as exc:
            heard.append(exc)

    caller = threading.Thread(target=ask, daemon=True)
    caller.start()
    caller.join(20)
    assert not caller.is_alive()
    assert len(heard) == 1
    assert isinstance(heard[0], CarpoolError)
    assert "closed" in str(heard[0])
    client._io.join()
    assert not client._io.thread.is_alive()
    client.close()


def _io_threads() -> int:
    return sum(t.name.startswith("carpool-client-io-") for t in threading.enumerate())


def test_a_client_dropped_without_close_leaks_no_descriptors_or_threads(nobody: str) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    before, threads = len(os.listdir("/proc/self/fd")), _io_threads()
    with warnings.catch_warnings():
        # pyzmq warns of each socket left unclosed (an error in this suite, which would
        # leave the socket open): that is the point here.
        warnings.simplefilter("ignore", ResourceWarning)
        for _ in range(50):
            Client(nobody, context=context)
        gc.collect()
    leaked = len(os.listdir("/proc/self/fd")) - before
    context.destroy(linger=0)
    assert leaked < 10  # not two per Client: each one's wake pipe is closed with it
    assert _io_threads() <= threads  # each one's I/O thread ended


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_a_client_dropped_with_a_request_pending_does_not_hang_the_collector(
    nobody: str, kind: str
) -> None:
    """Client and future refer to each other, so the garbage collector frees them
    together: the client's own finalizer closes its socket before its context's term(),
    which would otherwise block the collecting thread for ever."""
    code = f"""
import asyncio, gc, warnings
import numpy as np
from carpool.client import AsyncClient, Client
warnings.simplefilter("ignore", ResourceWarning)
x = {{"x": np.ones((1, 4), np.float32)}}
if {kind!r} == "Client":
    try:
        Client({nobody!r}).submit("m", x, 5).result(0.1)
    except TimeoutError:
        pass
else:
    async def main():
        c = AsyncClient({nobody!r})
        await c.submit("m", x, 5)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
gc.collect()
print("collected")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], timeout=30, capture_output=True, text=True, check=False
    )
    assert done.stdout.strip() == "collected", done.stdout + done.stderr


def _run(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code], timeout=40, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()


def test_interrupts_anywhere_in_close_leave_the_client_open_or_wholly_closed(
    nobody: str,
) -> None:
    """A Ctrl-C (any exception from a signal handler) that strikes somewhere in close()
    leaves the client open (struck before close() asked the I/O thread: it takes calls)
    or closing (calls refused, or taken and answered 'closed'), never half-closed: a
    second close() returns once it is closed and its thread ended, every future has its
    answer ('closed'), and later calls are refused."""
    out = _run(
        f"""
import signal, numpy as np
from carpool.client import Client, Unavailable
from carpool.common.errors import CarpoolError, Cancelled
X = {{"x": np.ones((1, 4), np.float32)}}
armed = False
def boom(*a):
    global armed
    if armed:
        armed = False
        raise KeyboardInterrupt
signal.signal(signal.SIGALRM, boom)
seen = set()
for _ in range(60):
    c = Client({nobody!r}, grace_s=0.2)
    f = c.submit("m", X, 30)
    signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)  # (around close() only)
    try:
        armed = True
        c.close()
        armed = False
    except KeyboardInterrupt:
        pass
    armed = False
    signal.setitimer(signal.ITIMER_REAL, 0)
    futures = [f]
    try:  # struck before close() asked the I/O thread: open, and takes calls
        futures.append(c.submit("m", X, 30))
        seen.add("open")
    except CarpoolError as exc:  # after: closing, or closed
        assert "closed" in str(exc)
        seen.add("closed")
    c.close()
    for future in futures:  # each answered: by the close
        try:
            future.result(10)
            raise AssertionError("answered, with no broker")
        except Unavailable as exc:
            assert "closed" in str(exc), exc
    assert not c._io.thread.is_alive()
    try:
        c.submit("m", X, 30)
        raise AssertionError("closed, but a submit was taken")
    except CarpoolError as exc:
        assert "closed" in str(exc)
print("ok")
"""
    )
    assert out == ["ok"]


def test_a_signal_handlers_calls_go_on_while_the_call_it_interrupted_waits(
    nobody: str,
) -> None:
    """The main thread waits in stats() (no broker: no answer comes); a signal handler
    there submits (a future, pending: its call did not wait behind the interrupted one)
    and closes the client, which answers the interrupted wait ('closed'); a submit after
    that, in the handler, raises 'closed' too."""
    client = Client(nobody, grace_s=0.2)
    seen: list[object] = []

    def handler(*_: object) -> None:
        future = client.submit("m", X, 30)
        seen.append(future.done())
        client.close()
        try:
            client.submit("m", X, 30)
        except CarpoolError as exc:
            seen.append(str(exc))

    def ring() -> None:
        _until("the stats query is in flight", lambda: bool(client._io._queries))
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    assert threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        ringer = threading.Thread(target=ring)
        ringer.start()
        with pytest.raises(CarpoolError, match="closed"):
            client.stats(30)
        ringer.join(10)
    finally:
        signal.signal(signal.SIGUSR1, old)
        client.close()
    assert seen == [False, "the client is closed"]


def test_close_from_a_signal_handler_answers_the_wait_it_interrupted(nobody: str) -> None:
    """A handler in the thread blocked in result() closes the client: the interrupted
    wait ends with the future's Unavailable ('closed'), not an error of a closed socket."""
    client = Client(nobody, grace_s=0.2)
    future = client.submit("m", X, 30)
    old = signal.signal(signal.SIGUSR1, lambda *_: client.close())
    try:
        main = threading.main_thread().ident or 0
        ringer = threading.Thread(target=signal.pthread_kill, args=(main, signal.SIGUSR1))
        ringer.start()
        with pytest.raises(Unavailable, match="closed"):
            future.result(20)
        ringer.join(10)
    finally:
        signal.signal(signal.SIGUSR1, old)
        client.close()


def test_stats_calls_from_two_threads_each_get_their_own_reply(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Two threads' stats() at once, answered in the reverse order: each call returns the
    reply that echoes its own id (the I/O thread matches answers to the calls)."""
    from carpool.common.protocol import Command, decode_meta, encode

    broker = context.socket(zmq.ROUTER)
    broker.setsockopt(zmq.LINGER, 0)
    port = broker.bind_to_random_port("tcp://127.0.0.1")
    client = Client(f"tcp://127.0.0.1:{port}", context=context)
    got: dict[int, dict[str, Any]] = {}

    def ask(i: int) -> None:
        got[i] = client.stats(10)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        asks = []
        for _ in threads:
            assert broker.poll(10_000)
            asks.append(broker.recv_multipart())
        for identity, *frames in reversed(asks):
            sid = decode_meta(frames[1])["id"]
            broker.send_multipart([identity, *encode(Command.STATS, {"id": sid, "to": sid})])
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
    finally:
        client.close()
        broker.close()
    assert sorted(reply["id"] for reply in got.values()) == sorted(
        decode_meta(frames[1])["id"] for _, *frames in asks
    )
    assert all(reply["to"] == reply["id"] for reply in got.values())
