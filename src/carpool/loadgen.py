"""loadgen.py: an open-loop load generator for a live fleet.

Requests are sent at their scheduled times whatever the replies do, so a slow reply
cannot delay the next send and so hide its own latency (no coordinated omission). One
thread sends: between sends it waits for replies (the client's I/O thread receives
them) until the next send is due.
How late the generator itself sent against its schedule is recorded too: if that grows,
the generator, not the fleet, is the bottleneck.

``run`` measures a window after a warm-up (``carpool bench``, ``carpool replay``);
``run_open_loop`` returns a :class:`carpool.sim.simulator.SimResult`, so live and simulated
runs print alike (``bench/batching.py``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from carpool.client import Client, ReplyFuture, RequestError
from carpool.common.clock import Clock, MonotonicClock
from carpool.common.progress import Progress
from carpool.common.protocol import DTYPES, Priority
from carpool.sim.simulator import SimResult, rate_per_s
from carpool.sim.workload import Arrival

logger = logging.getLogger(__name__)

QUANTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
#: The send lag (p99) past which a run says the generator did not keep up.
LAG_TOLERANCE_MS = 5.0
#: The last stretch before a send is polled without waiting (a process woken from sleep
#: runs tens of microseconds late on small VMs).
_SPIN_S = 0.0002


@dataclass(slots=True)
class Sample:
    """One request as the generator saw it."""

    scheduled_s: float  # offset from the start of the run
    sent_s: float
    done_s: float = math.nan
    outcome: str = "pending"  # "ok" or an error code name
    deadline_s: float = math.inf  # the schedule's time + the timeout

    @property
    def latency_s(self) -> float:
        """From the time the request was due, not the time it went out: a generator
        that sends late (held up itself) must not hide that wait (coordinated omission).
        How late it sent is :attr:`lag_s`, reported on its own."""
        return self.done_s - self.scheduled_s

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.scheduled_s

    @property
    def on_time(self) -> bool:
        return self.outcome == "ok" and self.done_s <= self.deadline_s


@dataclass(slots=True)
class BenchReport:
    """Measurement-window figures of one run."""

    window_s: float  # the schedule's window, or the time the sends took if longer
    sent: int
    ok: int
    on_time: int
    errors: dict[str, int]
    latency_ms: dict[str, float]
    batch_sizes: dict[str, dict[int, int]]
    max_send_lag_ms: float
    halves_goodput_rps: tuple[float, float]
    stable: bool
    throughput_rps: float = 0.0  # answers with outputs per second of the window
    goodput_rps: float = 0.0  # ... of them within their deadline
    scheduled_rps: float = 0.0  # what the schedule asked for in the window
    sent_rps: float = 0.0  # what the generator sent at, from its send times
    p99_send_lag_ms: float = 0.0
    per_second: list[dict[str, float]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)  # only when asked to keep them
    # Padded models (protocol §8.1): model → bucket → {batches, samples, padded_share}
    # over the run (STATS ``buckets``, before and after).
    buckets: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def kept_up(self) -> bool:
        """Whether the generator sent on schedule (its rate within 2% of the schedule's,
        99% of sends within 5 ms): if not, the figures describe the generator."""
        if self.sent < 2:
            return True
        rate_ok = self.sent_rps >= 0.98 * self.scheduled_rps
        return rate_ok and self.p99_send_lag_ms <= LAG_TOLERANCE_MS

    def to_json(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "sent": self.sent,
            "ok": self.ok,
            "on_time": self.on_time,
            "throughput_rps": self.throughput_rps,
            "goodput_rps": self.goodput_rps,
            "errors": self.errors,
            "latency_ms": self.latency_ms,
            "batch_sizes": {
                m: {str(k): v for k, v in s.items()} for m, s in self.batch_sizes.items()
            },
            "max_send_lag_ms": self.max_send_lag_ms,
            "p99_send_lag_ms": self.p99_send_lag_ms,
            "scheduled_rps": self.scheduled_rps,
            "sent_rps": self.sent_rps,
            "kept_up": self.kept_up,
            "halves_goodput_rps": list(self.halves_goodput_rps),
            "stable": self.stable,
            "per_second": self.per_second,
            "buckets": self.buckets,
        }


def percentiles_ms(latencies_s: Sequence[float]) -> dict[str, float]:
    if not latencies_s:
        return {f"p{q:g}": math.nan for q in QUANTILES}
    values = np.percentile(np.asarray(latencies_s) * 1000, QUANTILES)
    return {f"p{q:g}": float(v) for q, v in zip(QUANTILES, values, strict=True)}


def summarize(
    samples: Sequence[Sample],
    warmup_s: float,
    end_s: float,
    batch_sizes: dict[str, dict[int, int]],
    *,
    drift_tolerance: float = 0.1,
) -> BenchReport:
    """Figures over requests scheduled in [warmup_s, end_s). Rates are per second of the
    window, or of the time the generator took to send its requests if that was longer
    (a generator that fell behind delivered less than its schedule asked for)."""
    window = [s for s in samples if warmup_s <= s.scheduled_s < end_s]
    scheduled_span = max(0.0, end_s - warmup_s)
    span = scheduled_span
    sent_rps = 0.0
    if len(window) > 1:
        sends = [s.sent_s for s in window]
        n = len(sends)
        # From the first send to one mean gap after the last (n sends, n gaps), as end_s.
        sent_span = (max(sends) - min(sends)) * n / (n - 1)
        if sent_span > 0:
            sent_rps = n / sent_span
        span = max(span, sent_span)
    ok = [s for s in window if s.outcome == "ok"]
    errors = Counter(s.outcome for s in window if s.outcome != "ok")
    mid = warmup_s + span / 2
    halves = (
        sum(1 for s in window if s.on_time and s.scheduled_s < mid) / (span / 2 or 1),
        sum(1 for s in window if s.on_time and s.scheduled_s >= mid) / (span / 2 or 1),
    )
    # (one request cannot drift: it falls in a half, and the other is "empty")
    stable = len(window) < 2 or abs(halves[0] - halves[1]) <= drift_tolerance * max(*halves, 1e-9)
    seconds: dict[int, list[Sample]] = {k: [] for k in range(math.ceil(scheduled_span))}
    for s in window:
        seconds.setdefault(int(s.scheduled_s - warmup_s), []).append(s)
    per_second = [  # by scheduled second; one without arrivals is a row of zeros
        {
            "second": float(k),
            "sent": float(len(v)),
            "goodput": float(sum(1 for s in v if s.on_time)),
            "p99_ms": percentiles_ms([s.latency_s for s in v if s.outcome == "ok"])["p99"],
        }
        for k, v in sorted(seconds.items())
    ]
    lags = [s.lag_s for s in window]
    on_time = sum(1 for s in ok if s.on_time)
    return BenchReport(
        window_s=span,
        sent=len(window),
        ok=len(ok),
        on_time=on_time,
        errors=dict(errors),
        latency_ms=percentiles_ms([s.latency_s for s in ok]),
        batch_sizes=batch_sizes,
        max_send_lag_ms=1000 * max(lags, default=0.0),
        halves_goodput_rps=halves,
        stable=stable,
        throughput_rps=rate_per_s(len(ok), span),
        goodput_rps=rate_per_s(on_time, span),
        per_second=per_second,
        scheduled_rps=len(window) / scheduled_span if scheduled_span > 0 else 0.0,
        sent_rps=sent_rps,
        p99_send_lag_ms=float(np.percentile(lags, 99)) * 1000 if lags else 0.0,
    )


def bucket_counts(stats: dict[str, Any]) -> dict[tuple[str, str], Counter[str]]:
    """STATS ``buckets`` as counters by (model, bucket)."""
    return {
        (model, label): Counter({k: int(v) for k, v in counts.items() if k != "padded_share"})
        for model, labels in stats.get("buckets", {}).items()
        for label, counts in labels.items()
    }


def bucket_report(
    before: dict[tuple[str, str], Counter[str]], after: dict[tuple[str, str], Counter[str]]
) -> dict[str, dict[str, dict[str, float]]]:
    """What a run added to each bucket: batches, samples and the padded share of compute."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (model, label), counts in sorted(after.items()):
        run = counts - before.get((model, label), Counter())
        if not run["batches"]:
            continue
        elements = run["bucket_elements"]
        out.setdefault(model, {})[label] = {
            "batches": run["batches"],
            "samples": run["samples"],
            "padded_share": run["padded_elements"] / elements if elements else 0.0,
        }
    return out


def _batch_sizes(stats: dict[str, Any]) -> dict[str, Counter[int]]:
    return {
        m: Counter({int(k): int(v) for k, v in sizes.items()})
        for m, sizes in stats.get("batch_sizes", {}).items()
    }


def drive(
    client: Client,
    arrivals: Sequence[Arrival],
    inputs: Sequence[dict[str, NDArray[Any]]],
    *,
    clock: Clock,
    progress: bool = False,
    start_delay_s: float = 0.05,
) -> list[Sample]:
    """Send every arrival at its time; collect outcomes until all are answered."""
    samples: list[Sample] = []
    pending: dict[int, tuple[ReplyFuture, Sample]] = {}
    start = clock.now() + start_delay_s
    total = len(arrivals)
    bar = Progress("sent", total) if progress and total else None
    i = 0
    try:
        while i < total or pending:
            now = clock.now()
            while i < total and start + arrivals[i].t_s <= now:
                a = arrivals[i]
                sent = clock.now()
                future = client.submit(
                    a.model, inputs[i], a.timeout_ms / 1000, priority=Priority(a.priority)
                )
                sample = Sample(a.t_s, sent - start, deadline_s=a.t_s + a.timeout_ms / 1000)
                samples.append(sample)
                if future.done():  # refused on the spot (the broker takes nothing)
                    _settle(future, sample, clock.now() - start)
                else:
                    pending[future.request_id] = (future, sample)
                i += 1
            wait_s = (start + arrivals[i].t_s - clock.now()) if i < total else 0.05
            # A poll waits whole milliseconds, rounded up: it would send up to 1 ms late, and
            # that lag counts in every latency. Wake a millisecond early instead, then wait
            # out the rest on the socket's descriptor, to the microsecond (no spinning).
            if i < total and wait_s < 0.001:
                completed = client.poll(0)
                left = start + arrivals[i].t_s - clock.now() - _SPIN_S
                if not completed and left > 0:
                    completed = _wait_readable(client, left)
            else:
                completed = client.poll(max(0.0, wait_s - 0.001) if i < total else wait_s)
            if completed:
                done = clock.now() - start
                for rid in [rid for rid, (f, _) in pending.items() if f.done()]:
                    future, sample = pending.pop(rid)
                    _settle(future, sample, done)
            if bar is not None:
                bar.update(i, f"{len(pending)} in flight")
    finally:
        if bar is not None:
            bar.close()
    return samples


def _wait_readable(client: Any, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` (to the microsecond) for a future to complete; returns
    the number completed. A :class:`Client`'s poll waits so (its I/O thread wakes it,
    where a zmq poll waits whole milliseconds); another client (a test's) polls
    without waiting."""
    completed: int = client.poll(timeout_s if isinstance(client, Client) else 0)
    return completed


def _settle(future: ReplyFuture, sample: Sample, done_s: float) -> None:
    sample.done_s = done_s
    try:
        future.result(0)
        sample.outcome = "ok"
    except RequestError as exc:
        sample.outcome = exc.code.name


def run(
    endpoint: str,
    arrivals: Sequence[Arrival],
    inputs: Sequence[dict[str, NDArray[Any]]],
    *,
    warmup_s: float,
    progress: bool = False,
    clock: Clock | None = None,
    keep: bool = False,
    end_s: float | None = None,
    shared_memory: int = 0,
    stats_timeout_s: float | None = None,
) -> BenchReport:
    """One open-loop run against a live broker (``keep`` keeps every sample;
    ``shared_memory``: bytes of a /dev/shm region for large inputs and outputs, §5.4-5.5,
    for a fleet on this host; ``stats_timeout_s``: how long each STATS waits for its
    answer, None for :func:`first_stats`'s and ``Client.stats``'s own)."""
    clock = clock or MonotonicClock()
    shm: dict[str, Any] = (
        {"shared_memory": shared_memory, "shared_memory_outputs": True} if shared_memory else {}
    )
    # send_timeout_s=0: a send never waits for room (that wait would hold up every later
    # send); a request the broker does not take fails UNAVAILABLE at once.
    with Client(endpoint, grace_s=1.0, send_timeout_s=0.0, **shm) as client:
        # TimeoutError: no broker, nothing run.
        if stats_timeout_s is None:
            first = first_stats(client)
        else:
            first = first_stats(client, timeout_s=stats_timeout_s)
        before = _batch_sizes(first)
        samples = drive(client, arrivals, inputs, clock=clock, progress=progress)
        try:
            if stats_timeout_s is None:
                last = client.stats()
            else:
                last = client.stats(timeout_s=stats_timeout_s)
            after: dict[str, Counter[int]] | None = _batch_sizes(last)
        except TimeoutError:  # the broker went away during the run: keep what was measured
            logger.warning("the broker did not answer STATS after the run: no batch sizes")
            last, after = {}, None
    sizes = {} if after is None else {m: dict(after[m] - before.get(m, Counter())) for m in after}
    if end_s is None:
        end_s = schedule_end(arrivals, samples)
    report = summarize(samples, warmup_s, end_s, sizes)
    report.buckets = bucket_report(bucket_counts(first), bucket_counts(last))
    if keep:
        report.samples = samples
    return report


def first_stats(client: Client, tries: int = 3, timeout_s: float = 3.0) -> dict[str, Any]:
    """The broker's STATS before a run, asked up to ``tries`` times (each waits
    ``timeout_s``): one answer lost or late (a broker still starting, a host busy for a
    few seconds) does not end the run before it began.

    Raises:
        TimeoutError: no answer to any of them (no broker at the endpoint).
    """
    for attempt in range(1, tries):
        try:
            return client.stats(timeout_s=timeout_s)
        except TimeoutError:  # noqa: PERF203 (three tries, each seconds long)
            logger.info("no STATS answer in %g s (try %d of %d)", timeout_s, attempt, tries)
    return client.stats(timeout_s=timeout_s)


def schedule_end(arrivals: Sequence[Arrival], samples: Sequence[Sample] = ()) -> float:
    """Where the measurement window of a trace ends: one mean gap after the last arrival
    (n arrivals, n gaps). A trace with no gap to go by (one arrival, or all at time 0)
    ended at its last arrival, and the window [0, end) held none of them ("no request was
    sent"): its window runs to the last answer instead, so its rates are per second of the
    run, as the simulator counts a trace at one instant."""
    n = len(arrivals)
    if n == 0:
        return 0.0
    last = arrivals[-1].t_s
    if n > 1 and last > 0:
        return last * n / (n - 1)
    done = [s.done_s for s in samples if math.isfinite(s.done_s)]
    return max([math.nextafter(last, math.inf), *done])


def synthetic_inputs(
    arrivals: Sequence[Arrival], name: str = "x", dtype: str = "float32"
) -> list[dict[str, NDArray[Any]]]:
    """One input of each arrival's shape (ones; one array per shape), e.g. for a
    SyntheticEngine."""
    cache: dict[tuple[int, ...], NDArray[Any]] = {}
    out = []
    for a in arrivals:
        x = cache.get(a.shape)
        if x is None:
            x = cache[a.shape] = np.ones(a.shape, DTYPES[dtype])
        out.append({name: x})
    return out


@dataclass(slots=True)
class LiveResult:
    result: SimResult
    max_send_lag_ms: float


def run_open_loop(endpoint: str, arrivals: Sequence[Arrival], *, label: str = "live") -> LiveResult:
    """Send ``arrivals`` (all measured, no warm-up) and report them as a SimResult."""
    report = run(endpoint, arrivals, synthetic_inputs(arrivals), warmup_s=0.0, keep=True)
    result = SimResult(label, report.window_s)
    result.sent = report.sent
    result.ok = report.ok
    result.on_time = report.on_time
    result.errors.update(report.errors)
    result.latencies_s = [s.latency_s for s in report.samples if s.outcome == "ok"]
    for sizes in report.batch_sizes.values():
        result.batch_sizes.update(sizes)
    return LiveResult(result, report.max_send_lag_ms)
