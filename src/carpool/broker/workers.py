"""workers.py: WorkerEvents — messages from workers: READY, RESULT, FAILED, heartbeats,
DISCONNECT, the loss of a worker, and the engine watchdog.

Pure: ``now`` comes in. A RESULT answers its batch's requests with the worker's reply
frames as they arrived (never read or copied) and teaches the worker's lane its cost; a
FAILED answers them with the worker's error; a lost worker's batches go back to their
queues while their attempts and deadlines allow. A worker that breaks the protocol is
dropped (it may reconnect and register again). A worker whose batch outruns the
watchdog (:mod:`carpool.broker.inflight`) stays registered but turns UNHEALTHY
(:class:`~carpool.broker.registry.Health`): its batches go back to their queues as a
lost worker's do, and it gets no more until it shows progress.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.broker.backlog import Backlog
from carpool.broker.config import BrokerConfig
from carpool.broker.fleet import FleetModel
from carpool.broker.inflight import InflightBatch
from carpool.broker.registry import Health, WorkerRegistry, WorkerState
from carpool.broker.replies import (
    Outgoing,
    ToClient,
    disconnect,
    heartbeat,
    request_error,
    retry_after_ms,
)
from carpool.broker.requests import RequestState, WorkerId
from carpool.broker.stats import Notes, batch_log, batch_record
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.peer_names import peer_tag
from carpool.common.protocol import (
    MAX_TIMEOUT_MS,
    Command,
    FailedMeta,
    Frame,
    ModelSpec,
    Ready,
    ResultMeta,
)
from carpool.common.protocol import from_worker as msgs
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog

logger = logging.getLogger(__name__)

#: The longest engine time a RESULT may report and be learned from: no request waits longer.
_MAX_COMPUTE_MS = float(MAX_TIMEOUT_MS)
#: The commands whose message from a stranger counts as a late answer to a batch.
_BATCH_ANSWERS = (Command.RESULT, Command.FAILED)
# Enum members as globals, for speed: docs/benchmarks.md "Why the hot path looks as it does".
_DISPATCHED, _DONE = RequestState.DISPATCHED, RequestState.DONE
_HEALTHY = Health.HEALTHY


def _peer_log() -> RateLimitedLog:
    return RateLimitedLog(logger, PEER_LINES_PER_MIN)


@dataclass(slots=True, eq=False, repr=False)
class WorkerEvents:
    """Worker messages and losses; see the module docstring."""

    config: BrokerConfig
    registry: WorkerRegistry
    backlog: Backlog
    fleet: FleetModel
    # Follow-ups for the core, which takes them after each call (they are marked for
    # the pumps at the end of the turn): the models a worker of which freed a slot, and
    # those whose workers changed (one joined, left, or changed health).
    freed_models: set[str] = field(init=False, default_factory=set)
    changed_models: set[str] = field(init=False, default_factory=set)
    #: What it did that the stats count, for the core to take into them.
    notes: Notes = field(init=False, default_factory=Notes)
    # Lines a peer on the worker socket can cause, each kind rate-limited apart.
    _log_protocol: RateLimitedLog = field(init=False, default_factory=_peer_log)
    _log_refused: RateLimitedLog = field(init=False, default_factory=_peer_log)
    _log_failed: RateLimitedLog = field(init=False, default_factory=_peer_log)
    _log_churn: RateLimitedLog = field(
        init=False,
        default_factory=lambda: RateLimitedLog(logger, 2 * PEER_LINES_PER_MIN, level=logging.INFO),
    )

    def on_heartbeats_due(self, now: float, out: list[Outgoing]) -> None:
        """The registry's next event is due: lose the workers whose heartbeats stopped,
        and send the heartbeats that are due."""
        registry = self.registry
        silent = registry.expired(now)
        # All of them go before any is mourned: requests requeued from one must not be
        # sent to another that is gone too (an attempt spent, a batch to nobody).
        for worker in silent:
            registry.remove(worker.wid)
        for worker in silent:
            self.lose_worker(now, worker, "heartbeat expired", out)
        for worker in registry.all():
            if worker.next_heartbeat_s <= now:
                worker.next_heartbeat_s = now + worker.heartbeat_s
                out.append(heartbeat(worker.wid))
        registry.reschedule()

    def on_worker(self, now: float, identity: bytes, msg: msgs.FromWorker) -> list[Outgoing]:
        """A worker's message, as its transport decoded it (``decode_from_worker``)."""
        wid = WorkerId(identity)
        out: list[Outgoing] = []
        try:
            if isinstance(msg, msgs.WorkerReady):
                raise ProtocolError("READY goes to on_ready")  # (the core routes it there)
            if isinstance(msg, msgs.WorkerMalformed) and msg.command is None:
                raise ProtocolError(msg.error)  # whoever sent it
            worker = self.registry.touch(now, wid)
            if worker is None:
                if not isinstance(msg, msgs.WorkerDisconnect):
                    # MDP rule: an unknown peer must re-register on a fresh socket.
                    out.append(disconnect(wid, "unknown worker; reconnect and send READY"))
                if isinstance(msg, msgs.WorkerResult | msgs.WorkerFailed) or (
                    isinstance(msg, msgs.WorkerMalformed) and msg.command in _BATCH_ANSWERS
                ):
                    self.notes.late_results += 1
                return out
            if isinstance(msg, msgs.WorkerResult):
                if msg.result.telemetry is not None:
                    worker.on_telemetry(msg.result.telemetry)
                self._on_result(now, worker, msg.result, msg.replies, out)
            elif isinstance(msg, msgs.WorkerHeartbeat):
                if msg.telemetry is not None:
                    worker.on_telemetry(msg.telemetry)
                if msg.rho is not None:
                    self.fleet.on_load(now, worker, msg.rho)
                if msg.busy_ms is not None and worker.health is Health.UNHEALTHY:
                    self._on_busy(now, worker, msg.busy_ms, out)
            elif isinstance(msg, msgs.WorkerFailed):
                self._on_failed(now, worker, msg.failed, out)
            elif isinstance(msg, msgs.WorkerDisconnect):
                self.lose_worker(now, worker, "worker disconnected", out)
            else:
                raise ProtocolError(msg.error)
        except ProtocolError as exc:
            # A worker that breaks the protocol is dropped; it may reconnect and re-register.
            self._log_protocol("worker peer=%s protocol error: %s", peer_tag(wid), exc, now=now)
            worker = self.registry.get(wid)
            if worker is not None:
                self.lose_worker(now, worker, f"protocol error: {exc}", out)
            out.append(disconnect(wid, f"protocol error: {exc}"))
        return out

    def on_ready(
        self, now: float, wid: WorkerId, ready: Ready, out: list[Outgoing]
    ) -> list[ModelSpec] | None:
        """A worker's READY: register it (a second READY ends the first registration),
        or refuse it with DISCONNECT (then None). Returns the registered specs its
        models replaced (a model no live worker served, back with another spec): the
        caller answers the queued requests they no longer fit, and lets in the requests
        held for its models."""
        old = self.registry.get(wid)
        if old is not None:
            # A second READY on one connection: the old registration ends either way.
            self.lose_worker(now, old, "worker re-registered", out)
        limit = self.config.max_models_per_worker
        if len(ready.models) > limit:
            # Refused whole: serving only some of what it announced would leave the worker
            # taking batches for models it believes the broker refused, or the reverse.
            reason = (
                f"READY announces {len(ready.models)} models; this broker takes at most "
                f"{limit} per worker (max_models_per_worker)"
            )
            self._log_refused(
                "worker peer=%s name=%s refused: %s", peer_tag(wid), ready.name, reason, now=now
            )
            out.append(disconnect(wid, reason))
            return None
        if len(self.registry) >= self.config.max_workers:
            reason = (
                f"this broker has its limit of {self.config.max_workers} workers registered "
                "(max_workers)"
            )
            self._log_refused(
                "worker peer=%s name=%s refused: %s", peer_tag(wid), ready.name, reason, now=now
            )
            out.append(disconnect(wid, reason))
            return None
        conflicts = self.registry.conflicts(ready)
        if conflicts:
            reason = f"model spec differs from the registered one for {', '.join(conflicts)}"
            self._log_refused(
                "worker peer=%s name=%s refused: %s", peer_tag(wid), ready.name, reason, now=now
            )
            out.append(disconnect(wid, reason))
            return None
        replaced = list(self.registry.replaced(ready))
        lanes = {
            m.name: self.fleet.lane(m.name, m.max_batch, m.preferred_batch) for m in ready.models
        }
        self.registry.add(now, wid, ready, ready.heartbeat_ms / 1000.0, lanes)
        self.fleet.rates.clear()
        names = [m.name for m in ready.models]
        # B_max and the limit that binds it, per model: broker cap, worker limit, adaptive.
        limits = [f"{n}:{lanes[n].batch_limit}({lanes[n].bound_by})" for n in names[:8]]
        self._log_churn(
            "worker joined name=%s peer=%s slots=%d b_max=%s",
            ready.name,
            peer_tag(wid),
            ready.slots,
            ",".join(limits) + (f",... ({len(names)} models)" if len(names) > 8 else ""),
            now=now,
        )
        return replaced

    def _on_result(
        self,
        now: float,
        worker: WorkerState,
        result: ResultMeta,
        reply_frames: Sequence[Frame],
        out: list[Outgoing],
    ) -> None:
        batch = self._take_batch(now, worker, result.batch_id, out, result.compute_ms)
        if batch is None:
            return
        if worker.health is not _HEALTHY:
            self.registry.set_health(now, worker, Health.HEALTHY)
            self.fleet.rates.clear()  # its share of the fleet's rate changed
        self._learn(worker, batch, result.compute_ms)
        if 0 < result.cpu_ms <= _MAX_COMPUTE_MS:
            lane = worker.lanes.get(batch.key[0])
            if lane is not None:
                lane.observe_cpu(batch.key, batch.samples, result.cpu_ms / 1000.0)
        compute_s = result.compute_ms / 1000.0
        if batch_log.isEnabledFor(logging.DEBUG):
            batch_record(now, worker, batch, result.compute_ms)
        if 0 <= result.rho <= 1:  # as HEARTBEAT's: a load out of range is ignored
            self.fleet.on_load(now, worker, result.rho)
        if len(result.frames) != len(batch.requests) or sum(result.frames) != len(reply_frames):
            msg = (
                f"worker {worker.name} returned a malformed result for batch {batch.batch_id}: "
                f"{len(result.frames)} replies / {len(reply_frames)} frames for "
                f"{len(batch.requests)} requests"
            )
            logger.error("%s", msg)
            self.fail_batch(batch, ErrorCode.INTERNAL, msg, out)
        else:
            self.backlog.answered(batch.requests)
            start = 0
            for req, count in zip(batch.requests, result.frames, strict=True):
                stop = start + count
                if req.state is _DONE:  # else answered already (expired)
                    # Replies.to_client, inlined: the slice is this message's list.
                    # speed: docs/benchmarks.md "Why the hot path looks as it does"
                    frames = reply_frames[start:stop]
                    if req.delimited:
                        frames = [b"", *frames]
                    out.append(ToClient(req.client, frames))
                start = stop
            notes = self.notes
            notes.answered.append((now, batch.key[0], batch.requests, batch.sent_s, compute_s))
            if result.padding is not None:
                notes.padded.append((batch.key, batch.samples, result.padding))
        self.freed_models.update(worker.models)

    def _on_failed(
        self, now: float, worker: WorkerState, failed: FailedMeta, out: list[Outgoing]
    ) -> None:
        batch = self._take_batch(now, worker, failed.batch_id, out)
        if batch is None:
            return
        if worker.health is not _HEALTHY:
            self.registry.set_health(now, worker, Health.HEALTHY)
            self.fleet.rates.clear()  # its share of the fleet's rate changed
        if 0 <= failed.rho <= 1:
            self.fleet.on_load(now, worker, failed.rho)
        self._log_failed(
            "batch failed worker=%s model=%s code=%s: %s",
            worker.name,
            batch.key[0],
            failed.code.name,
            failed.message,
            now=now,
        )
        self.fail_batch(batch, failed.code, failed.message, out)
        self.freed_models.update(worker.models)

    def _take_batch(
        self,
        now: float,
        worker: WorkerState,
        batch_id: int,
        out: list[Outgoing],
        compute_ms: float = 0.0,
    ) -> InflightBatch | None:
        batch = self.registry.answered(now, worker, batch_id)
        if batch is None:
            # A batch this worker no longer owns (it was requeued after a presumed loss, or
            # the watchdog gave up on it): dropped, but the engine did finish something.
            self.notes.late_results += 1
            hung = self.registry.answered_late(worker, batch_id)
            if hung is not None:
                # The batch that outran the watchdog: its time teaches the lane all the
                # same, or a model slower than the slack could never be served.
                self._learn(worker, hung, compute_ms)
            if worker.health is Health.UNHEALTHY:
                self._recovered(now, worker, "a late answer came", out)
            return None
        return batch

    def _learn(self, worker: WorkerState, batch: InflightBatch, compute_ms: float) -> None:
        lane = worker.lanes.get(batch.key[0])
        # A time no batch can take (longer than any deadline) would only break the fit.
        if (
            lane is not None
            and 0 < compute_ms <= _MAX_COMPUTE_MS
            and lane.observe(batch.key, batch.samples, compute_ms / 1000.0)
        ):
            self.fleet.rates.pop(batch.key, None)  # (cached until a cost is refitted)

    def _on_busy(self, now: float, worker: WorkerState, busy_ms: int, out: list[Outgoing]) -> None:
        """An UNHEALTHY worker's HEARTBEAT says how long its inference thread has run its
        batch: idle, or started after the trip, it has moved on from the batch that hung.
        (A HEARTBEAT without ``busy_ms`` says nothing either way.)"""
        if busy_ms / 1000.0 < now - worker.unhealthy_since_s:
            self._recovered(now, worker, f"its inference thread has run {busy_ms} ms", out)

    def _recovered(self, now: float, worker: WorkerState, why: str, out: list[Outgoing]) -> None:
        """An UNHEALTHY worker showed progress: one credit, until it answers a batch."""
        self.registry.set_health(now, worker, Health.PROBATION)
        self.fleet.rates.clear()  # its share of the fleet's rate changed
        logger.info("worker on probation name=%s: %s", worker.name, why)
        self.changed_models.update(worker.models)

    def fail_batch(
        self, batch: InflightBatch, code: ErrorCode, message: str, out: list[Outgoing]
    ) -> None:
        for req in batch.requests:
            if self.backlog.failed(req):
                hint = None
                if code is ErrorCode.OVERLOADED:  # (§12 wants a hint with it)
                    # The drain time of what waits ahead of it, and of itself.
                    ahead = self.backlog.samples_ahead(req.model, int(req.priority)) + req.samples
                    drain_s = self.fleet.drain_time_s(req.model, req.key, ahead)
                    hint = retry_after_ms(drain_s or 0.05)
                out.append(request_error(self.notes, req, code, message, hint=hint))

    def lose_worker(
        self, now: float, worker: WorkerState, reason: str, out: list[Outgoing]
    ) -> None:
        """Forget a worker; its in-flight requests go back to their queues when they may."""
        self.registry.remove(worker.wid)
        self.fleet.rates.clear()
        self._log_churn(
            "worker left name=%s peer=%s reason=%s",
            worker.name,
            peer_tag(worker.wid),
            reason,
            now=now,
        )
        msg = f"worker {worker.name} was lost while running the request ({reason})"
        self._requeue(now, worker, msg, out)

    def on_watchdog(self, now: float, out: list[Outgoing]) -> None:
        """Batches have outrun the watchdog: their workers turn UNHEALTHY, and everything
        those hold goes back to the queues as a lost worker's does."""
        for batch in self.registry.overdue(now):
            worker = self.registry.get(batch.worker)
            if worker is None or batch.batch_id not in worker.outstanding:
                continue
            logger.warning(
                "worker unhealthy name=%s: batch %d of model %s has run %.3f s, "
                "predicted %.3f s (limit %.3f s)",
                worker.name,
                batch.batch_id,
                batch.key[0],
                now - batch.head_s,
                batch.predicted_s,
                batch.watch_s,
            )
            self.registry.set_health(now, worker, Health.UNHEALTHY)
            self.fleet.rates.clear()  # its share of the fleet's rate changed
            self.notes.unhealthy += 1
            msg = f"worker {worker.name} did not answer the request's batch in time (watchdog)"
            self._requeue(now, worker, msg, out)
            self.registry.hung(batch)

    def _requeue(self, now: float, worker: WorkerState, message: str, out: list[Outgoing]) -> None:
        """Take every batch ``worker`` holds; each request goes back to its queue while its
        attempts and deadline allow, or is answered UNAVAILABLE."""
        for batch in self.registry.take_all(worker):
            # Newest batch first and each batch back to front, so push_front keeps FIFO order.
            for req in reversed(batch.requests):
                if req.state is not _DISPATCHED:
                    continue
                if (
                    req.attempts < self.config.max_attempts
                    and now < req.deadline_s
                    and not self.backlog.stopping
                ):
                    self.backlog.requeue(req)
                    self.notes.requeued += 1
                else:
                    self.backlog.failed(req)  # (it is at its worker: DISPATCHED, above)
                    out.append(request_error(self.notes, req, ErrorCode.UNAVAILABLE, message))
        self.changed_models.update(worker.models)
