"""dispatcher.py: Dispatcher — how and where batches leave a queue.

Pure: ``now`` comes in; no sockets or clocks. A pump of one queue asks its policy
(:mod:`carpool.broker.policy`) whether a batch leaves now, sheds the requests that cannot
make their deadline, picks the worker (credits, predicted backlog, batch limit) and
builds its BATCH; the batch's requests leave their queue through
:meth:`~carpool.broker.backlog.Backlog.take`, in the order the backlog keeps. Deadlines
that pass are answered here too, queued or in flight. Which queues are pumped when, and
in which order, is :mod:`carpool.broker.pumps`'s.

The BATCH goes to a worker's transport as a :class:`DispatchedBatch`, holding the batch's
requests; its transport asks for one form: :meth:`~DispatchedBatch.to_message`, the
typed :class:`BrokerBatch` (for a worker in the broker's process, no msgpack), or
:meth:`~DispatchedBatch.to_frames`, that message's frames (for a socket), encoded
straight from the requests by the encoders the typed message uses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from carpool.broker.backlog import Backlog
from carpool.broker.batcher import RequestQueue
from carpool.broker.fleet import FleetModel
from carpool.broker.policy import BatchPolicy, Capacity, Dispatch, promotion_s
from carpool.broker.registry import WorkerRegistry, WorkerState
from carpool.broker.replies import Outgoing, ToWorker, request_error
from carpool.broker.requests import PendingRequest, RequestKey, WorkerId
from carpool.broker.stats import Notes
from carpool.common.errors import ErrorCode
from carpool.common.protocol import BatchItem, BatchMeta, BrokerBatch, Frame, TensorMeta
from carpool.common.protocol.worker_messages import batch_frames, item_wire

logger = logging.getLogger(__name__)

#: Why a batch leaves when it is an idle worker's share of what the policy let leave.
SHARED = "shared"

#: What :meth:`Dispatcher.expire` returns when nothing expired (never written).
_NO_KEYS: frozenset[RequestKey] = frozenset()


@dataclass(slots=True, eq=False, repr=False)
class Dispatcher:
    """The pump, shedding and dispatch; see the module docstring."""

    backlog: Backlog
    fleet: FleetModel
    registry: WorkerRegistry
    #: What it did that the stats count, for the core to take into them.
    notes: Notes = field(init=False, default_factory=Notes)
    # When each queue's policy next wants a look (absent: waits for a worker or arrival).
    wake_s: dict[RequestKey, float] = field(init=False, default_factory=dict)
    # Each key's BATCH inputs and their wire form.
    _inputs: dict[RequestKey, tuple[tuple[TensorMeta, ...], list[dict[str, Any]]]] = field(
        init=False, default_factory=dict
    )

    def forget(self, key: RequestKey) -> None:
        """A queue went idle and was dropped: forget what was cached for it."""
        self.wake_s.pop(key, None)
        self._inputs.pop(key, None)

    def sweep(self, now: float) -> None:
        """Forget idle queues (and their arrival rate) once nothing arrived for a while,
        and start the fleet's drain-rate cache afresh (it grows with every shape a
        client chooses)."""
        queues = self.backlog.queues
        idle = [
            k
            for k, q in queues.items()
            if q.count == 0 and q.head() is None and q.arrival_sps(now) == 0
        ]
        for key in idle:
            self.backlog.drop(key)
            self.forget(key)
        self.fleet.rates.clear()

    def stop(self) -> None:
        """The broker is stopping: no queue waits for a wake-up any more."""
        self.wake_s.clear()

    def _shed(
        self,
        now: float,
        queue: RequestQueue,
        out: list[Outgoing],
        caps: dict[WorkerId, Capacity],
        policy: BatchPolicy,
        workers: list[WorkerState],
    ) -> float | None:
        """Answer the queue's hopeless requests now; return when to look again, at or
        before the moment the next one turns hopeless (None if that cannot be
        predicted). ``caps`` collects the workers' capacities for the rest of the pump;
        ``workers``: those that admit the queue's shapes."""
        if not policy.edf or not workers or queue.count == 0:
            return None
        # Hopeless against the best worker: its earliest start plus the smallest batch the
        # policy would run there.
        key = queue.key
        lead_s = ready_s = math.inf
        for w in workers:
            capacity = caps.get(w.wid)
            if capacity is None:
                capacity = caps[w.wid] = self.fleet.capacity(now, w, key)
            lead = policy.shed_before(now, capacity) - now
            # (min, as a test) speed: docs/benchmarks.md "Why the hot path looks as it does"
            if lead < lead_s:
                lead_s = lead
            if capacity.ready_in_s < ready_s:
                ready_s = capacity.ready_in_s
        if lead_s <= 0:
            return None
        nxt = queue.earliest_deadline()
        # (shed only when the most urgent request is hopeless: most pumps shed nothing)
        if nxt is not None and nxt.deadline_s <= now + lead_s:
            notes = self.notes
            for req in self.backlog.shed(queue, now + lead_s):
                notes.shed += 1
                msg = "deadline cannot be met: predicted completion lies past it"
                out.append(request_error(notes, req, ErrorCode.DEADLINE_EXCEEDED, msg))
            nxt = queue.earliest_deadline()
        if nxt is None:
            return None
        # While a worker is busy its predicted start does not move with the clock, so the
        # verdict cannot change before the soonest predicted free time (or a RESULT, which
        # pumps): "deadline - lead" alone, re-read at each wake-up, would stay the same
        # slack ahead of the clock and wake the queue again and again. Never later than
        # the moment the request turns hopeless (deadline - a batch of one's cost, at the
        # worker that makes it last): that moment is at or after both.
        # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
        hopeless_s, free_s = nxt.deadline_s - lead_s, now + ready_s
        return free_s if free_s > hopeless_s else hopeless_s

    def pump(self, now: float, queue: RequestQueue, out: list[Outgoing]) -> int:
        """Shed what cannot make it, then send every batch the policy lets leave now;
        returns how many left."""
        key = queue.key
        model = key[0]
        policy = self.fleet.policy(model)
        # The workers that admit its shapes do not change within a pump.
        workers, limit = self.registry.eligible(key)
        self.wake_s.pop(key, None)
        # Events can outrun ticks: never send a request whose deadline has already passed.
        for other in self.expire(now, out):
            if other != key:
                self.wake_s[other] = now  # the next tick looks at what was behind it
        # Capacities of this pump, per worker, until that worker takes a batch.
        caps: dict[WorkerId, Capacity] = {}
        shed_at = self._shed(now, queue, out, caps, policy, workers)
        released = 0  # samples the policy let leave now, still to share among idle workers
        sent = 0
        while True:
            head = queue.head()
            if head is None:
                return sent
            worker = self.registry.best_free(key, 1, workers)
            if worker is None:
                if not limit and self.registry.serving(model):
                    # The workers that took its shapes have left: answer the queue now,
                    # not let it wait for its deadlines.
                    for req in list(queue):
                        self._unservable(queue, req, out)
                    return sent
                # A RESULT, READY or worker loss will pump again; meanwhile shed on time.
                if shed_at is not None:
                    self.wake_s[key] = shed_at
                return sent
            capacity = caps.get(worker.wid) or self.fleet.capacity(now, worker, key)
            # The request the batch starts with, and the most urgent one it must respect.
            promote_s = 0.0
            if policy.edf:
                promote_s = promotion_s(capacity)
                first = self.backlog.next_up(queue, now, promote_s, True)
                urgent = queue.earliest_deadline()
            else:
                first = urgent = head  # (next_up's in arrival order: the oldest)
            assert first is not None  # the queue is not empty
            assert urgent is not None
            if worker.lanes[model].max_batch < first.samples:
                bigger = self.registry.best_free(key, first.samples, workers)
                if bigger is None:
                    if limit < first.samples:
                        # The worker that could take it has left: answer it now, not let
                        # everything behind it wait for its deadline.
                        self._unservable(queue, first, out)
                        continue
                    # Only a busy worker can take it; its RESULT pumps again, and shedding
                    # keeps its own time.
                    if shed_at is not None:
                        self.wake_s[key] = shed_at
                    return sent
                worker, capacity = bigger, self.fleet.capacity(now, bigger, key)
            engine_max = worker.lanes[model].max_batch
            if released > 0:
                # The policy already let these leave now; this idle worker takes its share.
                leaving = released
                reason = SHARED
            else:
                view = self.fleet.view(now, queue, head, urgent, len(workers))
                decision = policy.decide(now, view, capacity)
                if not isinstance(decision, Dispatch):
                    # (min, as a test) speed: docs/benchmarks.md "Why the hot path looks as it does"
                    wake = decision.t
                    if shed_at is not None and shed_at < wake:
                        wake = shed_at
                    self.wake_s[key] = wake
                    return sent
                # A request larger than the policy's size still travels alone rather than
                # starve; `first` is taken first either way, so a batch is never empty. (min
                # and max, as tests) speed: docs/benchmarks.md "Why the hot path looks as it does"
                leaving = decision.max_samples
                if first.samples > leaving:
                    leaving = first.samples
                if engine_max < leaving:
                    leaving = engine_max
                reason = decision.reason
            size = leaving
            if policy.share_idle:
                # Several workers idle: each takes a share of what leaves now (workers run in
                # parallel, so a batch each ends sooner than all of it on one worker).
                if queue.samples < leaving:
                    leaving = queue.samples
                idle = self.fleet.idle_workers(model, workers, worker, first.samples, leaving)
                size = -(-leaving // idle)
                if first.samples > size:
                    size = first.samples
                if engine_max < size:
                    size = engine_max
            queued = queue.samples
            requests = self.backlog.take(queue, size, now, promote_s, policy.edf)
            # (what left counted by the queue, not summed again)
            released = leaving - (queued - queue.samples) if policy.share_idle else 0
            if released < 0:
                released = 0
            if policy.edf and capacity.cost.calibrated:
                requests = self._drop_doomed(now, requests, capacity, out)
                if not requests:
                    continue
            out.append(self._dispatch(now, worker, key, requests, capacity, reason))
            sent += 1
            caps.pop(worker.wid, None)  # its backlog and credits changed

    def _unservable(self, queue: RequestQueue, req: PendingRequest, out: list[Outgoing]) -> None:
        """Answer a queued request that no live worker of its model takes now: larger than
        any takes, or of shapes none admits (it was admitted, or requeued, while a worker
        that took it served the model)."""
        most = self.registry.limit(req.key)
        msg = (
            f"request has {req.samples} samples; no live worker of model {req.model!r} "
            f"takes more than {most} per batch now"
            if most
            else f"no live worker of model {req.model!r} takes its shapes now"
        )
        self.answer_queued(queue, req, ErrorCode.UNAVAILABLE, msg, out)

    def answer_queued(
        self,
        queue: RequestQueue,
        req: PendingRequest,
        code: ErrorCode,
        message: str,
        out: list[Outgoing],
        now: float | None = None,
    ) -> None:
        """Take a request out of its queue and answer it with an error (an UNAVAILABLE
        once the broker is stopping with ``retry``: the request did not run; and, given
        ``now``, with the time left before the broker closes)."""
        backlog = self.backlog
        backlog.remove(queue, req)
        if backlog.stopping and code is ErrorCode.UNAVAILABLE:
            hint = None if now is None else backlog.retry_after_ms(now)
            out.append(request_error(self.notes, req, code, message, retry=True, hint=hint))
        else:
            out.append(request_error(self.notes, req, code, message))

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
            doomed = [r for r in requests if r.deadline_s < done_s]
            self.backlog.expire_taken(doomed)
            notes = self.notes
            for req in doomed:
                notes.shed += 1
                out.append(request_error(notes, req, ErrorCode.DEADLINE_EXCEEDED, msg))
        return keep

    def _dispatch(
        self,
        now: float,
        worker: WorkerState,
        key: RequestKey,
        requests: list[PendingRequest],
        capacity: Capacity,
        reason: str,
    ) -> ToWorker:
        model = key[0]
        payloads: list[Frame] = []
        samples = 0
        for req in requests:
            req.attempts += 1
            samples += req.samples
            payloads.extend(req.payloads)
        inputs = self._inputs.get(key)
        if inputs is None:
            metas = batch_inputs(key)
            inputs = self._inputs[key] = (metas, [t.to_wire() for t in metas])
        predicted_s = capacity.cost.estimate(samples)
        held = self.registry.dispatched(now, worker, requests, key, samples, predicted_s)
        batch_id = held.batch_id
        batch = DispatchedBatch(batch_id, model, inputs[0], requests, payloads, now, inputs[1])
        self.notes.batches.append((model, samples))
        if logger.isEnabledFor(logging.DEBUG):  # (one call a batch, not two)
            logger.debug(
                "dispatch batch=%d model=%s n=%d worker=%s reason=%s",
                batch_id,
                model,
                samples,
                worker.name,
                reason,
            )
        return ToWorker(worker.wid, batch)

    def expire(self, now: float, out: list[Outgoing]) -> AbstractSet[RequestKey]:
        """Answer every request whose deadline has passed, queued or in flight; returns the
        keys of queues that lost a request (what was behind it may leave now)."""
        backlog = self.backlog
        # Nothing due (the common case, three times a request at burst 1), without a call.
        # speed: docs/benchmarks.md "Why the hot path looks as it does"
        heap = backlog.deadlines.entries
        if not heap or heap[0][0] > now:
            return _NO_KEYS
        expired = backlog.expire(now)
        if not expired:
            return _NO_KEYS
        touched: set[RequestKey] = set()
        for req, queued in expired:
            if queued:
                touched.add(req.key)
            retry = False
            if self.registry.serving(req.model):
                code, msg = ErrorCode.DEADLINE_EXCEEDED, "deadline passed before a result"
            else:
                code, msg = ErrorCode.UNAVAILABLE, f"no live worker serves model {req.model!r}"
                retry = queued and backlog.stopping  # (it did not run)
            hint = backlog.retry_after_ms(now) if retry else None
            out.append(request_error(self.notes, req, code, msg, retry=retry, hint=hint))
        return touched


def batch_inputs(key: RequestKey) -> tuple[TensorMeta, ...]:
    """A queue key's BATCH ``inputs``: its tensors with dim 0 = -1."""
    return tuple(TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in key[1])


@dataclass(slots=True)
class DispatchedBatch:
    """One BATCH to one worker: ``requests`` in batch order, their ``payloads``
    request-major, ``sent_s`` the dispatch time (each request's queue time ends there),
    ``inputs_wire`` the wire form of ``inputs`` where the caller keeps it (None: made
    here). (Not frozen, for speed: docs/benchmarks.md "Why the hot path looks as it does".)"""

    batch_id: int
    model: str
    inputs: tuple[TensorMeta, ...]
    requests: Sequence[PendingRequest]
    payloads: Sequence[Frame]
    sent_s: float
    inputs_wire: list[dict[str, Any]] | None = None

    def to_message(self) -> BrokerBatch:
        sent_s = self.sent_s
        items = tuple(
            BatchItem(
                r.request_id,
                r.samples,
                r.simple,
                1000.0 * (sent_s - r.arrival_s),
                r.refs,
                r.shm_outputs,
                r.shapes,
            )
            for r in self.requests
        )
        meta = BatchMeta(self.batch_id, self.model, self.inputs, items)
        return BrokerBatch(meta, self.payloads)

    def to_frames(self) -> list[Any]:
        """The frames of :meth:`to_message`'s message, without building it."""
        sent_s = self.sent_s
        items = [
            item_wire(
                r.request_id,
                r.samples,
                r.simple,
                1000.0 * (sent_s - r.arrival_s),
                r.refs,
                r.shm_outputs,
                r.shapes,
            )
            for r in self.requests
        ]
        inputs = self.inputs_wire
        if inputs is None:
            inputs = [t.to_wire() for t in self.inputs]
        return batch_frames(self.batch_id, self.model, inputs, items, self.payloads)
