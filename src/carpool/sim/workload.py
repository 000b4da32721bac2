"""workload.py: arrival schedules — Poisson, steps, bursts, diurnal, or a recorded trace.

Pure and seeded: the same arguments give the same arrivals. An arrival is a time offset in
seconds from the start, with its model, item shape, relative timeout and priority. A trace
file is JSON lines, one arrival per line::

    {"t_s": 0.0123, "model": "synthetic", "shape": [1, 16], "timeout_ms": 50, "priority": 0}
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from carpool.common.errors import ConfigError
from carpool.common.jsonlines import parses

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Arrival:
    t_s: float
    model: str
    shape: tuple[int, ...]  # full request shape; dim 0 = samples
    timeout_ms: int
    priority: int = 0
    # The largest batch a live worker of the model took when it arrived (carpool record
    # writes it); 0: not known.
    max_batch: int = 0

    def to_json(self) -> str:
        line: dict[str, object] = {
            "t_s": round(self.t_s, 6),
            "model": self.model,
            "shape": list(self.shape),
            "timeout_ms": self.timeout_ms,
            "priority": self.priority,
        }
        if self.max_batch:
            line["max_batch"] = self.max_batch
        return json.dumps(line)

    def with_timeout(self, timeout_ms: int) -> Arrival:
        return dataclasses.replace(self, timeout_ms=timeout_ms)


@dataclass(frozen=True, slots=True)
class Phase:
    """``rate_rps`` arrivals per second for ``duration_s``."""

    duration_s: float
    rate_rps: float


def _poisson_times(phases: Sequence[Phase], rng: random.Random) -> list[float]:
    times: list[float] = []
    start = 0.0
    for phase in phases:
        t = start
        end = start + phase.duration_s
        if phase.rate_rps > 0:
            while True:
                t += rng.expovariate(phase.rate_rps)
                if t >= end:
                    break
                times.append(t)
        start = end
    return times


def poisson(rate_rps: float, duration_s: float) -> list[Phase]:
    return [Phase(duration_s, rate_rps)]


def steps(rates_rps: Sequence[float], step_s: float) -> list[Phase]:
    """Piecewise-constant load: each rate for ``step_s``."""
    return [Phase(step_s, r) for r in rates_rps]


def bursts(
    base_rps: float, burst_rps: float, duration_s: float, period_s: float, burst_s: float
) -> list[Phase]:
    """``base_rps``, with ``burst_rps`` for ``burst_s`` at the end of every ``period_s``."""
    if not period_s > 0 or not 0 <= burst_s <= period_s:
        # (a period of 0 never ended; a burst longer than its period made time go back)
        raise ConfigError(f"bursts need 0 <= burst_s ({burst_s}) <= period_s ({period_s}) > 0")
    phases: list[Phase] = []
    t = 0.0
    while t < duration_s - 1e-9:
        quiet = min(period_s - burst_s, duration_s - t)
        phases.append(Phase(quiet, base_rps))
        t += quiet
        if t < duration_s - 1e-9:
            loud = min(burst_s, duration_s - t)
            phases.append(Phase(loud, burst_rps))
            t += loud
    return phases


def diurnal(low_rps: float, high_rps: float, duration_s: float, pieces: int = 12) -> list[Phase]:
    """A day squeezed into ``duration_s``: a sinusoid between low and high, in steps."""
    out = []
    for i in range(pieces):
        phase = (i + 0.5) / pieces
        rate = low_rps + (high_rps - low_rps) * 0.5 * (1 - math.cos(2 * math.pi * phase))
        out.append(Phase(duration_s / pieces, rate))
    return out


def arrivals(
    phases: Sequence[Phase],
    *,
    model: str = "synthetic",
    shape: tuple[int, ...] = (1, 16),
    timeout_ms: int = 50,
    bulk_share: float = 0.0,
    seed: int = 0,
) -> list[Arrival]:
    """Poisson arrivals over ``phases``; a ``bulk_share`` of them at bulk priority."""
    rng = random.Random(seed)
    return [
        Arrival(t, model, shape, timeout_ms, 1 if rng.random() < bulk_share else 0)
        for t in _poisson_times(phases, rng)
    ]


def duration_of(items: Sequence[Arrival]) -> float:
    return items[-1].t_s if items else 0.0


def write_trace(path: str | Path, items: Iterable[Arrival]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for a in items:
            f.write(a.to_json() + "\n")


def check_arrival(a: Arrival) -> None:
    """The limits of the wire protocol, so a bad trace fails on reading, not mid-replay
    (a ValueError says which)."""
    if not math.isfinite(a.t_s) or a.t_s < 0:
        raise ValueError(f"t_s must be a finite time >= 0, got {a.t_s}")
    if not 1 <= len(a.shape) <= 8 or any(d < 1 for d in a.shape):
        raise ValueError(f"shape must have 1..8 dims, each >= 1, got {list(a.shape)}")
    if not 1 <= a.timeout_ms <= 3_600_000:
        raise ValueError(f"timeout_ms must be in 1..3600000, got {a.timeout_ms}")
    if a.max_batch < 0:
        raise ValueError(f"max_batch must be >= 1 where given, got {a.max_batch}")
    if a.priority not in (0, 1):
        raise ValueError(f"priority must be 0 or 1, got {a.priority}")
    if not a.model:
        raise ValueError("model must be a non-empty name")


def read_trace(path: str | Path) -> list[Arrival]:
    """Read a JSON-lines trace; times are made relative to the first arrival."""
    out: list[Arrival] = []
    try:
        with open(path, "rb") as f:  # decoded line by line, so a bad byte names its line
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(
                        f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x}): "
                        "a trace is JSON lines"
                    ) from None
                if not line.strip():
                    continue
                if not line.endswith("\n") and not parses(line):
                    # A last line cut short (the recording broker was killed, or its
                    # disk filled): lost, the rest of the trace is good.
                    logger.warning("%s:%d: skipping a last line cut short", path, lineno)
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict) or not isinstance(obj.get("shape"), list):
                        raise TypeError("a line is a map whose shape is a list of ints")
                    arrival = Arrival(
                        float(obj["t_s"]),
                        str(obj["model"]),
                        tuple(int(d) for d in obj["shape"]),
                        int(obj["timeout_ms"]),
                        int(obj.get("priority", 0)),
                        int(obj.get("max_batch", 0)),
                    )
                    check_arrival(arrival)
                    out.append(arrival)
                except (ValueError, KeyError, TypeError) as exc:
                    raise ConfigError(f"{path}:{lineno}: not a trace line ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from None
    out.sort(key=lambda a: a.t_s)
    if out:
        t0 = out[0].t_s
        out = [dataclasses.replace(a, t_s=a.t_s - t0) for a in out]
    return out


def engine_limit(items: Iterable[Arrival]) -> int | None:
    """The largest batch the recording fleet's engines took (the smallest recorded over
    the trace, so no model's limit is exceeded); None when the trace does not say."""
    limits = [a.max_batch for a in items if a.max_batch > 0]
    return min(limits) if limits else None


#: Arrivals a trace needs before a simulation can say anything about it: one request
#: gives no rate (its "throughput" is one over its own latency) and no batch to form.
MIN_SIMULATED_ARRIVALS = 2


def load_trace(path: str | Path, at_least: int = 1) -> list[Arrival]:
    """:func:`read_trace`, refusing (ConfigError) a trace of fewer than ``at_least``
    arrivals."""
    items = read_trace(path)
    if not items:
        raise ConfigError(f"trace {path} has no arrivals")
    if len(items) < at_least:
        raise ConfigError(
            f"trace {path} has only {len(items)} arrival{'s' if len(items) > 1 else ''}: a "
            f"simulation needs at least {at_least} to measure a rate or form a batch"
        )
    gap_s, at_s = longest_gap(items)
    if gap_s >= GAP_WARN_S:
        logger.warning(
            "trace %s has no arrival for %.0f s (from %.1f s in): several recordings "
            "appended to one file, or a broker that was down? Rates and the settings "
            "chosen count that time as idle; record each run to a file of its own.",
            path,
            gap_s,
            at_s,
        )
    return items


#: A pause in a trace that long is worth a word (``load_trace``).
GAP_WARN_S = 60.0


def longest_gap(items: Sequence[Arrival]) -> tuple[float, float]:
    """The longest time between consecutive arrivals (sorted), and where it starts."""
    best = (0.0, 0.0)
    for a, b in itertools.pairwise(items):
        if b.t_s - a.t_s > best[0]:
            best = (b.t_s - a.t_s, a.t_s)
    return best
