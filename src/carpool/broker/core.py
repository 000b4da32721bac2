"""core.py: BrokerCore — the whole broker as a pure state machine.

Inputs are events with ``now`` (monotonic seconds): a client message, a worker message, a
tick, a peer that could not be sent to. Each returns the list of :class:`Outgoing` messages
to send. No sockets, threads or clocks here; ``server.py`` owns those.

Invariants:
- every client request gets exactly one reply: its result or a typed error;
- tensor payload frames are forwarded as the objects that arrived, never read or copied;
- a worker never holds more batches than its credits (slots);
- a batch never exceeds the policy's size nor mixes request keys (model + item shapes).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from carpool.broker.batcher import (
    ClientId,
    DeadlineHeap,
    PendingRequest,
    RequestKey,
    RequestQueue,
    RequestState,
    request_key,
)
from carpool.broker.config import BrokerConfig
from carpool.broker.policy import BatchPolicy, Dispatch, FixedPolicy, QueueView
from carpool.broker.registry import WorkerId, WorkerRegistry, WorkerState
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    Command,
    ErrorReply,
    FailedMeta,
    Frame,
    ModelSpec,
    Ready,
    ResultMeta,
    Submit,
    TensorMeta,
    VersionMismatch,
    check_frame_sizes,
    decode_meta,
    decode_simple_request,
    decode_submit,
    encode,
    encode_error,
    is_simple_form,
    parse_header,
    request_id_of,
    view,
)

logger = logging.getLogger(__name__)


class Side(Enum):
    FRONTEND = "frontend"  # clients
    BACKEND = "backend"  # workers


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to send: to ``identity`` on the ROUTER of ``side``."""

    side: Side
    identity: bytes
    frames: list[Any]


@dataclass(slots=True)
class InflightBatch:
    batch_id: int
    worker: WorkerId
    model: str
    requests: list[PendingRequest]
    sent_s: float


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

    def batch(self, model: str, samples: int) -> None:
        self.batch_sizes.setdefault(model, Counter())[samples] += 1


class BrokerCore:
    """The broker's state: queues, in-flight batches, workers; see the module docstring."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
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
                return [self._to_client(client, delimited, encode(Command.STATS, self.snapshot()))]
            if command is not Command.REQUEST:
                raise ProtocolError(f"command {command.name} is not valid from a client")
            if len(frames) < 2:
                raise ProtocolError("REQUEST needs a meta frame")
            meta = decode_meta(view(frames[1]))
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
        except VersionMismatch as exc:
            code = ErrorCode.UNSUPPORTED_VERSION
            return [self._error(client, delimited, None, code, str(exc), simple=True)]
        except ProtocolError as exc:
            code = ErrorCode.INVALID_ARGUMENT
            return [self._error(client, delimited, None, code, str(exc), simple=True)]
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
        rid = submit.request_id
        spec = self.registry.specs.get(submit.model)
        if spec is None:
            msg = f"model {submit.model!r} is not served by any worker"
            return [self._error(client, delimited, rid, ErrorCode.NOT_FOUND, msg, simple=simple)]
        max_batch = self.registry.max_batch(submit.model)
        if max_batch == 0:
            msg = f"no live worker serves model {submit.model!r} right now"
            return [self._error(client, delimited, rid, ErrorCode.UNAVAILABLE, msg, simple=simple)]
        try:
            inputs, ordered, samples = _conform(spec, submit.inputs, payloads)
            if samples > max_batch:
                raise ProtocolError(
                    f"request has {samples} samples; model {spec.name!r} accepts at most "
                    f"{max_batch} per batch"
                )
        except ProtocolError as exc:
            code = ErrorCode.INVALID_ARGUMENT
            return [self._error(client, delimited, rid, code, str(exc), simple=simple)]
        if self.queued >= self.config.max_queued:
            retry_ms = max(1, round(1000 * self.config.batching_for(spec.name).max_wait_s))
            return [
                self._error(
                    client,
                    delimited,
                    rid,
                    ErrorCode.OVERLOADED,
                    f"broker queue full ({self.queued} requests)",
                    simple=simple,
                    retry_after_ms=retry_ms,
                )
            ]
        timeout_s = (
            submit.timeout_ms / 1000.0
            if submit.timeout_ms is not None
            else self.config.default_timeout_s
        )
        self._seq += 1
        req = PendingRequest(
            seq=self._seq,
            client=client,
            delimited=delimited,
            request_id=rid,
            simple=simple,
            model=spec.name,
            key=request_key(spec.name, inputs),
            samples=samples,
            priority=submit.priority,
            arrival_s=now,
            deadline_s=now + timeout_s,
            inputs=inputs,
            payloads=ordered,
        )
        queue = self._queue(req.key)
        queue.push(req)
        self.queued += 1
        self._deadlines.push(req)
        out: list[Outgoing] = []
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
                if command is Command.RESULT:
                    self.stats.late_results += 1
                return out
            if command is Command.HEARTBEAT:
                rho = meta.get("rho")
                if isinstance(rho, (int, float)) and not isinstance(rho, bool):
                    worker.rho = float(rho)
            elif command is Command.RESULT:
                self._on_result(now, worker, ResultMeta.from_wire(meta), frames[2:], out)
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
        conflicts = self.registry.conflicts(ready)
        if conflicts:
            reason = f"model spec differs from the registered one for {', '.join(conflicts)}"
            logger.warning("worker=%s name=%s refused: %s", wid.hex(), ready.name, reason)
            out.append(_disconnect(wid, reason))
            return
        old = self.registry.get(wid)
        if old is not None:
            self._lose_worker(now, old, "worker re-registered", out)
        self.registry.add(now, wid, ready, ready.heartbeat_ms / 1000.0)
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
        batch = self._take_batch(worker, result.batch_id)
        if batch is None:
            return
        worker.rho = result.rho
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
            for req, count in zip(batch.requests, result.frames, strict=True):
                frames = reply_frames[start : start + count]
                start += count
                if req.state is not RequestState.DISPATCHED:
                    continue  # already answered (deadline passed while in flight)
                req.state = RequestState.DONE
                self.stats.replies += 1
                out.append(self._to_client(req.client, req.delimited, frames))
        self._pump_models(now, worker.models, out)

    def _on_failed(
        self, now: float, worker: WorkerState, failed: FailedMeta, out: list[Outgoing]
    ) -> None:
        batch = self._take_batch(worker, failed.batch_id)
        if batch is None:
            return
        worker.rho = failed.rho
        logger.warning(
            "batch failed worker=%s model=%s code=%s: %s",
            worker.name,
            batch.model,
            failed.code.name,
            failed.message,
        )
        self._fail_batch(batch, failed.code, failed.message, out)
        self._pump_models(now, worker.models, out)

    def _take_batch(self, worker: WorkerState, batch_id: int) -> InflightBatch | None:
        batch = self._inflight.get(batch_id)
        if batch is None or batch.worker != worker.wid:
            # A batch this worker no longer owns (it was requeued after a presumed loss).
            self.stats.late_results += 1
            return None
        del self._inflight[batch_id]
        worker.outstanding.discard(batch_id)
        return batch

    def _fail_batch(
        self, batch: InflightBatch, code: ErrorCode, message: str, out: list[Outgoing]
    ) -> None:
        for req in batch.requests:
            if req.state is RequestState.DISPATCHED:
                req.state = RequestState.FAILED
                out.append(self._request_error(req, code, message))

    def _lose_worker(
        self, now: float, worker: WorkerState, reason: str, out: list[Outgoing]
    ) -> None:
        """Forget a worker; its in-flight requests go back to their queues when they may."""
        self.registry.remove(worker.wid)
        logger.info("worker left name=%s reason=%s", worker.name, reason)
        for batch_id in sorted(worker.outstanding, reverse=True):
            batch = self._inflight.pop(batch_id, None)
            if batch is None:
                continue
            # Newest batch first and each batch back to front, so push_front keeps FIFO order.
            for req in reversed(batch.requests):
                if req.state is not RequestState.DISPATCHED:
                    continue
                if req.attempts < self.config.max_attempts and now < req.deadline_s:
                    req.state = RequestState.QUEUED
                    self._queue(req.key).push_front(req)
                    self.queued += 1
                    self.stats.requeued += 1
                else:
                    req.state = RequestState.FAILED
                    msg = f"worker {worker.name} was lost while running the request ({reason})"
                    out.append(self._request_error(req, ErrorCode.UNAVAILABLE, msg))
        worker.outstanding.clear()
        self._pump_models(now, worker.models, out)

    def on_unreachable(self, now: float, side: Side, identity: bytes) -> list[Outgoing]:
        """The shell could not send to a peer (gone, or its queue is full)."""
        out: list[Outgoing] = []
        if side is Side.FRONTEND:
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
        for req in self._deadlines.pop_expired(now):
            if req.state is RequestState.QUEUED:
                self._queues[req.key].forget(req)
                self.queued -= 1
            if self.registry.serving(req.model):
                code, msg = ErrorCode.DEADLINE_EXCEEDED, "deadline passed before a result"
            else:
                code, msg = ErrorCode.UNAVAILABLE, f"no live worker serves model {req.model!r}"
            req.state = RequestState.EXPIRED
            out.append(self._request_error(req, code, msg))
        for worker in self.registry.expired(now):
            self._lose_worker(now, worker, "heartbeat expired", out)
        for worker in self.registry.all():
            if worker.next_heartbeat_s <= now:
                worker.next_heartbeat_s = now + worker.heartbeat_s
                out.append(Outgoing(Side.BACKEND, worker.wid, encode(Command.HEARTBEAT, {})))
        for key in [k for k, t in self._wake_s.items() if t <= now]:
            self._pump(now, self._queues[key], out)
        for key in [k for k, q in self._queues.items() if q.count == 0 and q.head() is None]:
            del self._queues[key]
            self._wake_s.pop(key, None)
        return out

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time ``on_tick`` has work: a batch wait, a deadline, a heartbeat."""
        times = [t for t in (self._deadlines.earliest(), self.registry.next_event_s()) if t]
        if self._wake_s:
            times.append(min(self._wake_s.values()))
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
            policy = self._policies[model] = FixedPolicy(cfg.max_batch, cfg.max_wait_s)
        return policy

    def _pump_models(self, now: float, models: Iterable[str], out: list[Outgoing]) -> None:
        names = set(models)
        for queue in list(self._queues.values()):
            if queue.key[0] in names and queue.count:
                self._pump(now, queue, out)

    def _pump(self, now: float, queue: RequestQueue, out: list[Outgoing]) -> None:
        """Send every batch of ``queue`` that the policy lets leave now."""
        model = queue.key[0]
        policy = self._policy(model)
        self._wake_s.pop(queue.key, None)
        while True:
            head = queue.head()
            if head is None:
                return
            worker = self.registry.best_free(model, head.samples)
            if worker is None:
                return  # a RESULT, READY or worker loss will pump again
            room = worker.models[model].max_batch
            decision = policy.decide(now, QueueView(queue.samples, head.arrival_s), room)
            if not isinstance(decision, Dispatch):
                self._wake_s[queue.key] = decision.t
                return
            # A request larger than the policy's size still travels alone rather than starve.
            requests = queue.take(min(room, max(decision.max_samples, head.samples)))
            self.queued -= len(requests)
            out.append(self._dispatch(now, worker, queue.key, requests))

    def _dispatch(
        self, now: float, worker: WorkerState, key: RequestKey, requests: list[PendingRequest]
    ) -> Outgoing:
        self._batch_seq += 1
        batch_id = self._batch_seq
        model, items = key
        payloads: list[Frame] = []
        batch_items = []
        for req in requests:
            req.state = RequestState.DISPATCHED
            req.attempts += 1
            payloads.extend(req.payloads)
            batch_items.append(
                BatchItem(req.request_id, req.samples, req.simple, 1000.0 * (now - req.arrival_s))
            )
        meta = BatchMeta(
            batch_id,
            model,
            tuple(TensorMeta(name, dtype, (-1, *shape)) for name, dtype, shape in items),
            tuple(batch_items),
        )
        self._inflight[batch_id] = InflightBatch(batch_id, worker.wid, model, requests, now)
        worker.outstanding.add(batch_id)
        self.stats.batch(model, sum(r.samples for r in requests))
        logger.debug(
            "dispatch batch=%d model=%s n=%d worker=%s", batch_id, model, len(requests), worker.name
        )
        return Outgoing(Side.BACKEND, worker.wid, encode(Command.BATCH, meta.to_wire(), payloads))

    # ------------------------------------------------------------------ replies

    def _to_client(self, client: ClientId, delimited: bool, frames: Sequence[Any]) -> Outgoing:
        return Outgoing(Side.FRONTEND, client, [b"", *frames] if delimited else list(frames))

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
            "workers": [
                {
                    "name": w.name,
                    "models": sorted(w.models),
                    "slots": w.slots,
                    "outstanding": len(w.outstanding),
                    "rho": w.rho,
                }
                for w in self.registry.all()
            ],
        }


def _disconnect(wid: WorkerId, reason: str) -> Outgoing:
    return Outgoing(Side.BACKEND, wid, encode(Command.DISCONNECT, {"reason": reason}))


def _conform(
    spec: ModelSpec, inputs: Sequence[TensorMeta], payloads: Sequence[Frame]
) -> tuple[tuple[TensorMeta, ...], list[Frame], int]:
    """Check a request against the model's inputs; return them in spec order with their
    payloads, and the request's sample count (dim 0, equal across inputs)."""
    check_frame_sizes(inputs, payloads)
    given = {t.name: (t, p) for t, p in zip(inputs, payloads, strict=True)}
    expected = [t.name for t in spec.inputs]
    if set(given) != set(expected):
        raise ProtocolError(
            f"model {spec.name!r} takes inputs {expected}, request has {sorted(given)}"
        )
    ordered_inputs: list[TensorMeta] = []
    ordered_payloads: list[Frame] = []
    samples = -1
    for want in spec.inputs:
        got, payload = given[want.name]
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
        ordered_payloads.append(payload)
    return tuple(ordered_inputs), ordered_payloads, samples


def _spec_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("?" if d == -1 else str(d) for d in shape) + "]"
