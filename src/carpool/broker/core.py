"""core.py: BrokerCore — the whole broker as a pure state machine.

Inputs are events with ``now`` (monotonic seconds): a client message, a worker message, a
tick, a peer that could not be sent to. Each returns the list of :class:`Outgoing` messages
to send. No sockets, threads or clocks here; ``server.py`` owns those.

Two modes: by default each message forms the batches it allows at once; with
``defer_pumps=True`` (the server's mode) messages only queue work and the tick that ends
each loop turn forms batches for everything that arrived in it. A framed request whose
layout (model, input names, dtypes, shapes) passed validation before takes a fast path
with the same checks and answers.

Invariants:
- every client request gets exactly one reply: its result or a typed error;
- tensor payload frames are forwarded as the objects that arrived, never read or copied;
- a worker never holds more batches than its credits (slots);
- a batch never exceeds the policy's size nor mixes request keys (model + item shapes).
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
    request_key,
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
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    MAX_TIMEOUT_MS,
    PRIORITIES,
    BatchItem,
    BatchMeta,
    Command,
    ErrorReply,
    FailedMeta,
    Frame,
    ModelSpec,
    Priority,
    Ready,
    ResultMeta,
    ShmRef,
    Signature,
    Submit,
    TensorMeta,
    VersionMismatch,
    check_frame_sizes,
    decode_meta,
    decode_simple_request,
    decode_submit,
    encode,
    encode_error,
    header,
    is_simple_form,
    parse_header,
    request_id_of,
    shm_refs,
    shm_wire,
    tensor_signature,
    view,
)
from carpool.common.shm import MAX_REF_BYTES

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


@dataclass(frozen=True, slots=True)
class _Layout:
    """A request shape already validated against its model (for the fast path)."""

    model: str
    key: RequestKey
    shape: tuple[int, ...]  # the first input's shape, for the arrival trace
    samples: int
    sizes: tuple[int, ...]  # each payload frame's length, in the request's order
    order: tuple[int, ...] | None  # request frame index per spec input; None: the same


#: How often on_tick looks for idle queues to forget (a queue idle for a second goes).
_SWEEP_S = 0.5
_BATCH_HEADER = header(Command.BATCH)
_NO_META: dict[str, Any] = {}  # the meta of a message that came as an object (never mutated)

#: Layouts remembered (clients choose shapes; the cache is dropped when full).
_MAX_LAYOUTS = 1024


class BrokerCore:
    """The broker's state: queues, in-flight batches, workers; see the module docstring."""

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
        self._seq = 0
        self._batch_seq = 0
        self.queued = 0
        # Queued samples per model, by priority (interactive, bulk): admission estimates.
        self._queued_samples: dict[str, list[int]] = {}
        # Arrival trace (time, model, shape, timeout_ms, priority) while recording; the
        # shell writes it out (carpool record).
        self.recording: list[tuple[float, str, tuple[int, ...], int, int]] | None = None
        self._inputs_cache: dict[RequestKey, list[dict[str, Any]]] = {}
        self._local_inputs: dict[RequestKey, tuple[TensorMeta, ...]] = {}
        # Workers in this process (the server's embedded workers): their BATCH and RESULT
        # metas pass as BatchMeta / ResultMeta objects, not msgpack (protocol.md §1).
        self.local_workers: set[bytes] = set()
        # Request layouts validated once per (model, input names, dtypes, shapes); a
        # model's spec never changes once registered, so entries stay valid.
        self._layouts: dict[tuple[str, Signature], _Layout] = {}
        self._sweep_s = 0.0  # when on_tick next looks for idle queues to forget
        # Best-case fleet throughput per key (samples/s, 0 = unknown) for admission.
        self._fleet_rates: dict[RequestKey, float] = {}

    # ------------------------------------------------------------------ clients

    def on_client(self, now: float, identity: bytes, frames: Sequence[Frame]) -> list[Outgoing]:
        """A message from a client arrived on the frontend."""
        client = ClientId(identity)
        self.stats.requests += 1
        # A REQ socket puts an empty delimiter frame first; answer it in kind.
        delimited = len(frames) > 1 and len(frames[0]) == 0
        if delimited:
            frames = frames[1:]
        if len(frames) == 1 and is_simple_form(view(frames[0])):
            return self._on_simple(now, client, delimited, frames[0])
        meta: dict[str, Any] | None = None
        try:
            if not frames:
                raise ProtocolError("empty message")
            command = parse_header(view(frames[0]))
            if command is Command.STATS:
                snapshot = self.snapshot()
                if len(frames) > 1:  # echo the caller's id, so it can match the reply
                    snapshot["id"] = request_id_of(decode_meta(view(frames[1])))
                return [self._to_client(client, delimited, encode(Command.STATS, snapshot))]
            if command is not Command.REQUEST:
                raise ProtocolError(f"command {command.name} is not valid from a client")
            if len(frames) < 2:
                raise ProtocolError("REQUEST needs a meta frame")
            meta = decode_meta(view(frames[1]))
            known = self._admit_known(now, client, delimited, meta, frames[2:])
            if known is not None:
                return known
            submit = decode_submit(meta)
        except VersionMismatch as exc:
            logger.info("client=%s sent protocol version %d", identity.hex(), exc.version)
            return [self._error(client, delimited, None, ErrorCode.UNSUPPORTED_VERSION, str(exc))]
        except ProtocolError as exc:
            rid = request_id_of(meta)
            return [self._error(client, delimited, rid, ErrorCode.INVALID_ARGUMENT, str(exc))]
        return self._admit(now, client, delimited, submit, frames[2:], simple=False)

    def _on_simple(
        self, now: float, client: ClientId, delimited: bool, frame: Frame
    ) -> list[Outgoing]:
        try:
            submit, payloads = decode_simple_request(view(frame))
        except ProtocolError as exc:
            code = (
                ErrorCode.UNSUPPORTED_VERSION
                if isinstance(exc, VersionMismatch)
                else ErrorCode.INVALID_ARGUMENT
            )
            rid = request_id_of(exc.meta)
            return [self._error(client, delimited, rid, code, str(exc), simple=True)]
        return self._admit(now, client, delimited, submit, payloads, simple=True)

    def _admit(
        self,
        now: float,
        client: ClientId,
        delimited: bool,
        submit: Submit,
        payloads: Sequence[Frame],
        *,
        simple: bool,
    ) -> list[Outgoing]:
        """Validate a decoded request against its model; queue it or answer an error."""
        rid = submit.request_id
        spec = self.registry.specs.get(submit.model)
        if spec is None:
            msg = f"model {submit.model!r} is not served by any worker"
            return [self._error(client, delimited, rid, ErrorCode.NOT_FOUND, msg, simple=simple)]
        if self.registry.max_batch(spec.name) == 0:  # before the payload checks (protocol §6.1)
            msg = f"no live worker serves model {spec.name!r} right now"
            return [self._error(client, delimited, rid, ErrorCode.UNAVAILABLE, msg, simple=simple)]
        try:
            inputs, order, samples = _conform(spec, submit.inputs, payloads, submit.shm)
        except ProtocolError as exc:
            code = ErrorCode.INVALID_ARGUMENT
            return [self._error(client, delimited, rid, code, str(exc), simple=simple)]
        layout = _Layout(
            spec.name,
            request_key(spec.name, inputs),
            inputs[0].shape,
            samples,
            tuple(t.nbytes for t in submit.inputs),
            None if order == tuple(range(len(order))) else order,
        )
        if not simple:
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[_signature(submit)] = layout
        return self._enqueue(
            now,
            client,
            delimited,
            rid,
            layout,
            payloads,
            submit.timeout_ms,
            submit.priority,
            simple,
            submit.shm,
            submit.shm_outputs,
        )

    def _admit_known(
        self, now: float, client: ClientId, delimited: bool, meta: Any, payloads: Sequence[Frame]
    ) -> list[Outgoing] | None:
        """The common request, checked against the layout cached when a request with the
        same model and input names, dtypes and shapes was first validated. None: anything
        unusual, which takes the full path (and its precise error messages)."""
        model = meta.get("model")
        inputs = tensor_signature(meta.get("inputs"))
        if type(model) is not str or inputs is None:
            return None
        layout = self._layouts.get((model, inputs))
        if layout is None or len(payloads) != len(layout.sizes):
            return None
        if self.registry.max_batch(model) == 0:
            return None  # the full path answers UNAVAILABLE
        refs = None
        descriptors = meta["inputs"]  # a list of maps: tensor_signature checked
        for t in descriptors:
            if "shm" in t:
                try:
                    refs = shm_refs(descriptors)
                except ProtocolError:
                    return None  # the full path says what is wrong
                break
        if refs is None:
            for frame, size in zip(payloads, layout.sizes, strict=True):
                if len(frame) != size:
                    return None
        else:
            for frame, size, ref in zip(payloads, layout.sizes, refs, strict=True):
                if len(frame) != (size if ref is None else 0) or size > MAX_REF_BYTES:
                    return None  # (a claim that large: the full path says no)
        rid = request_id_of(meta)
        timeout = meta.get("timeout_ms")
        prio = meta.get("priority", 0)
        shm_outputs = meta.get("shm_outputs", False)
        if (
            rid is None
            or type(shm_outputs) is not bool
            or (
                timeout is not None
                and (type(timeout) is not int or not 0 < timeout <= MAX_TIMEOUT_MS)
            )
            or type(prio) is not int
            or prio not in (0, 1)
        ):
            return None
        return self._enqueue(
            now,
            client,
            delimited,
            rid,
            layout,
            payloads,
            timeout,
            PRIORITIES[prio],
            False,
            refs,
            shm_outputs,
        )

    def _enqueue(
        self,
        now: float,
        client: ClientId,
        delimited: bool,
        rid: int,
        layout: _Layout,
        payloads: Sequence[Frame],
        timeout_ms: int | None,
        priority: Priority,
        simple: bool,
        refs: tuple[ShmRef | None, ...] | None = None,
        shm_outputs: bool = False,
    ) -> list[Outgoing]:
        """Queue a valid request, unless no worker can take it or it cannot make its
        deadline; in deferred mode the batch forms at the end of the turn. ``refs``: the
        inputs' shared-memory references, in the request's order (§5.4)."""
        model = layout.model
        max_batch = self.registry.max_batch(model)  # > 0: both callers checked
        samples = layout.samples
        if samples > max_batch:
            msg = (
                f"request has {samples} samples; model {model!r} accepts at most "
                f"{max_batch} per batch"
            )
            code = ErrorCode.INVALID_ARGUMENT
            return [self._error(client, delimited, rid, code, msg, simple=simple)]
        timeout_s = timeout_ms / 1000.0 if timeout_ms is not None else self.config.default_timeout_s
        if self.recording is not None:
            self.recording.append(
                (now, model, layout.shape, round(1000 * timeout_s), int(priority))
            )
        key = layout.key
        out: list[Outgoing] = []
        if self.queued >= self.config.max_queued and (self._dirty or self._dirty_models):
            # Deferred mode: what can leave this turn leaves before the door closes.
            self._pump_dirty(now, out)
        if self.queued >= self.config.max_queued:
            # Until costs are fitted the drain time is unknown: suggest a modest pause.
            drain_s = self._drain_time_s(model, key, self.queued) or 0.05
            out.append(
                self._error(
                    client,
                    delimited,
                    rid,
                    ErrorCode.OVERLOADED,
                    f"broker queue full ({self.queued} requests)",
                    simple=simple,
                    retry_after_ms=max(1, round(1000 * drain_s)),
                )
            )
            return out
        if self._policy(model).edf:
            # The SLA countdown at the door: if even the best case (the work queued ahead
            # at full speed, then this request) ends past the deadline, say so now.
            ahead = self._samples_ahead(model, priority)
            finish_s = self._drain_time_s(model, key, ahead + samples)
            if finish_s > timeout_s:
                self.stats.shed += 1
                msg = (
                    f"cannot meet the {1000 * timeout_s:.0f} ms deadline: predicted "
                    f"completion in {1000 * finish_s:.0f} ms"
                )
                code = ErrorCode.DEADLINE_EXCEEDED
                out.append(self._error(client, delimited, rid, code, msg, simple=simple))
                return out
        shm = None
        if layout.order is not None:
            payloads = [payloads[i] for i in layout.order]
            if refs is not None:
                refs = tuple(refs[i] for i in layout.order)
        if refs is not None:
            shm = shm_wire(refs)
        self._seq += 1
        req = PendingRequest(  # positional: the fields in declaration order
            self._seq,
            client,
            delimited,
            rid,
            simple,
            model,
            key,
            samples,
            priority,
            now,
            now + timeout_s,
            payloads,
            shm,
            shm_outputs,
            refs,
        )
        queue = self._queue(key)
        queue.push(req)
        queue.note_arrival(now, samples)
        self._enqueued(req)
        self._deadlines.push(req)
        if self.defer_pumps:
            self._dirty[key] = None
        else:
            self._pump(now, queue, out)
        return out

    # ------------------------------------------------------------------ workers

    def on_worker(self, now: float, identity: bytes, frames: Sequence[Frame]) -> list[Outgoing]:
        """A message from a worker arrived on the backend."""
        wid = WorkerId(identity)
        out: list[Outgoing] = []
        try:
            if len(frames) < 2:
                raise ProtocolError("worker messages have a header and a meta frame")
            second: object = frames[1]
            result: ResultMeta | None = None
            if type(second) is ResultMeta:
                # An embedded worker's RESULT (local_workers): built in this process, it
                # passes as the object (no socket can deliver anything but bytes). What
                # from_wire checks and _on_result does not: every reply has a frame.
                if any(k < 1 for k in second.frames):
                    raise ProtocolError("result: frames must be a list of ints >= 1")
                command, meta, result = Command.RESULT, _NO_META, second
            else:
                command = parse_header(view(frames[0]))
                meta = decode_meta(view(frames[1]))
            if command is Command.READY:
                self._on_ready(now, wid, Ready.from_wire(meta), out)
                return out
            worker = self.registry.touch(now, wid)
            if worker is None:
                if command is not Command.DISCONNECT:
                    # MDP rule: an unknown peer must re-register on a fresh socket.
                    out.append(_disconnect(wid, "unknown worker; reconnect and send READY"))
                if command in (Command.RESULT, Command.FAILED):
                    self.stats.late_results += 1
                return out
            if command is Command.HEARTBEAT:
                rho = meta.get("rho")
                if isinstance(rho, (int, float)) and not isinstance(rho, bool) and 0 <= rho <= 1:
                    self._on_load(now, worker, float(rho))
            elif command is Command.RESULT:
                if result is None:
                    result = ResultMeta.from_wire(meta)
                self._on_result(now, worker, result, frames[2:], out)
            elif command is Command.FAILED:
                self._on_failed(now, worker, FailedMeta.from_wire(meta), out)
            elif command is Command.DISCONNECT:
                self._lose_worker(now, worker, "worker disconnected", out)
            else:
                raise ProtocolError(f"command {command.name} is not valid from a worker")
        except ProtocolError as exc:
            # A worker that breaks the protocol is dropped; it may reconnect and re-register.
            logger.warning("worker=%s protocol error: %s", identity.hex(), exc)
            worker = self.registry.get(wid)
            if worker is not None:
                self._lose_worker(now, worker, f"protocol error: {exc}", out)
            out.append(_disconnect(wid, f"protocol error: {exc}"))
        return out

    def _on_ready(self, now: float, wid: WorkerId, ready: Ready, out: list[Outgoing]) -> None:
        old = self.registry.get(wid)
        if old is not None:
            # A second READY on one connection: the old registration ends either way.
            self._lose_worker(now, old, "worker re-registered", out)
        conflicts = self.registry.conflicts(ready)
        if conflicts:
            reason = f"model spec differs from the registered one for {', '.join(conflicts)}"
            logger.warning("worker=%s name=%s refused: %s", wid.hex(), ready.name, reason)
            out.append(_disconnect(wid, reason))
            return
        lanes = {m.name: self._lane(m.name, m.max_batch, m.preferred_batch) for m in ready.models}
        self.registry.add(now, wid, ready, ready.heartbeat_ms / 1000.0, lanes)
        self._fleet_rates.clear()
        logger.info(
            "worker joined name=%s models=%s slots=%d",
            ready.name,
            ",".join(m.name for m in ready.models),
            ready.slots,
        )
        self._pump_models(now, (m.name for m in ready.models), out)

    def _on_result(
        self,
        now: float,
        worker: WorkerState,
        result: ResultMeta,
        reply_frames: Sequence[Frame],
        out: list[Outgoing],
    ) -> None:
        batch = self._take_batch(now, worker, result.batch_id)
        if batch is None:
            return
        lane = worker.lanes.get(batch.key[0])
        if lane is not None and result.compute_ms > 0:
            lane.observe(batch.key, batch.samples, result.compute_ms / 1000.0)
            self._fleet_rates.pop(batch.key, None)
        self._on_load(now, worker, result.rho)
        if len(result.frames) != len(batch.requests) or sum(result.frames) != len(reply_frames):
            msg = (
                f"worker {worker.name} returned a malformed result for batch {batch.batch_id}: "
                f"{len(result.frames)} replies / {len(reply_frames)} frames for "
                f"{len(batch.requests)} requests"
            )
            logger.error("%s", msg)
            self._fail_batch(batch, ErrorCode.INTERNAL, msg, out)
        else:
            start = 0
            answered = 0
            for req, count in zip(batch.requests, result.frames, strict=True):
                stop = start + count
                if req.state is _DISPATCHED:  # else answered already (expired)
                    _finish(req, _DONE)
                    answered += 1
                    # _to_client, inlined (per reply): the slice is this message's list.
                    frames = reply_frames[start:stop]
                    if req.delimited:
                        frames = [b"", *frames]
                    out.append(Outgoing(_FRONTEND, req.client, frames))
                start = stop
            self.stats.replies += answered
        self._pump_models(now, worker.models, out)

    def _on_failed(
        self, now: float, worker: WorkerState, failed: FailedMeta, out: list[Outgoing]
    ) -> None:
        batch = self._take_batch(now, worker, failed.batch_id)
        if batch is None:
            return
        self._on_load(now, worker, failed.rho)
        logger.warning(
            "batch failed worker=%s model=%s code=%s: %s",
            worker.name,
            batch.key[0],
            failed.code.name,
            failed.message,
        )
        self._fail_batch(batch, failed.code, failed.message, out)
        self._pump_models(now, worker.models, out)

    def _take_batch(self, now: float, worker: WorkerState, batch_id: int) -> InflightBatch | None:
        batch = self._inflight.get(batch_id)
        if batch is None or batch.worker != worker.wid:
            # A batch this worker no longer owns (it was requeued after a presumed loss).
            self.stats.late_results += 1
            return None
        del self._inflight[batch_id]
        worker.outstanding.discard(batch_id)
        self._replan(now, worker)
        return batch

    def _fail_batch(
        self, batch: InflightBatch, code: ErrorCode, message: str, out: list[Outgoing]
    ) -> None:
        for req in batch.requests:
            if req.state is _DISPATCHED:
                _finish(req, RequestState.FAILED)
                out.append(self._request_error(req, code, message))

    def _lose_worker(
        self, now: float, worker: WorkerState, reason: str, out: list[Outgoing]
    ) -> None:
        """Forget a worker; its in-flight requests go back to their queues when they may."""
        self.registry.remove(worker.wid)
        self._fleet_rates.clear()
        logger.info("worker left name=%s reason=%s", worker.name, reason)
        for batch_id in sorted(worker.outstanding, reverse=True):
            batch = self._inflight.pop(batch_id, None)
            if batch is None:
                continue
            # Newest batch first and each batch back to front, so push_front keeps FIFO order.
            for req in reversed(batch.requests):
                if req.state is not _DISPATCHED:
                    continue
                if req.attempts < self.config.max_attempts and now < req.deadline_s:
                    req.state = _QUEUED
                    self._queue(req.key).push_front(req)
                    self._enqueued(req)
                    self.stats.requeued += 1
                else:
                    _finish(req, RequestState.FAILED)
                    msg = f"worker {worker.name} was lost while running the request ({reason})"
                    out.append(self._request_error(req, ErrorCode.UNAVAILABLE, msg))
        worker.outstanding.clear()
        self._pump_models(now, worker.models, out)

    def on_unreachable(self, now: float, side: Side, identity: bytes) -> list[Outgoing]:
        """The shell could not send to a peer (gone, or its queue is full)."""
        out: list[Outgoing] = []
        if side is _FRONTEND:
            self.stats.undeliverable += 1
            return out
        worker = self.registry.get(WorkerId(identity))
        if worker is not None:
            self._lose_worker(now, worker, "unreachable", out)
        return out

    # ------------------------------------------------------------------ time

    def on_tick(self, now: float) -> list[Outgoing]:
        """Expire deadlines and workers, send due heartbeats, and leave due batches."""
        out: list[Outgoing] = []
        for key in self._expire(now, out):
            self._pump(now, self._queues[key], out)
        event_s = self.registry.next_event_s()
        if event_s is not None and event_s <= now:
            for worker in self.registry.expired(now):
                self._lose_worker(now, worker, "heartbeat expired", out)
            for worker in self.registry.all():
                if worker.next_heartbeat_s <= now:
                    worker.next_heartbeat_s = now + worker.heartbeat_s
                    out.append(Outgoing(_BACKEND, worker.wid, encode(Command.HEARTBEAT, {})))
            self.registry.reschedule()
        self._pump_dirty(now, out)
        if self._wake_s:
            for key in [k for k, t in self._wake_s.items() if t <= now]:
                self._pump(now, self._queues[key], out)
        if now >= self._sweep_s:
            # Forget idle queues (and their arrival rate) once nothing arrived for a while.
            self._sweep_s = now + _SWEEP_S
            idle = [
                k
                for k, q in self._queues.items()
                if q.count == 0 and q.head() is None and q.arrival_sps(now) == 0
            ]
            for key in idle:
                del self._queues[key]
                self._wake_s.pop(key, None)
                self._inputs_cache.pop(key, None)
                self._local_inputs.pop(key, None)
            # A cache over every shape admitted (clients choose shapes): start it afresh.
            self._fleet_rates.clear()
        return out

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

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time ``on_tick`` has work: a batch wait, a deadline, a heartbeat."""
        times = [
            t for t in (self._deadlines.earliest(), self.registry.next_event_s()) if t is not None
        ]
        if self._wake_s:
            times.append(min(self._wake_s.values()))
        if self._dirty or self._dirty_models:
            return now
        if not times:
            return None
        return max(now, min(times))

    # ------------------------------------------------------------------ batching

    def _queue(self, key: RequestKey) -> RequestQueue:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = RequestQueue(key)
        return queue

    def _policy(self, model: str) -> BatchPolicy:
        policy = self._policies.get(model)
        if policy is None:
            cfg = self.config.batching_for(model)
            if cfg.policy == "carpool":
                policy = DeadlinePolicy(cfg.max_batch, cfg.max_wait_s, cfg.margin_s)
            else:
                policy = FixedPolicy(cfg.max_batch, cfg.max_wait_s)
            self._policies[model] = policy
        return policy

    def _lane(self, model: str, engine_max: int, preferred: Sequence[int]) -> Lane:
        cfg: BatchingConfig = self.config.batching_for(model)
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
        per_model = self._queued_samples.setdefault(req.model, [0, 0])
        per_model[req.priority] += req.samples

    def _dequeued(self, req: PendingRequest) -> None:
        self.queued -= 1
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
        cap = self.config.batching_for(model).max_batch
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
            # BatchItem.to_wire, inlined: this runs for every request.
            item: dict[str, Any] = {
                "id": req.request_id,
                "n": req.samples,
                "simple": req.simple,
                "queue_ms": round(1000.0 * (now - req.arrival_s), 3),
            }
            if req.shm is not None:
                item["shm"] = req.shm
            if req.shm_outputs:
                item["shm_outputs"] = True
            items.append(item)
        frames: list[Any]
        if local:
            batch = BatchMeta(batch_id, model, self._local_batch_inputs(key), tuple(items))
            frames = [_BATCH_HEADER, batch, *payloads]
        else:
            meta = {
                "batch": batch_id,
                "model": model,
                "inputs": self._inputs_wire(key),
                "requests": items,
            }
            frames = encode(Command.BATCH, meta, payloads)
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
            wire = self._inputs_cache[key] = [
                TensorMeta(name, dtype, (-1, *shape)).to_wire() for name, dtype, shape in key[1]
            ]
        return wire

    def _local_batch_inputs(self, key: RequestKey) -> tuple[TensorMeta, ...]:
        """The BATCH inputs of a queue key as TensorMetas (dim 0 = -1), built once per key."""
        metas = self._local_inputs.get(key)
        if metas is None:
            metas = self._local_inputs[key] = tuple(
                TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in key[1]
            )
        return metas

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
        return self._error(
            req.client, req.delimited, req.request_id, code, message, simple=req.simple
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
                }
                for w in self.registry.all()
            ],
        }


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


def _disconnect(wid: WorkerId, reason: str) -> Outgoing:
    return Outgoing(_BACKEND, wid, encode(Command.DISCONNECT, {"reason": reason}))


def _conform(
    spec: ModelSpec,
    inputs: Sequence[TensorMeta],
    payloads: Sequence[Frame],
    refs: Sequence[ShmRef | None] | None = None,
) -> tuple[tuple[TensorMeta, ...], tuple[int, ...], int]:
    """Check a request against the model's inputs; return them in spec order, the index
    of each one's payload among the request's frames, and the request's sample count
    (dim 0, equal across inputs)."""
    check_frame_sizes(inputs, payloads, refs)
    given = {t.name: (i, t) for i, t in enumerate(inputs)}
    expected = [t.name for t in spec.inputs]
    if set(given) != set(expected):
        raise ProtocolError(
            f"model {spec.name!r} takes inputs {expected}, request has {sorted(given)}"
        )
    ordered_inputs: list[TensorMeta] = []
    order: list[int] = []
    samples = -1
    for want in spec.inputs:
        index, got = given[want.name]
        if got.dtype != want.dtype:
            raise ProtocolError(f"input {want.name!r}: dtype {got.dtype}, model takes {want.dtype}")
        if len(got.shape) != len(want.shape):
            raise ProtocolError(
                f"input {want.name!r}: shape {list(got.shape)} has rank {len(got.shape)}, "
                f"model takes rank {len(want.shape)} {_spec_shape(want.shape)}"
            )
        for g, w in zip(got.shape[1:], want.shape[1:], strict=True):
            if w != -1 and g != w:
                raise ProtocolError(
                    f"input {want.name!r}: shape {list(got.shape)} does not fit "
                    f"{_spec_shape(want.shape)}"
                )
        if samples not in (-1, got.shape[0]):
            raise ProtocolError("all inputs of a request must have the same dim 0 (samples)")
        samples = got.shape[0]
        ordered_inputs.append(got)
        order.append(index)
    return tuple(ordered_inputs), tuple(order), samples


def _signature(submit: Submit) -> tuple[str, Signature]:
    """The lookup key of a request's layout, as _admit_known builds it from raw meta
    (the model name and tensor_signature of the inputs)."""
    return (submit.model, tuple((t.name, t.dtype, t.shape) for t in submit.inputs))


def _spec_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("?" if d == -1 else str(d) for d in shape) + "]"
