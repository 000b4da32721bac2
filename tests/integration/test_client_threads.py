"""One blocking Client shared by threads (a camera loop per thread): every request gets
its own answer, and nothing crashes or hangs (one thread at a time uses the zmq socket,
which libzmq requires)."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.client import Client, Unavailable
from carpool.common.clock import MonotonicClock
from carpool.common.errors import CarpoolError
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output

pytestmark = pytest.mark.timeout(60)


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
    """No broker: each thread's request fails Unavailable at its own deadline, whichever
    thread owns the socket; close() from another thread answers the requests still
    waiting at once."""
    client = Client(nobody, grace_s=0.2)
    clock = MonotonicClock()
    started = clock.now()

    def short(i: int) -> None:
        with pytest.raises(Unavailable):
            client.infer("m", {"x": np.ones((1, 4), np.float32)}, 0.5)

    assert _in_threads(3, short) == []
    assert clock.now() - started < 10  # about 0.7 s: not the 60 s the test would wait

    waiting = [client.submit("m", {"x": np.ones((1, 4), np.float32)}, 30) for _ in range(4)]

    def waiter(i: int) -> None:
        with pytest.raises(Unavailable, match="closed"):
            waiting[i].result()

    closer = threading.Timer(0.3, client.close)  # while both threads wait
    closer.start()
    started = clock.now()
    assert _in_threads(4, waiter) == []
    closer.join()
    assert clock.now() - started < 10  # at close, not at the requests' 30 s timeout
    with pytest.raises(CarpoolError, match="closed"):
        client.submit("m", {"x": np.ones((1, 4), np.float32)})


X = {"x": np.ones((1, 4), np.float32)}


def _until_another_thread_owns(client: Client, thread: threading.Thread) -> None:
    """Wait (at most 5 s) until some other thread holds the client's socket."""
    clock = MonotonicClock()
    until = clock.now() + 5
    while clock.now() < until:
        if not client._turns.own.acquire(False):
            return
        client._turns.own.release()
        thread.join(0.001)
    raise AssertionError("the other thread never took the socket")


def test_close_from_a_signal_handler_in_the_owning_thread_returns(nobody: str) -> None:
    """The handler runs in the thread that owns the socket (blocked in result()): close()
    goes on at once (the socket's lock is re-entrant), and the interrupted wait ends with
    the future's Unavailable, not libzmq's ZMQError (ENOTSOCK) from the closed socket."""
    code = f"""
import signal, numpy as np
from carpool.client import Client, Unavailable
c = Client({nobody!r}, grace_s=0.2)
signal.signal(signal.SIGALRM, lambda *a: c.close())
f = c.submit("m", {{"x": np.ones((1, 4), np.float32)}}, 5)
signal.setitimer(signal.ITIMER_REAL, 0.3)
try:
    f.result()
except Unavailable as exc:
    print("closed" if "closed" in str(exc) else repr(exc))
except Exception as exc:  # (e.g. libzmq's ENOTSOCK from the interrupted poll)
    print(repr(exc))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], timeout=20, capture_output=True, text=True, check=False
    )
    assert done.stdout.strip() == "closed", done.stdout + done.stderr


def test_interrupts_at_any_point_leave_the_client_usable(nobody: str) -> None:
    """Ctrl-C (any exception from a signal handler) may strike anywhere in a call, right
    after the socket's lock is taken included: the lock is re-entrant and taken inside
    the ``try`` that releases it, so the next call, close() included, still works. (One
    window remains, inside the ``finally`` that releases it: then the interrupted thread
    keeps the socket, its own calls still work, other threads' time out.)"""
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
    """No broker, its queue full: another thread's send holds the socket for up to 30 s;
    a submit with 0.2 s fails Unavailable while that send still waits, and close() makes
    the send give up rather than wait for its 30 s."""
    client = Client(nobody, grace_s=0.2)
    for _ in range(1000):  # fills ZeroMQ's high-water mark: the broker is away
        client.submit("m", X, 30)
    blocked = threading.Thread(target=lambda: client.submit("m", X, 30))
    blocked.start()
    _until_another_thread_owns(client, blocked)  # its send waits for room, owning it
    future = client.submit("m", X, 0.2)
    with pytest.raises(Unavailable, match="not taking"):
        future.result(0)
    assert blocked.is_alive()  # its send still waits: the submit did not wait for it
    closer = threading.Thread(target=client.close)  # the blocked send gives up
    closer.start()
    closer.join(10)
    blocked.join(10)
    assert not closer.is_alive()
    assert not blocked.is_alive()


def _hammer(client: Client, stop: threading.Event, ended: list[BaseException]) -> threading.Thread:
    """A thread that submits in a tight loop (and never polls) until ``stop``, or until a
    submit raises; what it raised goes in ``ended``."""

    def run() -> None:
        try:
            while not stop.is_set():
                client.submit("m", X, 5)
        except BaseException as exc:  # reported to the test
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_close_is_not_starved_by_a_thread_that_submits_in_a_loop(nobody: str) -> None:
    """A thread that submits in a tight loop (each submit returns at once: the broker's
    queue is full) does not keep close() from the socket: close() goes before the line,
    and the looping thread's next submit raises 'closed'."""
    client = Client(nobody, grace_s=0.2)
    stop = threading.Event()
    ended: list[BaseException] = []
    thread = _hammer(client, stop, ended)
    _until_another_thread_owns(client, thread)
    closer = threading.Thread(target=client.close, daemon=True)
    clock = MonotonicClock()
    started = clock.now()
    closer.start()
    closer.join(20)
    took = clock.now() - started
    stop.set()
    thread.join(10)
    assert not closer.is_alive()
    assert took < 10
    assert len(ended) == 1
    assert isinstance(ended[0], CarpoolError)
    assert "closed" in str(ended[0])  # its next submit: the client is closed


def test_threads_waiting_for_the_socket_take_it_in_turn(nobody: str) -> None:
    """The thread that lets go of the socket and asks for it again at once goes behind
    the threads already waiting (under the GIL it runs on while they wake, and would
    otherwise take it straight back, ahead of them)."""
    client = Client(nobody)
    order: list[str] = []
    assert client._turns.take(None, send=True)  # this thread owns it

    def waiter() -> None:
        assert client._turns.take(5, send=True)
        order.append("waiter")
        client._turns.let_go()

    thread = threading.Thread(target=waiter)
    thread.start()
    clock = MonotonicClock()
    until = clock.now() + 5
    while not client._turns.line and clock.now() < until:
        thread.join(0.001)
    assert client._turns.line  # the waiter is in line
    client._turns.let_go()
    assert client._turns.take(5, send=True)  # at once again: behind the waiter
    order.append("first owner")
    client._turns.let_go()
    thread.join(10)
    client.close()
    assert order == ["waiter", "first owner"]


def test_a_thread_waiting_for_its_reply_is_not_starved_by_one_that_submits(
    nobody: str,
) -> None:
    """Only the thread that owns the socket receives and fails requests on time; a thread
    submitting in a tight loop still lets the waiting one take its turn, so the waiting
    thread's 0.3 s request fails Unavailable on time, not when the loop ends."""
    client = Client(nobody, grace_s=0.2, send_timeout_s=0.0)
    stop = threading.Event()
    ended: list[BaseException] = []
    thread = _hammer(client, stop, ended)
    try:
        _until_another_thread_owns(client, thread)
        clock = MonotonicClock()
        started = clock.now()
        future = client.submit("m", X, 0.3)
        with pytest.raises(Unavailable):
            future.result(20)  # (not TimeoutError: answered well within the 20 s)
        assert clock.now() - started < 10  # about 0.5 s
    finally:
        stop.set()
        thread.join(10)
        client.close()
    assert ended == []


def test_an_infinite_wait_under_contention(fleet_factory: Any) -> None:
    """result(math.inf) in a thread that does not own the socket waits in finite naps
    (Condition.wait refuses math.inf with OverflowError) and returns the result."""
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    engine = {"m": lambda: SyntheticEngine(item_shape=(4,), max_batch=8, fixed_cost_s=0.2)}
    fleet.add_worker(engine)
    client = fleet.ready()
    first, second = client.submit("m", X, 5), client.submit("m", X, 5)
    owner = threading.Thread(target=first.result)
    owner.start()
    _until_another_thread_owns(client, owner)
    assert second.result(math.inf)["y"].shape == (1, 4)
    owner.join(10)


def test_a_client_dropped_without_close_leaks_no_descriptors(nobody: str) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    before = len(os.listdir("/proc/self/fd"))
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


_HOLD = """
import signal, threading, time, numpy as np
from carpool.client import Client
X = {{"x": np.ones((1, 4), np.float32)}}
c = Client({nobody!r}, grace_s=0.2)
def hold(s):  # another thread owns the socket for s seconds (a slow send, say)
    c._turns.own.acquire(); time.sleep(s); c._turns.let_go()
"""


def test_a_close_interrupted_while_it_waits_leaves_the_client_open_and_working(
    nobody: str,
) -> None:
    """A second Ctrl-C inside close(), while it waits for the socket, leaves the client
    open and working: sends are taken, and requests still expire (a result() without a
    timeout returns)."""
    out = _run(
        _HOLD.format(nobody=nobody)
        + """
f = c.submit("m", X, 0.3)
threading.Thread(target=hold, args=(0.5,)).start()
time.sleep(0.05)
def boom(*a):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, boom)
signal.setitimer(signal.ITIMER_REAL, 0.1)
try:
    c.close()
except KeyboardInterrupt:
    print("interrupted")
try:
    f.result(10)
except Exception as exc:
    print(type(exc).__name__)
print(c.state.value, c.submit("m", X, 0.2)._error is None)
c.close()
"""
    )
    assert out == ["interrupted", "Unavailable", "open", "True"]


def test_a_handler_in_a_thread_waiting_in_line_does_not_wait_behind_itself(
    nobody: str,
) -> None:
    """A handler's submit in a thread that waits in line for the socket goes before the
    line (behind its own thread's ticket, which cannot move until the handler returns,
    it would wait out its whole timeout, and every thread behind it too)."""
    out = _run(
        _HOLD.format(nobody=nobody)
        + """
threading.Thread(target=hold, args=(0.2,)).start()
time.sleep(0.05)
took = []
def handler(*a):
    t0 = time.monotonic()
    g = c.submit("m", X, 3)
    took.append((time.monotonic() - t0, g._error))
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.1)
f = c.submit("m", X, 5)  # waits in line for the owner
print(took[0][1] is None, took[0][0] < 2.0, f._error is None)
c.close()
"""
    )
    assert out == ["True", "True", "True"]


def test_a_failed_call_in_a_handler_does_not_release_the_interrupted_owner(
    nobody: str,
) -> None:
    """A handler in the owning thread whose submit raises 'closed' (close() running in
    another thread) keeps the interrupted frame's hold: close() waits for the socket
    rather than closing it under the interrupted call."""
    out = _run(
        _HOLD.format(nobody=nobody)
        + """
from carpool.common.errors import CarpoolError
f = c.submit("m", X, 3)
seen = []
def handler(*a):
    closer = threading.Thread(target=c.close)
    closer.start()
    while not c._turns.closing:
        time.sleep(0.001)
    try:
        c.submit("m", X, 1)
    except CarpoolError:
        pass
    seen.append(c._turns.own._is_owned())
    closer.join(0.5)
    seen.append(c.state.value)
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.2)
try:
    f.result()
except Exception as exc:
    seen.append(type(exc).__name__)
print(*seen)
"""
    )
    assert out == ["True", "open", "Unavailable"]


def test_stats_calls_from_two_threads_each_get_their_own_reply(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Two threads' stats() at once, answered in the reverse order: each call returns the
    reply that echoes its own id, whichever thread receives it."""
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
