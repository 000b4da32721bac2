"""One blocking Client shared by threads (a camera loop per thread): every request gets
its own answer, and nothing crashes or hangs. Before, a shared Client aborted the process
inside libzmq (``Assertion failed: check () (src/msg.cpp)``) or hung in ``zmq_poll``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

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
    """No broker: each thread's request fails Unavailable at its own deadline (it hung in
    zmq_poll for the whole test before); close() from another thread answers the requests
    still waiting at once."""
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
