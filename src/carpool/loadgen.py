"""loadgen.py: an open-loop load generator for a live fleet.

Requests are sent at their scheduled arrival times whatever the replies do (no coordinated
omission: a slow reply cannot delay the next send and so hide its own latency). One thread,
one DEALER: between sends the client pumps replies until the next send is due. Results are
a :class:`carpool.sim.simulator.SimResult`, so live runs and simulated runs print alike.

Latency is measured from the actual send to the reply; how late sends left against their
schedule is recorded too (``send_lag_s``): if the generator itself falls behind, it says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from carpool.client import Client, ReplyFuture, RequestError
from carpool.common.clock import Clock, MonotonicClock
from carpool.common.protocol import Priority
from carpool.sim.simulator import SimResult
from carpool.sim.workload import Arrival

Inputs = Callable[[Arrival], dict[str, NDArray[np.float32]]]


def synthetic_inputs(arrival: Arrival) -> dict[str, NDArray[np.float32]]:
    """Input ``x`` of the arrival's shape, for a SyntheticEngine."""
    return {"x": np.ones(arrival.shape, np.float32)}


@dataclass(slots=True)
class LiveResult:
    result: SimResult
    send_lag_s: list[float] = field(default_factory=list)

    @property
    def max_send_lag_ms(self) -> float:
        return 1000 * max(self.send_lag_s, default=0.0)


def run_open_loop(
    endpoint: str,
    arrivals: Sequence[Arrival],
    *,
    label: str = "live",
    inputs: Inputs = synthetic_inputs,
    clock: Clock | None = None,
    grace_s: float = 1.0,
    start_delay_s: float = 0.05,
) -> LiveResult:
    """Send ``arrivals`` to a broker at their times and collect what came back."""
    clock = clock or MonotonicClock()
    span = arrivals[-1].t_s - arrivals[0].t_s if arrivals else 0.0
    live = LiveResult(SimResult(label, span))
    result = live.result
    pending: dict[int, tuple[ReplyFuture, float, float]] = {}  # id -> (future, sent, deadline)
    prepared = [inputs(a) for a in arrivals]  # build payloads before the clock starts
    with Client(endpoint, grace_s=grace_s) as client:
        start = clock.now() + start_delay_s
        i = 0
        while i < len(arrivals) or pending:
            now = clock.now()
            while i < len(arrivals) and start + arrivals[i].t_s <= now:
                a = arrivals[i]
                sent = clock.now()
                future = client.submit(
                    a.model, prepared[i], a.timeout_ms / 1000, priority=Priority(a.priority)
                )
                pending[future.request_id] = (future, sent, sent + a.timeout_ms / 1000)
                live.send_lag_s.append(sent - (start + a.t_s))
                result.sent += 1
                i += 1
            wait_s = (start + arrivals[i].t_s - clock.now()) if i < len(arrivals) else 0.05
            if client.poll(max(0.0, wait_s)) == 0:
                continue
            done_s = clock.now()
            for rid in [rid for rid, (f, _, _) in pending.items() if f.done()]:
                future, sent, deadline = pending.pop(rid)
                try:
                    future.result(0)
                except RequestError as exc:
                    result.errors[exc.code.name] += 1
                    continue
                result.ok += 1
                result.latencies_s.append(done_s - sent)
                if done_s <= deadline:
                    result.on_time += 1
        result.end_s = clock.now() - start
        stats = client.stats()
    for sizes in stats.get("batch_sizes", {}).values():
        for size, count in sizes.items():
            result.batch_sizes[int(size)] += int(count)
    return live
