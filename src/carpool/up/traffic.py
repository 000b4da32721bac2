"""traffic.py: ``carpool up --traffic RATE`` — built-in clients, so the page has a fleet
at work to show.

One thread, one :class:`~carpool.client.Client`: Poisson arrivals at ``rate_rps``, sent
open loop by :func:`carpool.loadgen.drive` in one-second rounds (a round ends once its
last request is answered, so a stop waits for one round at most). The latencies of the
last ``window_s`` are what the page's p50/p95/p99 are.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from carpool.client import Client
from carpool.loadgen import drive, synthetic_inputs
from carpool.sim.workload import arrivals, poisson

logger = logging.getLogger(__name__)

ROUND_S = 1.0

#: The request shape of the models whose shape ``carpool up`` knows without being told.
KNOWN_SHAPES: dict[str, tuple[int, ...]] = {
    "orientation": (1, 3, 224, 224),
    "synthetic": (1, 16),
}


@dataclass(frozen=True, slots=True)
class TrafficPlan:
    rate_rps: float
    model: str
    shape: tuple[int, ...]
    input_name: str = "x"
    timeout_ms: int = 1000


class Traffic:
    """Send ``plan``'s load until stopped; keep what came back.

    Args:
        client: the client to send with (this thread's own; closed by :meth:`stop`).
        plan: rate, model, request shape, timeout.
        window_s: how far back :meth:`latencies_ms` looks.
    """

    def __init__(self, client: Client, plan: TrafficPlan, window_s: float = 10.0) -> None:
        self.client = client
        self.plan = plan
        self.window_s = window_s
        self._lock = threading.Lock()
        self._done: deque[tuple[float, float]] = deque()  # (answered at, latency ms)
        self.outcomes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="carpool-up-traffic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        clock = self.client.clock
        round_no = 0
        while not self._stop.is_set():
            items = arrivals(
                poisson(self.plan.rate_rps, ROUND_S),
                model=self.plan.model,
                shape=self.plan.shape,
                timeout_ms=self.plan.timeout_ms,
                seed=round_no,
            )
            round_no += 1
            if not items:  # (a low rate: no arrival this second)
                self._stop.wait(ROUND_S)
                continue
            samples = drive(
                self.client, items, synthetic_inputs(items, self.plan.input_name), clock=clock
            )
            now = clock.now()
            with self._lock:
                for s in samples:
                    self.outcomes[s.outcome] += 1
                    if s.outcome == "ok":
                        self._done.append((now, 1000.0 * s.latency_s))
                while self._done and self._done[0][0] < now - self.window_s:
                    self._done.popleft()

    def latencies_ms(self) -> list[float]:
        """The latencies of the requests answered in the last ``window_s``."""
        with self._lock:
            return [ms for _, ms in self._done]

    def figures(self) -> dict[str, Any]:
        with self._lock:
            outcomes = dict(self.outcomes)
        return {
            "rate_rps": self.plan.rate_rps,
            "model": self.plan.model,
            "sent": sum(outcomes.values()),
            "ok": outcomes.get("ok", 0),
            "errors": {k: v for k, v in sorted(outcomes.items()) if k != "ok"},
        }

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.client.close()
