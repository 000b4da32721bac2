"""STATS per worker lane: the fitted engine cost with its spread, and the fitted CPU per
batch of the worker outside its engine, from RESULT ``cpu_ms`` (docs/protocol.md §6.4)."""

from __future__ import annotations

from typing import Any

import pytest

from .harness import T0, W1, Broker, batches, model_spec


def _lane(b: Broker) -> dict[str, Any]:
    (worker,) = b.core.snapshot()["workers"]
    return dict(worker["lanes"]["m"])


def test_a_lane_reports_no_cpu_fit_before_a_result() -> None:
    b = Broker.make(max_batch=8, max_wait_s=0.005)
    b.ready(T0, W1, model_spec(max_batch=8), slots=1)
    lane = _lane(b)
    assert (lane["cpu_fixed_ms"], lane["cpu_per_sample_ms"], lane["spread"]) == (0.0, 0.0, 0.0)


def test_a_lane_reports_the_fit_of_the_workers_cpu_per_batch() -> None:
    """Batches of 1 and 2 whose engine takes 1 + 0.5 ms x B and whose worker's own CPU
    is 0.4 + 0.1 ms x B: STATS reports both lines."""
    b = Broker.make(max_batch=2, max_wait_s=0.0)
    b.ready(T0, W1, model_spec(max_batch=8), slots=1)
    now = T0
    (batch,) = batches(b.request(now, 1))
    sizes = []
    for rid in range(2, 22, 2):
        b.request(now, rid)  # two queue behind the batch the worker holds: a batch of 2
        b.request(now, rid + 1)
        now += 0.002
        samples = batch.batch.total_samples
        sizes.append(samples)
        engine_ms, cpu_ms = 1.0 + 0.5 * samples, 0.4 + 0.1 * samples
        msgs, _ = b.result(now, batch, compute_ms=engine_ms, cpu_ms=cpu_ms)
        (batch,) = batches(msgs)
    assert set(sizes) == {1, 2}
    lane = _lane(b)
    assert lane["calibrated"] is True
    assert lane["fixed_cost_ms"] == pytest.approx(1.0)
    assert lane["per_sample_ms"] == pytest.approx(0.5)
    assert lane["spread"] == pytest.approx(0.0)
    assert lane["cpu_fixed_ms"] == pytest.approx(0.4)
    assert lane["cpu_per_sample_ms"] == pytest.approx(0.1)
