"""The simulated broker with several item shapes of one model: each shape is a queue of
its own, and the queues share one worker's slots. Every request the door admits is
answered on time, at a load the worker can serve and at three times its capacity, as
with one shape (docs/batching.md, "Several queues of one model")."""

from __future__ import annotations

import pytest

from carpool.broker.config import BatchingConfig
from carpool.sim.simulator import EngineCost, SimResult, SimWorker, simulate
from carpool.sim.workload import Arrival

#: One worker of 40 ms + 4 ms a sample, batches of 8, 2 slots: 111 samples/s at best.
FIXED_S, PER_SAMPLE_S, MAX_BATCH = 0.040, 0.004, 8
CAPACITY_SPS = MAX_BATCH / (FIXED_S + PER_SAMPLE_S * MAX_BATCH)
WARM_S, LOAD_S = 1.5, 4.0


def run(shapes: int, load: float, jitter: float = 0.0) -> SimResult:
    """1.5 s at half the capacity (the costs get fitted), then ``load`` x capacity for
    4 s; requests of one sample with 1 s timeouts, evenly spaced, their shapes [1, 16 + i]
    in turn for i < ``shapes``."""
    arrivals: list[Arrival] = []
    start_s = 0.0
    for rate, span_s in ((0.5 * CAPACITY_SPS, WARM_S), (load * CAPACITY_SPS, LOAD_S)):
        count = round(rate * span_s)
        for i in range(count):
            shape = (1, 16 + len(arrivals) % shapes)
            arrivals.append(Arrival(start_s + i / rate, "synthetic", shape, 1000))
        start_s += span_s
    worker = SimWorker("w", EngineCost(FIXED_S, PER_SAMPLE_S, jitter), MAX_BATCH, slots=2)
    return simulate(arrivals, [worker], BatchingConfig(max_batch=MAX_BATCH), seed=1)


def admitted(result: SimResult) -> int:
    door = result.broker["shed_at_door"]
    assert isinstance(door, int)
    return result.sent - door - result.errors.get("OVERLOADED", 0)


@pytest.mark.parametrize("shapes", [1, 8])
def test_below_capacity_every_request_is_answered_on_time(shapes: int) -> None:
    """Half the capacity: a load the worker serves with batches of 2-3 of a shape. With
    8 shapes the queues were asked in the order they were created when a slot freed, so
    later arrivals of one shape overtook another's: about a third of the requests missed
    their deadline."""
    result = run(shapes, 0.5)
    assert result.broker["shed_at_door"] == 0
    assert result.on_time == result.sent


@pytest.mark.parametrize("jitter", [0.0, 0.1])
@pytest.mark.parametrize("shapes", [1, 8])
def test_at_three_times_capacity_what_the_door_admits_makes_its_deadline(
    shapes: int, jitter: float
) -> None:
    """Three times the capacity: the door refuses what cannot make it and the rest is
    answered on time, with batch times jittered by 10% too. The door still lets in about
    what the worker can serve (its prediction counts the other shapes' queues as batches
    of their own, not as samples riding in this shape's batches; counted as samples it
    let in more than the worker could finish in time)."""
    result = run(shapes, 3.0, jitter)
    assert result.on_time == admitted(result)
    served_s = WARM_S + LOAD_S
    assert result.on_time >= 0.85 * CAPACITY_SPS * served_s
