"""core.py: BrokerCore — the whole broker as a pure state machine.

Inputs are events with ``now`` (monotonic seconds): a client message, a worker message, a
tick, a peer that could not be sent to. Each returns the list of :class:`Outgoing` messages
to send. No sockets, threads or clocks here; ``server.py`` owns those.

Three layers of one class, one module each: :mod:`carpool.broker.scheduler` (the state,
the queues' pump, shedding and dispatch, error replies, the STATS snapshot),
:mod:`carpool.broker.admission` (client messages: validation, the door checks, queueing)
and this one (worker messages: READY, RESULT, FAILED, heartbeats, loss; the clock).

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
from collections.abc import Sequence
from typing import Any

from carpool.broker.admission import Admission
from carpool.broker.batcher import RequestState
from carpool.broker.registry import WorkerId, WorkerState
from carpool.broker.scheduler import (
    _BACKEND,
    _DISPATCHED,
    _DONE,
    _FRONTEND,
    _QUEUED,
    EMBEDDED_ID,
    LINK_ID,
    BrokerStats,
    InflightBatch,
    Outgoing,
    Side,
    _finish,
)
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    MAX_TIMEOUT_MS,
    Command,
    FailedMeta,
    Frame,
    Ready,
    ResultMeta,
    decode_meta,
    encode,
    parse_header,
    view,
)

logger = logging.getLogger(__name__)

__all__ = [
    "EMBEDDED_ID",
    "LINK_ID",
    "BrokerCore",
    "BrokerStats",
    "InflightBatch",
    "Outgoing",
    "Side",
]

#: How often on_tick looks for idle queues to forget (a queue idle for a second goes).
_SWEEP_S = 0.5
#: The longest engine time a RESULT may report and be learned from: no request waits longer.
_MAX_COMPUTE_MS = float(MAX_TIMEOUT_MS)
_NO_META: dict[str, Any] = {}  # the meta of a message that came as an object (never mutated)


class BrokerCore(Admission):
    """The broker's state machine, in three layers: :class:`BatchScheduler` (state,
    queues, the pump and dispatch), :class:`Admission` (client messages) and this one
    (worker messages, the clock); see the module docstring."""

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
        for spec in self.registry.replaced(ready):
            self._respec(spec, ready.name, out)
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
        # A time no batch can take (longer than any deadline) would only break the fit.
        if lane is not None and 0 < result.compute_ms <= _MAX_COMPUTE_MS:
            lane.observe(batch.key, batch.samples, result.compute_ms / 1000.0)
            self._fleet_rates.pop(batch.key, None)
        if 0 <= result.rho <= 1:  # as HEARTBEAT's: a load out of range is ignored
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
        if 0 <= failed.rho <= 1:
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
                if (
                    req.attempts < self.config.max_attempts
                    and now < req.deadline_s
                    and not self.stopping
                ):
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

    # ------------------------------------------------------------------ stopping

    def begin_stop(self, now: float) -> list[Outgoing]:
        """The broker is stopping: answer every queued request UNAVAILABLE now, and
        refuse new ones; batches already at workers may still finish (``finish_stop``)."""
        self.stopping = True
        out: list[Outgoing] = []
        msg = "the broker is stopping before the request was dispatched; retry"
        for queue in self._queues.values():
            for req in list(queue):
                self._answer_queued(queue, req, ErrorCode.UNAVAILABLE, msg, out)
        self._dirty.clear()
        self._dirty_models.clear()
        self._wake_s.clear()
        return out

    def finish_stop(self, now: float) -> list[Outgoing]:
        """The last word: answer what is still at workers UNAVAILABLE and tell every
        worker over a socket to go (DISCONNECT), so none waits out its heartbeats."""
        out = self.begin_stop(now) if not self.stopping else []
        msg = "the broker stopped before the request's batch finished; retry"
        for batch in self._inflight.values():
            self._fail_batch(batch, ErrorCode.UNAVAILABLE, msg, out)
        self._inflight.clear()
        for worker in list(self.registry.all()):
            worker.outstanding.clear()
            out.append(_disconnect(worker.wid, "broker stopping"))
        return out

    @property
    def inflight_batches(self) -> int:
        return len(self._inflight)

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
        touched = self._expire(now, out)
        event_s = self.registry.next_event_s()
        if event_s is not None and event_s <= now:
            silent = self.registry.expired(now)
            # All of them go before any is mourned: requests requeued from one must not be
            # sent to another that is gone too (an attempt spent, a batch to nobody).
            for worker in silent:
                self.registry.remove(worker.wid)
            for worker in silent:
                self._lose_worker(now, worker, "heartbeat expired", out)
            for worker in self.registry.all():
                if worker.next_heartbeat_s <= now:
                    worker.next_heartbeat_s = now + worker.heartbeat_s
                    out.append(Outgoing(_BACKEND, worker.wid, encode(Command.HEARTBEAT, {})))
            self.registry.reschedule()
        for key in touched:  # what waited behind an expired request, now the fleet is known
            self._pump(now, self._queues[key], out)
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


def _disconnect(wid: WorkerId, reason: str) -> Outgoing:
    return Outgoing(_BACKEND, wid, encode(Command.DISCONNECT, {"reason": reason}))
