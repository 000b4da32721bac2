"""core.py: BrokerCore — the whole broker as a pure state machine, a façade over its parts.

Inputs are events with ``now`` (monotonic seconds): a client message, a worker message, a
tick, a peer that could not be sent to. Each returns the list of :data:`Outgoing` messages
to send (:class:`ToClient` frames, or :class:`ToWorker` typed messages). No sockets,
threads or clocks here; ``server.py`` owns those.

The parts, one concern each, composed here (docs/architecture.md has the owner table):
the request book, the backlog (queues, deadlines), the worker registry (with the batches
at its workers), the fleet model, the dispatcher and its pumps, the client intake and
the pure :func:`~carpool.broker.admission.admit`, the requests held at the door, resends
and CANCEL, the worker events, replies and stats (of which the dispatcher and the worker
events keep notes, which the core takes).

Messages only queue work; the tick that ends each loop turn (the server's and the
simulator's alike) forms batches for everything that arrived in it. A client's message is
decoded once (:func:`~carpool.common.protocol.decode_from_client`, with the layouts the
door checked before), a worker's by its transport; each is routed by its type. The core
is the one place where the parts meet: they return outputs and follow-ups, it routes.

Invariants:
- every client request gets exactly one reply: its result or a typed error;
- tensor payload frames are forwarded as the objects that arrived, never read or copied;
- a worker never holds more batches than its credits (slots);
- a batch never exceeds the policy's size nor mixes request keys (model + item shapes).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from carpool.broker import metadata, replies
from carpool.broker.admission import Layout, full, misfits, unfinishable
from carpool.broker.backlog import Backlog
from carpool.broker.config import BrokerConfig
from carpool.broker.dispatcher import Dispatcher
from carpool.broker.fleet import FleetModel
from carpool.broker.holding import HeldRequests
from carpool.broker.intake import ClientIntake, Resends
from carpool.broker.pumps import Pumps
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Outgoing, Side, ToClient, ToWorker, disconnect
from carpool.broker.requests import ClientId, Origin, PendingRequest, RequestBook, WorkerId
from carpool.broker.snapshot import model_table, snapshot
from carpool.broker.stats import BrokerStats
from carpool.broker.workers import WorkerEvents
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Cancel,
    ClientMalformed,
    Command,
    Frame,
    FromWorker,
    MetadataRequest,
    Ready,
    Request,
    WorkerReady,
    decode_from_client,
    encode,
)

logger = logging.getLogger(__name__)

__all__ = ["BrokerCore", "BrokerStats", "Outgoing", "Side", "ToClient", "ToWorker"]

#: How often on_tick looks for idle queues to forget (a queue idle for a second goes).
_SWEEP_S = 0.5


class BrokerCore:
    """The broker's state machine; see the module docstring."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config = config or BrokerConfig()
        self.registry = registry = WorkerRegistry(
            liveness=config.liveness,
            watchdog_factor=config.watchdog_factor,
            watchdog_slack_s=config.watchdog_slack_s,
        )
        self._stats = stats = BrokerStats()
        self.book = book = RequestBook()
        self.backlog = backlog = Backlog(book)
        self.fleet = fleet = FleetModel(config, registry)
        backlog.batch_unit = fleet.batch_unit
        self.dispatcher = Dispatcher(backlog, fleet, registry)
        self.pumps = Pumps(backlog, registry, fleet)
        self.holding = holding = HeldRequests(config, backlog, stats)
        self.resends = Resends(book, holding, stats)
        self.intake = intake = ClientIntake(config, registry, backlog, fleet)
        self.workers = WorkerEvents(config, registry, backlog, fleet)
        #: The request layouts the door checked before: each client message is decoded
        #: with them (a request of one comes with its queue key and sample count).
        self.layouts = intake.layouts
        # Who may read STATS, by client id (None: everyone); the server sets it.
        self.stats_gate: Callable[[bytes], bool] | None = None
        self._sweep_s = 0.0  # when on_tick next looks for idle queues to forget
        #: The thread that runs the core's events (its builder's; the server's loop sets it).
        self.loop_thread = threading.get_ident()
        #: How each worker is connected, by its id, as STATS names it ("zeromq", "local",
        #: "embedded"): the server's transports say (a core without one: all "zeromq").
        self.worker_transport: Callable[[bytes], str] = lambda wid: "zeromq"

    # ------------------------------------------------------------------ the server's knobs

    @property
    def started_s(self) -> float:
        """When the broker began serving (the server sets it): for register_grace_s after
        it, a model no worker has registered yet is held (:meth:`expect`) or UNAVAILABLE."""
        return self.intake.started_s

    @started_s.setter
    def started_s(self, now: float) -> None:
        self.intake.started_s = now
        self.holding.until_s = now + self.config.register_grace_s

    def expect(self, names: Iterable[str]) -> None:
        """Besides the configuration's ``[models.<name>]``, the models whose requests wait
        at the door in the grace window (the server passes those of its last trace)."""
        self.holding.expect(names)

    @property
    def stopping(self) -> bool:
        """Set by begin_stop: new requests are refused and nothing more is dispatched."""
        return self.backlog.stopping

    @property
    def stats(self) -> BrokerStats:
        """The counters. Read on :attr:`loop_thread`, what the parts noted since is counted
        in first; another thread reads them as that thread last did (each sweep does)."""
        stats = self._stats
        if threading.get_ident() == self.loop_thread:  # (the parts note on that thread)
            stats.take(self.dispatcher.notes)
            stats.take(self.workers.notes)
        return stats

    @property
    def queued(self) -> int:
        return self.backlog.queued

    @property
    def inflight_batches(self) -> int:
        return self.registry.batches_held

    # ------------------------------------------------------------------ messages

    def on_client(self, now: float, identity: bytes, frames: Sequence[Frame]) -> list[Outgoing]:
        """A client's message (its frames after the routing id): decoded once, with the
        layouts the door remembers, and handled by its type."""
        msg = decode_from_client(frames, self.layouts)
        client = ClientId(identity)
        self._stats.requests += 1
        if type(msg) is Request:
            return self._on_request(now, client, msg)
        if isinstance(msg, ClientMalformed):
            self.intake.malformed(now, client, msg)
            rid, code, text = msg.request_id, msg.code, msg.message
            error = replies.error(
                self._stats, client, msg.delimited, rid, code, text, simple=msg.simple
            )
            return [error]
        if isinstance(msg, Cancel):
            return self._on_cancel(client, msg)
        if isinstance(msg, MetadataRequest):
            return [metadata.answer(self.registry, self._stats, client, msg)]
        gate, rid = self.stats_gate, msg.request_id  # STATS: echoes the query's id
        if gate is not None and not gate(identity):
            code, denied = ErrorCode.PERMISSION_DENIED, "STATS is answered to operator keys only"
            return [replies.error(self._stats, client, msg.delimited, rid, code, denied)]
        answer = self.snapshot(now) if rid is None else {**self.snapshot(now), "id": rid}
        return [replies.to_client(client, msg.delimited, encode(Command.STATS, answer))]

    def _on_request(self, now: float, client: ClientId, request: Request[Layout]) -> list[Outgoing]:
        """A REQUEST: a copy of one held is claimed; else the door lets it in (its queue is
        pumped at the end of the turn), holds it (its model is expected back), or refuses it."""
        origin: Origin | None = None
        if request.nonce is not None:  # sent with its client's nonce: a copy sent again?
            claim = self.resends.claim(client, request)
            if isinstance(claim, list):
                return claim
            origin = claim
        out: list[Outgoing] = []
        pumps, config, backlog = self.pumps, self.config, self.backlog
        is_full = full(config, backlog, request.nbytes)
        if is_full and (pumps.dirty or pumps.freed_models or pumps.dirty_models):
            pumps.pump_dirty(now, out, self.dispatcher.pump)  # the turn's batches may make room
            is_full = full(config, backlog, request.nbytes)
        verdict = self.intake.admit(now, client, request, origin, is_full)
        if isinstance(verdict, PendingRequest):
            pumps.dirty[verdict.key] = None  # its batch forms at the end of the turn
            return out
        if verdict.hold and self.holding.hold(now, client, request, origin):
            return out
        out.append(replies.refusal(self._stats, client, request, verdict))
        return out

    def _release(self, now: float, models: list[str], out: list[Outgoing]) -> None:
        """The requests held at the door for ``models`` (a READY registered them) go to
        the door, in arrival order, each with what remains of its budget."""
        holding = self.holding
        if not holding.count:
            return
        holding.on_tick(now, out)  # (those due are answered, not admitted late)
        for model in models:
            for held in holding.release(model):  # (more than HOLD_LEAD_S is left)
                held.request.timeout_ms = max(1, math.floor(1000 * (held.deadline_s - now)))
                out.extend(self._on_request(now, held.client, held.request))

    def _on_cancel(self, client: ClientId, cancel: Cancel) -> list[Outgoing]:
        """A CANCEL: a request held at the door is answered by the holding area; a queued
        one leaves its queue, answered CANCELLED."""
        out: list[Outgoing] = []
        req = self.resends.cancel(client, cancel, out)
        if req is not None:
            msg = "cancelled by its client before it reached a worker"
            queue = self.backlog.queues[req.key]
            self.dispatcher.answer_queued(queue, req, ErrorCode.CANCELLED, msg, out)
        return out

    def on_worker(self, now: float, identity: bytes, msg: FromWorker) -> list[Outgoing]:
        """A worker's message, as its transport decoded it (``decode_from_worker``)."""
        if type(msg) is WorkerReady:
            return self._on_ready(now, WorkerId(identity), msg.ready)
        workers = self.workers
        out = workers.on_worker(now, identity, msg)
        freed = workers.freed_models
        if freed:  # (a RESULT or FAILED took a batch)
            self.pumps.mark_freed(freed)
            freed.clear()
        if workers.changed_models:
            self._mark_changed()
        return out

    def _mark_changed(self) -> None:
        """The worker events' follow-ups, marked for the pumps at the end of the turn."""
        workers, pumps = self.workers, self.pumps
        if workers.changed_models:
            pumps.mark_models(workers.changed_models)
            workers.changed_models.clear()
        if workers.freed_models:
            pumps.mark_freed(workers.freed_models)
            workers.freed_models.clear()

    def _on_ready(self, now: float, wid: WorkerId, ready: Ready) -> list[Outgoing]:
        """A READY: registered (or refused) by the worker events. A model no live worker
        served, back with another spec, forgets the layouts checked against the old one
        and answers the queued requests that no longer fit (the rest ride as they are);
        the requests held at the door for its models go in; their queues are pumped."""
        out: list[Outgoing] = []
        replaced = self.workers.on_ready(now, wid, ready, out)
        self._mark_changed()  # (the worker that READY replaced)
        if replaced is None:  # refused
            return out
        for spec in replaced:
            self.layouts.forget_model(spec.name)
            answered = misfits(spec, self.backlog.queues)
            for queue, req, code, message in answered:
                self.dispatcher.answer_queued(queue, req, code, message, out)
            warning = "model %s re-registered by %s with other inputs or outputs: %d answered"
            logger.warning(warning, spec.name, ready.name, len(answered))
        names = [m.name for m in ready.models]
        self._release(now, names, out)
        self.pumps.mark_models(names)
        return out

    # ------------------------------------------------------------------ stopping

    def begin_stop(
        self, now: float, until_s: float | None = None, closes_s: float | None = None
    ) -> list[Outgoing]:
        """The broker is stopping: refuse new requests, answer every held request
        UNAVAILABLE, and answer UNAVAILABLE now each queued request that cannot be
        answered by ``until_s`` (the end of ``stop_grace_s``): no live worker serves its
        model, or its predicted completion, behind what is queued ahead of it, lies past
        ``until_s``. The others stay queued and are dispatched as usual; batches already
        at workers may still finish. ``finish_stop`` answers what is left. ``until_s``
        None: answer every queued one. ``closes_s``: when the server will have closed
        its frontend at the latest; every answer with ``retry`` from now on carries the
        time left until then (``retry_after_ms``)."""
        backlog = self.backlog
        backlog.stopping = True
        if closes_s is not None:
            backlog.closes_s = closes_s
        out: list[Outgoing] = []
        # (each UNAVAILABLE of a request that did not run: retry)
        self.holding.stop(out, backlog.retry_after_ms(now))
        msg = "the broker is stopping before the request was dispatched; retry"
        code, answer = ErrorCode.UNAVAILABLE, self.dispatcher.answer_queued
        for queue, req in unfinishable(now, until_s, backlog.queues, self.registry, self.fleet):
            answer(queue, req, code, msg, out, now)
        if until_s is None:
            self.pumps.stop()
            self.dispatcher.stop()
        return out

    def finish_stop(self, now: float, closes_s: float | None = None) -> list[Outgoing]:
        """The last word: answer what is still at workers UNAVAILABLE and tell every
        worker over a socket to go (DISCONNECT), so none waits out its heartbeats.
        ``closes_s``: as :meth:`begin_stop`'s, now that the grace has ended."""
        out = self.begin_stop(now, None, closes_s)
        msg = "the broker stopped before the request's batch finished; retry"
        for worker in list(self.registry.all()):
            for batch in self.registry.take_all(worker):
                self.workers.fail_batch(batch, ErrorCode.UNAVAILABLE, msg, out)
            out.append(disconnect(worker.wid, "broker stopping"))
        return out

    # ------------------------------------------------------------------ faults

    def changes(self) -> int:
        """Writes so far to the state a request's one answer depends on (the door's, a
        claim's or CANCEL's, the book's, the held requests', the registry's, the
        in-flight table's). Unchanged after a fault, it shows that the message changed no
        state (the server reads it before each message)."""
        return (
            self.intake.writes
            + self.resends.changes
            + self.book.changes
            + self.holding.changes
            + self.registry.changes
            + self.registry.batch_changes
        )

    def on_fault(
        self, now: float, side: Side, identity: bytes, frames: Sequence[Frame] | None
    ) -> list[Outgoing]:
        """The answer to a message (``frames``, a client's) whose handling raised before
        it changed any state (:meth:`changes`; a bug of ours, which the server logs): a
        client's is answered INTERNAL (a CANCEL not at all); a worker is told DISCONNECT
        and, if registered, lost (its batches go back to the queues), so that it
        registers afresh."""
        if side is Side.FRONTEND:
            answer = replies.internal_error(self._stats, ClientId(identity), frames or ())
            return [] if answer is None else [answer]
        out: list[Outgoing] = []
        reason = "the broker failed to handle its message (a bug, logged)"
        worker = self.registry.get(WorkerId(identity))
        if worker is not None:
            self.workers.lose_worker(now, worker, reason, out)
            self._mark_changed()
        out.append(disconnect(WorkerId(identity), reason))
        return out

    def on_unreachable(self, now: float, side: Side, identity: bytes) -> list[Outgoing]:
        """The shell could not send to a peer (gone, or its queue is full)."""
        out: list[Outgoing] = []
        if side is Side.FRONTEND:
            self._stats.undeliverable += 1
            return out
        worker = self.registry.get(WorkerId(identity))
        if worker is not None:
            self.workers.lose_worker(now, worker, "unreachable", out)
            self._mark_changed()
        return out

    # ------------------------------------------------------------------ time

    def on_tick(self, now: float) -> list[Outgoing]:
        """End a loop turn (the server calls it after each turn's messages): expire
        deadlines and workers, send due heartbeats, give up on batches past the watchdog,
        and form the batches that the turn's messages and the due wake-ups allow."""
        out: list[Outgoing] = []
        dispatcher = self.dispatcher
        touched = dispatcher.expire(now, out)
        event_s = self.registry.next_event_s()
        if event_s is not None and event_s <= now:
            self.workers.on_heartbeats_due(now, out)
            self._mark_changed()
        due_s = self.registry.next_due_s()
        if due_s is not None and due_s <= now:
            self.workers.on_watchdog(now, out)
            self._mark_changed()
        # What waited behind an expired request (now the fleet is known), and the queues
        # whose wake-up has come, pumped with the turn's other work, most urgent first.
        wake_s = dispatcher.wake_s
        due = [k for k, t in wake_s.items() if t <= now] if wake_s else []
        if touched:
            due.extend(touched)
        self.pumps.pump_dirty(now, out, dispatcher.pump, due)
        if self.holding.count:
            self.holding.on_tick(now, out)
        if now >= self._sweep_s:
            self._sweep_s = now + _SWEEP_S
            dispatcher.sweep(now)
            self.forget_unserved(now)
        return out

    def forget_unserved(self, now: float) -> list[str]:
        """Forget the models no live worker has served for ``forget_unserved_s`` (their
        spec, policy, queues, counters and request layouts), so that their names answer
        NOT_FOUND again and names announced by workers that left cannot pile up. Kept:
        models named in the configuration (``[models.<name>]``), and a model with requests
        still queued (they are answered at their deadlines; it goes after them). Returns
        the models forgotten. ``on_tick`` calls it every sweep."""
        config, backlog, registry = self.config, self.backlog, self.registry
        stats = self.stats  # (reading them takes the parts' notes: none is of a model gone)
        forgotten = []
        for name in registry.unserved_for(now, config.forget_unserved_s):
            if name in config.models or any(backlog.queued_samples.get(name, ())):
                continue
            registry.forget(name)
            self.fleet.forget(name)
            for key in backlog.forget_model(name):
                self.dispatcher.forget(key)
            stats.forget(name)
            self.layouts.forget_model(name)
            forgotten.append(name)
        if forgotten:
            names = ",".join(forgotten[:8]) + (",..." if len(forgotten) > 8 else "")
            line = "forgot %d models no worker served for %.0f s: %s"
            logger.info(line, len(forgotten), config.forget_unserved_s, names)
        return forgotten

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time ``on_tick`` has work: a batch wait, a deadline, a heartbeat,
        the engine watchdog, a held request's expiry."""
        dispatcher = self.dispatcher
        times = [
            t
            for t in (
                self.backlog.deadlines.earliest(),
                self.registry.next_event_s(),
                self.registry.next_due_s(),
                self.holding.next_expiry_s(),
            )
            if t is not None
        ]
        if dispatcher.wake_s:
            times.append(min(dispatcher.wake_s.values()))
        pumps = self.pumps
        if pumps.dirty or pumps.dirty_models or pumps.freed_models:
            return now
        if not times:
            return None
        return max(now, min(times))

    # ------------------------------------------------------------------ queries

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """Counters and state for STATS replies (msgpack-friendly: str keys only); the
        latency percentiles are over the window before ``now`` (None: all kept)."""
        backlog, stats, registry = self.backlog, self.stats, self.registry
        names = {*registry.specs, *self.config.models}
        batching = self.fleet.batching_for
        models = model_table(stats, registry, names, backlog.queued_samples, batching, now)
        counts = (backlog.queued, backlog.queued_bytes, registry.batches_held)
        return snapshot(stats, registry, *counts, self.worker_transport, models)
