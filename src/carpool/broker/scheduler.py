"""scheduler.py: BatchScheduler — the broker's queues, and how and where batches leave them.

The first layer of :class:`carpool.broker.core.BrokerCore` (pure: ``now`` comes in, no
sockets or clocks): the broker's state (queues, deadlines, in-flight batches, workers'
lanes, counters), the pump that asks each queue's policy whether a batch leaves now,
sheds requests that cannot make their deadline, and picks the worker (credits, predicted
backlog, batch limit) and builds its BATCH; the typed error replies; the STATS snapshot.
``carpool.broker.admission`` adds what comes in from clients on top, ``core`` what
comes from workers and the clock. Layers of one class rather than objects that call each
other: every message runs through all three, and these paths were measured per call.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from carpool.broker.adaptive import AdaptiveConfig, BatchSizeController
from carpool.broker.batcher import (
    ClientId,
    DeadlineHeap,
    PendingRequest,
    RequestKey,
    RequestQueue,
    RequestState,
)
from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.policy import (
    BatchPolicy,
    Capacity,
    DeadlinePolicy,
    Dispatch,
    FixedPolicy,
    QueueView,
)
from carpool.broker.registry import Lane, WorkerId, WorkerRegistry, WorkerState
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    MAX_TIMEOUT_MS,
    BatchItem,
    BatchMeta,
    Command,
    ErrorReply,
    Frame,
    TensorMeta,
    batch_frames,
    batch_inputs_wire,
    batch_item_wire,
    batch_wire,
    encode_error,
    header,
)

logger = logging.getLogger(__name__)


class Side(Enum):
    FRONTEND = "frontend"  # clients
    BACKEND = "backend"  # workers


@dataclass(slots=True)
class Outgoing:
    """One message to send: to ``identity`` on the ROUTER of ``side``. (Not frozen: one is
    made per reply, and a frozen dataclass's ``__init__`` costs ~4 x a plain one.)"""

    side: Side
    identity: bytes
    frames: Sequence[Any]


#: Routing-id prefixes of workers the server connects without ZeroMQ: in its process
#: (``EMBEDDED_ID`` + n) and on its local unix endpoint (``LINK_ID`` + n). ZeroMQ's own
#: ids are 5 bytes (a zero byte and a counter), so it never makes these.
EMBEDDED_ID, LINK_ID = b"\x00embedded-", b"\x00link-"

# Read on every request: on CPython 3.11 ``Enum.MEMBER`` costs ~85 ns a read, a global ~15.
_FRONTEND, _BACKEND = Side.FRONTEND, Side.BACKEND
_QUEUED, _DISPATCHED, _DONE = RequestState.QUEUED, RequestState.DISPATCHED, RequestState.DONE


@dataclass(slots=True)
class InflightBatch:
    batch_id: int
    worker: WorkerId
    requests: list[PendingRequest]
    key: RequestKey  # key[0] is the model
    samples: int
    predicted_s: float  # the cost model's duration estimate at dispatch


class BrokerStats:
    """Counters for STATS replies and tests."""

    def __init__(self) -> None:
        self.requests = 0
        self.replies = 0
        self.errors: Counter[str] = Counter()
        self.batch_sizes: dict[str, Counter[int]] = {}
        self.undeliverable = 0
        self.requeued = 0
        self.late_results = 0
        self.shed = 0  # answered DEADLINE_EXCEEDED before reaching a worker (hopeless)

    def batch(self, model: str, samples: int) -> None:
        sizes = self.batch_sizes.get(model)
        if sizes is None:  # (setdefault would build a Counter every call)
            sizes = self.batch_sizes[model] = Counter()
        sizes[samples] += 1


#: A BATCH's header frame, built once.
_BATCH_HEADER = header(Command.BATCH)


class BatchScheduler:
    """The broker's state and its batching; see the module docstring."""

    def __init__(self, config: BrokerConfig | None = None, *, defer_pumps: bool = False) -> None:
        self.config = config or BrokerConfig()
        # Deferred: messages only queue work and mark what changed; on_tick forms batches
        # once per loop turn for everything that arrived in it (the server's mode: a burst
        # of arrivals leaves as one batch, and the batching policy runs once per queue
        # per turn instead of once per message). Otherwise each message pumps at once.
        self.defer_pumps = defer_pumps
        self._dirty: dict[RequestKey, None] = {}
        self._dirty_models: set[str] = set()
        self.registry = WorkerRegistry(liveness=self.config.liveness)
        self.stats = BrokerStats()
        self._queues: dict[RequestKey, RequestQueue] = {}
        # When each queue's policy next wants a look (absent: waits for a worker or arrival).
        self._wake_s: dict[RequestKey, float] = {}
        self._deadlines = DeadlineHeap()
        self._inflight: dict[int, InflightBatch] = {}
        self._policies: dict[str, BatchPolicy] = {}
        # Each model's batching settings ([models.X] over [batching]), merged once: the
        # config does not change under a core, and the merge is a dataclasses.replace.
        self._batching: dict[str, BatchingConfig] = {}
        self._seq = 0
        self._batch_seq = 0
        self.queued = 0
        self.queued_bytes = 0  # payload bytes of the queued requests
        # Queued samples per model, by priority (interactive, bulk): admission estimates.
        self._queued_samples: dict[str, list[int]] = {}
        # Arrival trace (time, model, shape, timeout_ms, priority, the largest batch a
        # live worker of the model takes) while recording; the shell writes it out
        # (carpool record).
        self.recording: list[tuple[float, str, tuple[int, ...], int, int, int]] | None = None
        # Set by begin_stop: new requests are refused and nothing more is dispatched.
        self.stopping = False
        # When the broker began serving (the server sets it): for register_grace_s after
        # it, a model no worker has registered yet is UNAVAILABLE, not NOT_FOUND.
        self.started_s = -math.inf
        self._inputs_cache: dict[RequestKey, list[dict[str, Any]]] = {}
        self._local_inputs: dict[RequestKey, tuple[TensorMeta, ...]] = {}
        # Workers in this process (the server's embedded workers): their BATCH and RESULT
        # metas pass as BatchMeta / ResultMeta objects, not msgpack (protocol.md §1).
        self.local_workers: set[bytes] = set()
        self._sweep_s = 0.0  # when on_tick next looks for idle queues to forget
        # Best-case fleet throughput per key (samples/s, 0 = unknown) for admission.
        self._fleet_rates: dict[RequestKey, float] = {}

    # ------------------------------------------------------------------ batching

    def _queue(self, key: RequestKey) -> RequestQueue:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = RequestQueue(key)
        return queue

    def _policy(self, model: str) -> BatchPolicy:
        policy = self._policies.get(model)
        if policy is None:
            cfg = self._batching_for(model)
            if cfg.policy == "carpool":
                policy = DeadlinePolicy(cfg.max_batch, cfg.max_wait_s, cfg.margin_s)
            else:
                policy = FixedPolicy(cfg.max_batch, cfg.max_wait_s)
            self._policies[model] = policy
        return policy

    def _batching_for(self, model: str) -> BatchingConfig:
        cfg = self._batching.get(model)
        if cfg is None:
            cfg = self._batching[model] = self.config.batching_for(model)
        return cfg

    def _lane(self, model: str, engine_max: int, preferred: Sequence[int]) -> Lane:
        cfg = self._batching_for(model)
        controller = None
        if cfg.policy != "fixed":
            adaptive = AdaptiveConfig(
                target_rho=cfg.target_rho,
                learning_rate=cfg.learning_rate,
                interval_s=cfg.adapt_interval_s,
                rule="seed" if cfg.policy == "seed" else "goodput",
            )
            controller = BatchSizeController(
                min(engine_max, cfg.max_batch), preferred, config=adaptive
            )
        return Lane(controller, engine_max, min(engine_max, cfg.max_batch))

    def _on_load(self, now: float, worker: WorkerState, rho: float) -> None:
        worker.rho = rho
        for lane in worker.lanes.values():
            lane.on_load(now, rho)

    def _enqueued(self, req: PendingRequest) -> None:
        self.queued += 1
        self.queued_bytes += req.nbytes
        per_model = self._queued_samples.setdefault(req.model, [0, 0])
        per_model[req.priority] += req.samples

    def _dequeued(self, req: PendingRequest) -> None:
        self.queued -= 1
        self.queued_bytes -= req.nbytes
        self._queued_samples[req.model][req.priority] -= req.samples

    def _samples_ahead(self, model: str, priority: int) -> int:
        """Queued samples a new request of ``priority`` waits behind (at most)."""
        interactive, bulk = self._queued_samples.get(model, (0, 0))
        return interactive if priority == 0 else interactive + bulk

    def _ready_in_s(self, now: float, worker: WorkerState) -> float:
        """Predicted time until ``worker`` has finished the batches it holds."""
        return max(0.0, worker.free_at_s - now) if worker.outstanding else 0.0

    def _replan(self, now: float, worker: WorkerState) -> None:
        """A batch just ended at ``now``: the worker's queue restarts from here."""
        worker.free_at_s = now + sum(
            self._inflight[b].predicted_s for b in worker.outstanding if b in self._inflight
        )

    def _capacity(self, now: float, worker: WorkerState, key: RequestKey) -> Capacity:
        lane = worker.lanes[key[0]]
        return Capacity(
            lane.batch_limit, self._ready_in_s(now, worker), lane.cost(key), lane.max_batch
        )

    def _drain_time_s(self, model: str, key: RequestKey, samples: int) -> float:
        """Best-case time for the fleet to get through ``samples`` of ``model``: every
        worker running full batches back to back. 0 while any cost is still unknown."""
        rate_sps = self._fleet_rates.get(key)
        if rate_sps is None:
            rate_sps = self._fleet_rates[key] = self._fleet_rate_sps(model, key)
        return samples / rate_sps if rate_sps > 0 else 0.0

    def _fleet_rate_sps(self, model: str, key: RequestKey) -> float:
        """Samples/s of all workers of ``model`` at full batches; 0 if any cost is unknown.
        Cached per key until a cost is refitted or a worker joins or leaves."""
        cap = self._batching_for(model).max_batch
        rate_sps = 0.0
        for w in self.registry.serving(model):
            lane = w.lanes[model]
            cost = lane.cost(key)
            size = min(cap, lane.max_batch)
            duration_s = cost.estimate(size)
            if not cost.calibrated or duration_s <= 0:
                return 0.0
            rate_sps += size / duration_s
        return rate_sps

    def _pump_models(self, now: float, models: Iterable[str], out: list[Outgoing]) -> None:
        if self.defer_pumps:
            # Only models with requests waiting: an arrival marks its own queue, and a
            # model marked with nothing queued would cost the loop an empty turn.
            queued = self._queued_samples
            for model in models:
                waiting = queued.get(model)
                if waiting is not None and (waiting[0] or waiting[1]):
                    self._dirty_models.add(model)
            return
        names = set(models)
        for queue in list(self._queues.values()):
            if queue.key[0] in names and queue.count:
                self._pump(now, queue, out)

    def _pump_dirty(self, now: float, out: list[Outgoing]) -> None:
        """Deferred mode: pump, once each, the queues that messages touched since the last
        turn (arrivals, and every queue of a model whose workers changed)."""
        if self._dirty_models:
            models, self._dirty_models = self._dirty_models, set()
            for known in self._queues.values():
                if known.key[0] in models and known.count:
                    self._dirty[known.key] = None
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, {}
        for key in dirty:
            queue = self._queues.get(key)
            if queue is not None:
                self._pump(now, queue, out)

    def _view(
        self, now: float, queue: RequestQueue, head: PendingRequest, urgent: PendingRequest
    ) -> QueueView:
        """What the policy sees of a queue; its arrival rate is shared among the workers."""
        workers = max(1, len(self.registry.serving(queue.key[0])))
        return QueueView(
            queue.samples, head.arrival_s, urgent.deadline_s, queue.arrival_sps(now) / workers
        )

    def _idle_workers(self, model: str, worker: WorkerState, samples: int, most: int) -> int:
        """Workers of ``model`` that could start a batch now (``worker`` included, 1 if it
        is busy itself), counted only up to ``most``."""
        workers = self.registry.serving(model)
        if most <= 1 or worker.outstanding or len(workers) < 2:
            return 1
        idle = 0
        for w in workers:
            if not w.outstanding and w.lanes[model].max_batch >= samples:
                idle += 1
                if idle >= most:
                    break
        return max(1, idle)

    def _shed(
        self,
        now: float,
        queue: RequestQueue,
        out: list[Outgoing],
        caps: dict[WorkerId, Capacity],
    ) -> float | None:
        """Answer the queue's hopeless requests now; return when the next one turns
        hopeless (None if that cannot be predicted). ``caps`` collects the workers'
        capacities for the rest of the pump."""
        model = queue.key[0]
        policy = self._policy(model)
        workers = self.registry.serving(model)
        if not policy.edf or not workers or queue.count == 0:
            return None
        # Hopeless against the best worker: its earliest start plus the smallest batch the
        # policy would run there.
        key = queue.key
        lead_s = math.inf
        for w in workers:
            capacity = caps.get(w.wid)
            if capacity is None:
                capacity = caps[w.wid] = self._capacity(now, w, key)
            lead_s = min(lead_s, policy.shed_before(now, capacity) - now)
        if lead_s <= 0:
            return None
        for req in queue.shed(now + lead_s):
            self._dequeued(req)
            _finish(req, RequestState.EXPIRED)
            self.stats.shed += 1
            msg = "deadline cannot be met: predicted completion lies past it"
            out.append(self._request_error(req, ErrorCode.DEADLINE_EXCEEDED, msg))
        nxt = queue.earliest_deadline()
        return None if nxt is None else nxt.deadline_s - lead_s

    def _pump(self, now: float, queue: RequestQueue, out: list[Outgoing]) -> None:
        """Shed what cannot make it, then send every batch the policy lets leave now."""
        model = queue.key[0]
        policy = self._policy(model)
        self._wake_s.pop(queue.key, None)
        # Events can outrun ticks: never send a request whose deadline has already passed.
        for key in self._expire(now, out):
            if key != queue.key:
                self._wake_s[key] = now  # the next tick looks at what was behind it
        # Capacities of this pump, per worker, until that worker takes a batch.
        caps: dict[WorkerId, Capacity] = {}
        shed_at = self._shed(now, queue, out, caps)
        released = 0  # samples the policy let leave now, still to share among idle workers
        while True:
            head = queue.head()
            if head is None:
                return
            worker = self.registry.best_free(model, 1)
            if worker is None:
                # A RESULT, READY or worker loss will pump again; meanwhile shed on time.
                if shed_at is not None:
                    self._wake_s[queue.key] = shed_at
                return
            capacity = caps.get(worker.wid) or self._capacity(now, worker, queue.key)
            # The request the batch starts with, and the most urgent one it must respect.
            promote_s = 0.0
            if policy.edf:
                promote_s = (
                    2 * (capacity.cost.estimate(capacity.max_batch) + capacity.ready_in_s) + 0.01
                )
                first = queue.next_edf(now, promote_s)
                urgent = queue.earliest_deadline()
            else:
                first = urgent = head
            assert first is not None  # the queue is not empty
            assert urgent is not None
            if worker.lanes[model].max_batch < first.samples:
                bigger = self.registry.best_free(model, first.samples)
                if bigger is None:
                    if self.registry.max_batch(model) < first.samples:
                        # The worker that could take it has left: answer it now, not let
                        # everything behind it wait for its deadline.
                        self._unservable(queue, first, out)
                        continue
                    # Only a busy worker can take it; its RESULT pumps again, and shedding
                    # keeps its own time.
                    if shed_at is not None:
                        self._wake_s[queue.key] = shed_at
                    return
                worker, capacity = bigger, self._capacity(now, bigger, queue.key)
            engine_max = worker.lanes[model].max_batch
            if released > 0:
                # The policy already let these leave now; this idle worker takes its share.
                leaving = released
            else:
                view = self._view(now, queue, head, urgent)
                decision = policy.decide(now, view, capacity)
                if not isinstance(decision, Dispatch):
                    wake = decision.t if shed_at is None else min(decision.t, shed_at)
                    self._wake_s[queue.key] = wake
                    return
                # A request larger than the policy's size still travels alone rather than
                # starve; `first` is taken first either way, so a batch is never empty.
                leaving = min(engine_max, max(decision.max_samples, first.samples))
            size = leaving
            if policy.share_idle:
                # Several workers idle: each takes a share of what leaves now (workers run in
                # parallel, so a batch each ends sooner than all of it on one worker).
                leaving = min(leaving, queue.samples)
                idle = self._idle_workers(model, worker, first.samples, leaving)
                size = min(engine_max, max(first.samples, -(-leaving // idle)))
            requests = queue.take_edf(size, now, promote_s) if policy.edf else queue.take(size)
            for req in requests:
                self._dequeued(req)
            released = (
                max(0, leaving - sum(r.samples for r in requests)) if policy.share_idle else 0
            )
            if policy.edf and capacity.cost.calibrated:
                requests = self._drop_doomed(now, requests, capacity, out)
                if not requests:
                    continue
            out.append(self._dispatch(now, worker, queue.key, requests, capacity))
            caps.pop(worker.wid, None)  # its backlog and credits changed

    def _unservable(self, queue: RequestQueue, req: PendingRequest, out: list[Outgoing]) -> None:
        """Answer a queued request larger than any live worker of its model takes (it was
        admitted, or requeued, while a larger worker served the model)."""
        msg = (
            f"request has {req.samples} samples; no live worker of model {req.model!r} "
            f"takes more than {self.registry.max_batch(req.model)} per batch now"
        )
        self._answer_queued(queue, req, ErrorCode.UNAVAILABLE, msg, out)

    def _answer_queued(
        self,
        queue: RequestQueue,
        req: PendingRequest,
        code: ErrorCode,
        message: str,
        out: list[Outgoing],
    ) -> None:
        """Take a request out of its queue and answer it with an error."""
        queue.forget(req)
        self._dequeued(req)
        _finish(req, RequestState.FAILED)
        out.append(self._request_error(req, code, message))

    def _drop_doomed(
        self, now: float, requests: list[PendingRequest], capacity: Capacity, out: list[Outgoing]
    ) -> list[PendingRequest]:
        """Answer now the members of a batch that would finish past their deadline."""
        done_s = (
            now + capacity.ready_in_s + capacity.cost.estimate(sum(r.samples for r in requests))
        )
        keep = [r for r in requests if r.deadline_s >= done_s]
        if len(keep) < len(requests):
            msg = "deadline cannot be met: predicted completion lies past it"
            for req in requests:
                if req.deadline_s < done_s:
                    _finish(req, RequestState.EXPIRED)
                    self.stats.shed += 1
                    out.append(self._request_error(req, ErrorCode.DEADLINE_EXCEEDED, msg))
        return keep

    def _dispatch(
        self,
        now: float,
        worker: WorkerState,
        key: RequestKey,
        requests: list[PendingRequest],
        capacity: Capacity,
    ) -> Outgoing:
        self._batch_seq += 1
        batch_id = self._batch_seq
        model = key[0]
        payloads: list[Frame] = []
        local = worker.wid in self.local_workers
        items: list[Any] = []
        samples = 0
        for req in requests:
            req.state = _DISPATCHED
            req.attempts += 1
            samples += req.samples
            payloads.extend(req.payloads)
            if local:  # an embedded worker: the BatchItem itself, nothing to parse there
                items.append(
                    BatchItem(
                        req.request_id,
                        req.samples,
                        req.simple,
                        1000.0 * (now - req.arrival_s),
                        req.refs,
                        req.shm_outputs,
                    )
                )
                continue
            items.append(
                batch_item_wire(
                    req.request_id,
                    req.samples,
                    req.simple,
                    1000.0 * (now - req.arrival_s),
                    req.shm,
                    req.shm_outputs,
                )
            )
        frames: list[Any]
        if local:
            batch = BatchMeta(batch_id, model, self._local_batch_inputs(key), tuple(items))
            frames = [_BATCH_HEADER, batch, *payloads]
        else:
            meta = batch_wire(batch_id, model, self._inputs_wire(key), items)
            frames = batch_frames(meta, payloads)
        self._inflight[batch_id] = InflightBatch(
            batch_id, worker.wid, requests, key, samples, capacity.cost.estimate(samples)
        )
        worker.outstanding.add(batch_id)
        worker.free_at_s = max(now, worker.free_at_s) + self._inflight[batch_id].predicted_s
        worker.lanes[model].on_dispatch(samples)
        self.stats.batch(model, samples)
        logger.debug(
            "dispatch batch=%d model=%s n=%d worker=%s", batch_id, model, samples, worker.name
        )
        return Outgoing(_BACKEND, worker.wid, frames)

    def _inputs_wire(self, key: RequestKey) -> list[dict[str, Any]]:
        """The BATCH ``inputs`` of a queue key (dim 0 = -1), built once per key."""
        wire = self._inputs_cache.get(key)
        if wire is None:
            wire = self._inputs_cache[key] = batch_inputs_wire(
                TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in key[1]
            )
        return wire

    def _local_batch_inputs(self, key: RequestKey) -> tuple[TensorMeta, ...]:
        """The BATCH inputs of a queue key as TensorMetas (dim 0 = -1), built once per key."""
        metas = self._local_inputs.get(key)
        if metas is None:
            metas = self._local_inputs[key] = tuple(
                TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in key[1]
            )
        return metas

    def _expire(self, now: float, out: list[Outgoing]) -> set[RequestKey]:
        """Answer every request whose deadline has passed, queued or in flight; returns the
        keys of queues that lost a request (what was behind it may leave now)."""
        touched: set[RequestKey] = set()
        for req in self._deadlines.pop_expired(now):
            if req.state is _QUEUED:
                self._queues[req.key].forget(req)
                self._dequeued(req)
                touched.add(req.key)
            if self.registry.serving(req.model):
                code, msg = ErrorCode.DEADLINE_EXCEEDED, "deadline passed before a result"
            else:
                code, msg = ErrorCode.UNAVAILABLE, f"no live worker serves model {req.model!r}"
            _finish(req, RequestState.EXPIRED)
            out.append(self._request_error(req, code, msg))
        return touched

    # ------------------------------------------------------------------ replies

    def _to_client(self, client: ClientId, delimited: bool, frames: Sequence[Any]) -> Outgoing:
        return Outgoing(_FRONTEND, client, [b"", *frames] if delimited else list(frames))

    def _error(
        self,
        client: ClientId,
        delimited: bool,
        request_id: int | None,
        code: ErrorCode,
        message: str,
        *,
        simple: bool = False,
        retry_after_ms: int | None = None,
    ) -> Outgoing:
        self.stats.errors[code.name] += 1
        logger.debug("error id=%s code=%s: %s", request_id, code.name, message)
        reply = ErrorReply(request_id, code, message, retry_after_ms)
        return self._to_client(client, delimited, encode_error(reply, simple=simple))

    def _request_error(self, req: PendingRequest, code: ErrorCode, message: str) -> Outgoing:
        hint = None
        if code is ErrorCode.OVERLOADED:  # (a worker's FAILED: §12 wants a hint with it)
            ahead = self._samples_ahead(req.model, int(req.priority)) + req.samples
            hint = retry_after_ms(self._drain_time_s(req.model, req.key, ahead) or 0.05)
        return self._error(
            req.client,
            req.delimited,
            req.request_id,
            code,
            message,
            simple=req.simple,
            retry_after_ms=hint,
        )

    # ------------------------------------------------------------------ queries

    def snapshot(self) -> dict[str, Any]:
        """Counters and state for STATS replies (msgpack-friendly: str keys only)."""
        return {
            "requests": self.stats.requests,
            "replies": self.stats.replies,
            "errors": dict(self.stats.errors),
            "batch_sizes": {
                model: {str(k): v for k, v in sorted(sizes.items())}
                for model, sizes in self.stats.batch_sizes.items()
            },
            "queued": self.queued,
            "queued_bytes": self.queued_bytes,
            "inflight_batches": len(self._inflight),
            "requeued": self.stats.requeued,
            "undeliverable": self.stats.undeliverable,
            "late_results": self.stats.late_results,
            "shed": self.stats.shed,
            "workers": [
                {
                    "name": w.name,
                    "models": sorted(w.models),
                    "slots": w.slots,
                    "outstanding": len(w.outstanding),
                    "rho": w.rho,
                    "lanes": {name: _lane_snapshot(lane) for name, lane in w.lanes.items()},
                    "transport": _transport(w.wid),
                }
                for w in self.registry.all()
            ],
        }


def _transport(wid: bytes) -> str:
    """How a worker is connected, from the routing id the server gave it."""
    if wid.startswith(LINK_ID):
        return "local"  # the server's unix-socket endpoint
    if wid.startswith(EMBEDDED_ID):
        return "embedded"  # in the broker's process
    return "zeromq"


def retry_after_ms(drain_s: float) -> int:
    """OVERLOADED's hint: the queue's drain time, in 1 ms..MAX_TIMEOUT_MS (a fitted cost
    can be anything a worker reported; the hint must stay a small integer)."""
    if not math.isfinite(drain_s):
        return MAX_TIMEOUT_MS
    return min(MAX_TIMEOUT_MS, max(1, round(1000 * drain_s)))


def _finish(req: PendingRequest, state: RequestState) -> None:
    """A request leaves for good: drop its payload frames now (not at its deadline, when
    its deadline-heap entry goes), so answered requests hold no tensor memory."""
    req.state = state
    req.payloads = ()


def _lane_snapshot(lane: Lane) -> dict[str, Any]:
    cost = lane.cost(lane.last_key)
    return {
        "b_max": lane.batch_limit,
        "fixed_cost_ms": round(1000 * cost.fixed_cost_s, 3),
        "per_sample_ms": round(1000 * cost.per_sample_s, 3),
        "calibrated": cost.calibrated,
    }
