"""simulator.py: a discrete-event simulation of a fleet around the real BrokerCore.

The broker is not modelled: the simulator feeds the same :class:`BrokerCore` (and so the
same batching policy, queues, shedding and ρ controller) that ``carpool broker`` runs,
with real protocol messages, on a simulated clock, and drives it as the server's loop
does: each event is one loop turn, ended with ``on_tick`` (which forms the batches the
turn allows). Workers are modelled: each runs one batch at a time, ``slots`` deep, for
``fixed_cost_s + per_sample_s·n`` (times a seeded jitter), reports its busy fraction ρ
like the real worker (same BusyMeter), and heartbeats. Clients are open loop: requests
are sent at their arrival times.

A worker may also have an ``overhead``: its own CPU per batch outside the engine
(receiving the BATCH, stacking inputs, building replies), which runs on the worker's
core after the engine's time, so the batch and the next one wait for it, and which its
RESULT reports as ``cpu_ms``; a ``host_busy_pct`` that its telemetry reports (the
broker weighs the overhead as it weighs a live worker's, docs/batching.md §3); and a
``transfer_s`` per batch, by which its RESULT reaches the broker after the batch ends
(or a delay drawn at random for each batch from ``transfer_draws_s``, a recorded
fleet's).

Not modelled: network and broker CPU time (the live fleet benchmark shows those).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, Outgoing, ToWorker
from carpool.common.clock import poll_timeout_ms
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    BatchMeta,
    BrokerBatch,
    Command,
    ModelSpec,
    Priority,
    Ready,
    ResultMeta,
    Submit,
    Telemetry,
    TensorMeta,
    WorkerHeartbeat,
    WorkerReady,
    WorkerResult,
    decode_from_broker,
    decode_from_worker,
    decode_meta,
    encode_request,
    header,
    pack,
)
from carpool.sim.workload import Arrival
from carpool.worker.core import BusyMeter


@dataclass(frozen=True, slots=True)
class EngineCost:
    """Batch cost ``fixed_cost_s + per_sample_s·n``, times a factor ~ N(1, jitter).

    With ``reference_items`` set, ``per_sample_s`` is the cost of a sample of that many
    elements and scales with the batch's item size (a 720p frame costs less than 1080p).
    """

    fixed_cost_s: float
    per_sample_s: float
    jitter: float = 0.0
    reference_items: int = 0

    def duration_s(self, samples: int, rng: random.Random, items: int = 0) -> float:
        per_sample = self.per_sample_s
        if self.reference_items and items:
            per_sample *= items / self.reference_items
        base = self.fixed_cost_s + per_sample * samples
        if self.jitter <= 0:
            return base
        return base * max(0.5, rng.gauss(1.0, self.jitter))


@dataclass(frozen=True, slots=True)
class SimWorker:
    name: str
    cost: EngineCost
    max_batch: int = 64
    slots: int = 2
    preferred_batch: tuple[int, ...] = ()
    # Its CPU per batch outside the engine (None: none), run after the engine's time.
    overhead: EngineCost | None = None
    # The host's CPU in use that its telemetry reports, 0..100 (None: not reported).
    host_busy_pct: float | None = None
    # Per batch, the time its messages spend between the broker and the worker beyond the
    # worker's CPU (transfers, hand-offs, a wait for a core): its RESULT reaches the
    # broker this long after the batch ends; the worker goes on meanwhile.
    transfer_s: float = 0.0
    # Per-batch delays to draw from at random instead of ``transfer_s`` (seconds; empty:
    # ``transfer_s`` for every batch): the spread of a recorded fleet's transfers.
    transfer_draws_s: tuple[float, ...] = ()


def rate_per_s(count: int, span_s: float) -> float:
    """``count`` events over ``span_s`` seconds as a rate (0 over no time)."""
    return count / span_s if span_s > 0 else 0.0


@dataclass(slots=True)
class SimResult:
    """What happened to every request of one simulated run."""

    label: str
    span_s: float  # the time the arrivals cover (or, all at one instant, the run)
    sent: int = 0
    ok: int = 0  # replies with outputs
    on_time: int = 0  # ... that arrived by the request's deadline
    errors: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)  # of replies with outputs
    batch_sizes: Counter[int] = field(default_factory=Counter)
    busy_s: float = 0.0  # engine time, all workers
    workers: int = 1
    end_s: float = 0.0  # simulated time of the last event
    broker: dict[str, object] = field(default_factory=dict)  # BrokerCore snapshot at the end

    @property
    def throughput_rps(self) -> float:
        return rate_per_s(self.ok, self.span_s)

    @property
    def goodput_rps(self) -> float:
        """Requests answered with outputs within their deadline, per second."""
        return rate_per_s(self.on_time, self.span_s)

    @property
    def miss_rate(self) -> float:
        return 1.0 - self.on_time / self.sent if self.sent else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return math.nan
        data = sorted(self.latencies_s)
        index = min(len(data) - 1, max(0, math.ceil(q / 100 * len(data)) - 1))
        return 1000 * data[index]

    @property
    def mean_batch(self) -> float:
        n = sum(self.batch_sizes.values())
        return sum(s * c for s, c in self.batch_sizes.items()) / n if n else 0.0

    @property
    def busy_share(self) -> float:
        """Engine time over the workers' time, until the last reply."""
        return self.busy_s / (self.workers * self.end_s) if self.end_s > 0 else 0.0


class _Worker:
    def __init__(self, spec: SimWorker, wid: bytes, rho_window_s: float) -> None:
        self.spec = spec
        self.wid = wid
        self.queue: deque[BatchMeta] = deque()
        self.running: BatchMeta | None = None
        self.started_s = 0.0
        self.duration_s = 0.0  # the engine's
        self.overhead_s = 0.0  # the worker's own CPU for the batch, after the engine
        self.meter = BusyMeter(rho_window_s)
        pct = spec.host_busy_pct
        self.telemetry = None if pct is None else Telemetry(host_cpu_pct=pct)


_ARRIVE, _FINISH, _HEARTBEAT, _RESULT, _TICK = range(5)


def simulate(
    arrivals: Sequence[Arrival],
    workers: Sequence[SimWorker],
    batching: BatchingConfig,
    *,
    label: str = "",
    seed: int = 0,
    heartbeat_s: float = 1.0,
    rho_window_s: float = 1.0,
    max_queued: int = 100_000,
) -> SimResult:
    """Run ``arrivals`` through a BrokerCore with ``batching`` and simulated ``workers``."""
    arrivals = sorted(arrivals, key=lambda a: a.t_s)  # (stable) time never runs backwards
    config = BrokerConfig(batching=batching, max_queued=max_queued)
    # One simulated client stands for all of them: it may hold the whole queue.
    config = dataclasses.replace(
        config, max_client_requests=max_queued, max_client_mib=config.max_queued_mib
    )
    run = _Run(BrokerCore(config), arrivals, SimResult(label, span_s(arrivals)), seed)
    run.register(workers, heartbeat_s, rho_window_s)
    run.loop(heartbeat_s)
    return run.finished()


class _Run:
    """One simulated run: the core, the simulated workers and client, and the event heap.
    Each event (an arrival, a batch that ends, a heartbeat, a wake-up the core asked for)
    is one loop turn: its message, then :meth:`end_turn`, as the server's loop ends each
    turn with a tick."""

    def __init__(
        self, core: BrokerCore, arrivals: list[Arrival], result: SimResult, seed: int
    ) -> None:
        self.core = core
        self.arrivals = arrivals
        self.result = result
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.workers: dict[bytes, _Worker] = {}
        self.sent_s: dict[int, float] = {}  # request id -> when it was sent
        self.deadline_s: dict[int, float] = {}
        self.payloads: dict[tuple[int, ...], bytes] = {}  # one zero payload per shape
        # The wake-up the last turn asked for (its number on the heap): a loop polls with
        # its last turn's timeout, so a wake-up an earlier turn asked for is void.
        self.tick = 0
        self.rid = 0
        self.now = 0.0

    def push(self, t: float, kind: int, data: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def register(
        self, workers: Sequence[SimWorker], heartbeat_s: float, rho_window_s: float
    ) -> None:
        """Each worker's READY at time 0, for every model as its arrivals have it (its
        rank, every dim dynamic), in one turn."""
        ranks: dict[str, int] = {}
        for arrival in self.arrivals:
            ranks.setdefault(arrival.model, len(arrival.shape))
        models = sorted(ranks) or ["synthetic"]
        self.result.workers = len(workers)
        for i, spec in enumerate(workers):
            wid = f"sim-{i}".encode()
            worker = self.workers[wid] = _Worker(spec, wid, rho_window_s)
            specs = tuple(
                ModelSpec(
                    m,
                    (TensorMeta("x", "float32", (-1,) * ranks.get(m, 2)),),
                    (TensorMeta("y", "float32", (-1,) * ranks.get(m, 2)),),
                    spec.max_batch,
                    spec.preferred_batch,
                )
                for m in models
            )
            ready = Ready(spec.name, spec.slots, specs, round(heartbeat_s * 1000))
            msg = decode_from_worker(WorkerReady(ready).to_frames())
            self.route(self.core.on_worker(0.0, wid, msg), 0.0)
            self.push(heartbeat_s, _HEARTBEAT, worker)
        self.route(self.core.on_tick(0.0), 0.0)  # (the turn ends as every turn does)

    def loop(self, heartbeat_s: float) -> None:
        """Take the events in time order until every request is answered, or the last
        deadline and a minute have passed."""
        arrivals = self.arrivals
        # Every request is answered by its deadline: wait for the last one's, and a minute.
        last_deadline_s = max((a.t_s + a.timeout_ms / 1000 for a in arrivals), default=0.0)
        horizon = last_deadline_s + 60.0
        index = 0
        events = self.events
        while index < len(arrivals) or self.sent_s:
            next_arrival = arrivals[index].t_s if index < len(arrivals) else math.inf
            if events and events[0][0] <= next_arrival:
                now, _, kind, data = heapq.heappop(events)
            else:
                now, kind, data = next_arrival, _ARRIVE, arrivals[index]
                index += 1
            self.now = now
            if now > horizon:
                break
            if kind == _ARRIVE:
                assert isinstance(data, Arrival)
                self.arrive(data, now)
            elif kind == _FINISH:
                assert isinstance(data, _Worker)
                self.finish(data, now)
            elif kind == _HEARTBEAT:
                assert isinstance(data, _Worker)
                self.heartbeat(data, now)
                if index < len(arrivals) or self.sent_s:
                    self.push(now + heartbeat_s, _HEARTBEAT, data)
            elif kind == _RESULT:
                assert isinstance(data, tuple)
                wid, msg = data
                self.route(self.core.on_worker(now, wid, msg), now)
            elif data != self.tick:
                continue  # a later turn asked for another wake-up
            self.end_turn(now)

    def end_turn(self, now: float) -> None:
        """Tick the core, as the server ends each loop turn, and put its next wake-up on
        the heap."""
        core = self.core
        self.route(core.on_tick(now), now)
        wake = core.next_wakeup(now)
        self.tick += 1  # (none asked for: the earlier ones are void all the same)
        if wake is not None:
            # When the broker's loop would wake: its poll waits whole milliseconds, rounded
            # up; and strictly later than now (the core was just ticked).
            wait_ms = poll_timeout_ms(wake - now) or 0
            wake = now + wait_ms / 1000 if wait_ms else now + 1e-6
            self.push(wake, _TICK, self.tick)

    def arrive(self, a: Arrival, now: float) -> None:
        """The client sends a request."""
        self.rid += 1
        rid = self.rid
        payload = self.payloads.get(a.shape)
        if payload is None:
            payload = self.payloads[a.shape] = bytes(4 * math.prod(a.shape))
        submit = Submit(
            rid,
            a.model,
            a.timeout_ms,
            (TensorMeta("x", "float32", a.shape),),
            Priority(a.priority),
        )
        self.sent_s[rid] = now
        self.deadline_s[rid] = now + a.timeout_ms / 1000
        self.result.sent += 1
        self.route(self.core.on_client(now, _CLIENT, encode_request(submit, [payload])), now)

    def heartbeat(self, worker: _Worker, now: float) -> None:
        beat = WorkerHeartbeat(worker.meter.rho(now), telemetry=worker.telemetry).to_frames()
        self.route(self.core.on_worker(now, worker.wid, decode_from_worker(beat)), now)

    def route(self, outgoing: list[Outgoing], now: float) -> None:
        """What the core sends: a BATCH goes to its worker's queue, a reply or error is
        counted."""
        result, sent_s = self.result, self.sent_s
        for out in outgoing:
            if isinstance(out, ToWorker):
                worker = self.workers.get(out.identity)
                # Through the wire form, as a worker on a socket gets it.
                msg = decode_from_broker(out.message.to_frames())
                if worker is not None and isinstance(msg, BrokerBatch):
                    batch = msg.batch
                    result.batch_sizes[batch.total_samples] += 1
                    worker.queue.append(batch)
                    if worker.running is None:
                        self.start(worker, now)
                continue
            meta = decode_meta(out.frames[1])
            rid = meta.get("id")
            if not isinstance(rid, int) or rid not in sent_s:
                continue
            if out.frames[0] == header(Command.REPLY):
                result.ok += 1
                result.latencies_s.append(now - sent_s[rid])
                if now <= self.deadline_s[rid] + 1e-9:
                    result.on_time += 1
            else:
                result.errors[ErrorCode(meta["code"]).name] += 1
            del sent_s[rid]

    def start(self, worker: _Worker, now: float) -> None:
        """``worker`` starts the next batch it holds."""
        batch = worker.queue.popleft()
        worker.running = batch
        worker.started_s = now
        items = math.prod(batch.inputs[0].shape[1:])
        samples = batch.total_samples
        worker.duration_s = worker.spec.cost.duration_s(samples, self.rng, items)
        overhead = worker.spec.overhead
        worker.overhead_s = 0.0 if overhead is None else overhead.duration_s(samples, self.rng)
        worker.meter.running_since = now
        self.push(now + worker.duration_s + worker.overhead_s, _FINISH, worker)

    def finish(self, worker: _Worker, now: float) -> None:
        """``worker``'s batch ends: its RESULT goes to the core, and it starts the next."""
        batch = worker.running
        assert batch is not None
        worker.running = None
        worker.meter.running_since = None
        worker.meter.add(worker.started_s, now)
        self.result.busy_s += worker.duration_s
        frames: list[bytes] = []
        for item in batch.items:
            frames += [header(Command.REPLY), pack({"id": item.request_id})]
        meta = ResultMeta(
            batch.batch_id,
            worker.meter.rho(now),
            1000 * worker.duration_s,
            tuple(2 for _ in batch.items),
            None,
            worker.telemetry,
            1000 * worker.overhead_s,
        )
        msg = decode_from_worker(WorkerResult(meta, frames).to_frames())
        draws = worker.spec.transfer_draws_s
        delay_s = draws[self.rng.randrange(len(draws))] if draws else worker.spec.transfer_s
        if delay_s > 0:
            self.push(now + delay_s, _RESULT, (worker.wid, msg))
        else:
            self.route(self.core.on_worker(now, worker.wid, msg), now)
        if worker.queue and worker.running is None:
            self.start(worker, now)

    def finished(self) -> SimResult:
        """The result, with what was never answered and the broker's last snapshot."""
        result, now = self.result, self.now
        for _ in self.sent_s:
            result.errors["NO_REPLY"] += 1
        result.end_s = now
        if result.span_s <= 0 and self.arrivals:  # all at one instant: per second of the run
            result.span_s = max(0.0, now - self.arrivals[0].t_s)
        result.broker = self.core.snapshot()
        return result


#: The one simulated client that sends every request.
_CLIENT = b"sim-client"


def span_s(arrivals: Sequence[Arrival]) -> float:
    """The time the arrivals cover: n arrivals, n gaps (one mean gap after the last, as
    the load generator counts), so that n arrivals at a steady rate r give n / r."""
    n = len(arrivals)
    if n < 2:
        return 0.0
    return (arrivals[-1].t_s - arrivals[0].t_s) * n / (n - 1)
