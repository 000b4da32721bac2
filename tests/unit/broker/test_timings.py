"""ModelTimings counts batches of answered requests at once (numpy bins them): the same
histogram counts and window as counting each request with ``Histogram.observe`` and a
deque of the last WINDOW, values on a bucket's bound and past the last bound included."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque

import pytest

from carpool.broker.requests import PendingRequest, RequestState
from carpool.broker.stats import WINDOW, ModelTimings
from carpool.common.histogram import TIME_BOUNDS_S, Histogram
from tests.unit.broker.pending import pending_request

Batch = tuple[float, list[PendingRequest], float, float]


def batches(rng: random.Random, count: int, start: float) -> list[Batch]:
    """``count`` batches answered from ``start`` on: latencies drawn across the buckets
    (some exactly on a bound, some past the last), one request in five expired (not
    counted), one batch in four without an engine time."""
    out: list[Batch] = []
    now = start
    for b in range(count):
        now += rng.uniform(0.0, 0.01)
        sent_s = now - rng.choice([0.0, 0.0005, rng.uniform(0.0, 0.2)])
        requests = []
        for i in range(rng.randint(1, 9)):
            latency_s = rng.choice([*TIME_BOUNDS_S, 11.0, rng.uniform(0.0, 3.0)])
            state = RequestState.EXPIRED if rng.random() < 0.2 else RequestState.DONE
            req = pending_request(b * 10 + i, arrival_s=now - latency_s)
            requests.append(dataclasses.replace(req, state=state))
        out.append((now, requests, sent_s, 0.0 if b % 4 == 0 else rng.uniform(0.0, 0.5)))
    return out


def test_a_batch_of_answers_counts_as_each_answer_counted_alone() -> None:
    rng = random.Random(7)
    timings = ModelTimings()
    latency, wait, compute = (Histogram(TIME_BOUNDS_S) for _ in range(3))
    recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)
    answered = counted = 0
    now = 0.0
    for chunk in (3, 400, 1, 250):  # (past WINDOW requests in all: the window wraps)
        taken = batches(rng, chunk, now)
        now = taken[-1][0]
        counted += timings.answered(taken)
        for when, requests, sent_s, compute_s in taken:
            for req in requests:
                if req.state is RequestState.DONE:
                    latency.observe(when - req.arrival_s)
                    wait.observe(sent_s - req.arrival_s)
                    recent.append((when, when - req.arrival_s))
                    answered += 1
            if compute_s > 0:
                compute.observe(compute_s)
    assert counted == answered > WINDOW
    for got, want in ((timings.latency, latency), (timings.wait, wait)):
        assert got.counts == want.counts
        assert got.sum == pytest.approx(want.sum, rel=1e-12)
    assert timings.compute.counts == compute.counts
    for since in (None, now - 1.0):
        values = sorted(lat for when, lat in recent if since is None or when >= since)
        figures = timings.percentiles(None if since is None else now, 1.0)
        assert figures is not None
        assert figures["n"] == len(values)
        for q in (50, 95, 99):
            rank = values[max(0, math.ceil(q / 100 * len(values)) - 1)]
            assert figures[f"p{q}_ms"] == round(1000 * rank, 3)


def test_nothing_answered_counts_nothing() -> None:
    timings = ModelTimings()
    expired = dataclasses.replace(pending_request(1), state=RequestState.EXPIRED)
    assert timings.answered([(1.0, [expired], 0.5, 0.0)]) == 0
    assert timings.percentiles(None) is None
    assert timings.latency.count == timings.wait.count == timings.compute.count == 0
