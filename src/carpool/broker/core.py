"""core.py: BrokerCore — the whole broker as a pure state machine, a façade over its parts.

Inputs are events with ``now`` (monotonic seconds): a client message, a worker message, a
tick, a peer that could not be sent to. Each returns the list of :data:`Outgoing` messages
to send (:class:`ToClient` frames, or :class:`ToWorker` typed messages). No sockets,
threads or clocks here; ``server.py`` owns those.

The parts, one concern each (composed here, none inherits from another):

- :class:`~carpool.broker.requests.RequestBook`: request state, through its transition table;
- :class:`~carpool.broker.backlog.Backlog`: the queues, the deadline heap, queued counts;
- :class:`~carpool.broker.inflight.InflightTable`: the batches at workers;
- :class:`~carpool.broker.fleet.FleetModel`: per-model policies, workers' lanes, capacities;
- :class:`~carpool.broker.dispatcher.Dispatcher`: a queue's pump, shedding and dispatch;
- :class:`~carpool.broker.pumps.Pumps`: which queues are pumped when, and in which order
  (a free slot goes to the most urgent queue of its model first);
- :class:`~carpool.broker.intake.ClientIntake`: client messages, validated, then let in or
  refused by the pure :func:`~carpool.broker.admission.admit`;
- :class:`~carpool.broker.holding.HeldRequests`: just after a start, requests for an
  expected model no worker has registered yet, held at the door until one does;
- :class:`~carpool.broker.resends.Resends`: a request sent again with its client's nonce
  (answered once, on the copy's connection), and CANCEL;
- :class:`~carpool.broker.workers.WorkerEvents`: worker messages and losses;
- :class:`~carpool.broker.replies.Replies` and :mod:`carpool.broker.stats`: error replies,
  counters and the STATS snapshot.

Messages only queue work; the tick that ends each loop turn (the server's and the
simulator's alike) forms batches for everything that arrived in it. A framed request whose
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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from carpool.broker.backlog import Backlog
from carpool.broker.config import BrokerConfig
from carpool.broker.dispatcher import Dispatcher
from carpool.broker.fleet import FleetModel
from carpool.broker.holding import HeldRequests
from carpool.broker.inflight import InflightBatch, InflightTable
from carpool.broker.intake import Arrival, ClientIntake
from carpool.broker.pumps import Pumps
from carpool.broker.registry import WorkerId, WorkerRegistry
from carpool.broker.replies import Outgoing, Replies, Side, ToClient, ToWorker, disconnect
from carpool.broker.requests import ClientId, RequestBook
from carpool.broker.resends import Resends
from carpool.broker.stats import BrokerStats, model_table, snapshot
from carpool.broker.workers import WorkerEvents
from carpool.common.errors import ErrorCode
from carpool.common.protocol import Frame

logger = logging.getLogger(__name__)

__all__ = [
    "BrokerCore",
    "BrokerStats",
    "InflightBatch",
    "Outgoing",
    "Side",
    "ToClient",
    "ToWorker",
]

#: How often on_tick looks for idle queues to forget (a queue idle for a second goes).
_SWEEP_S = 0.5


class BrokerCore:
    """The broker's state machine; see the module docstring. ``on_client`` and
    ``on_worker`` are the intake's and the worker events' own methods (bound here, so a
    message costs no extra call)."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config = config or BrokerConfig()
        self.registry = registry = WorkerRegistry(liveness=config.liveness)
        self.stats = stats = BrokerStats()
        self.book = book = RequestBook()
        self.backlog = backlog = Backlog(book)
        self.inflight = inflight = InflightTable(
            watchdog_factor=config.watchdog_factor, watchdog_slack_s=config.watchdog_slack_s
        )
        self.fleet = fleet = FleetModel(config, registry, inflight)
        backlog.batch_unit = fleet.batch_unit
        self.replies = replies = Replies(stats, backlog, fleet)
        self.dispatcher = dispatcher = Dispatcher(
            book, backlog, inflight, fleet, replies, stats, registry
        )
        self.pumps = pumps = Pumps(backlog, registry, fleet)
        self.holding = holding = HeldRequests(config, backlog, replies)
        self.resends = resends = Resends(book, holding, backlog, dispatcher, replies, stats)
        self.intake = intake = ClientIntake(
            config,
            registry,
            stats,
            backlog,
            fleet,
            dispatcher,
            pumps,
            replies,
            self.snapshot,
            holding,
            resends,
        )
        self.workers = workers = WorkerEvents(
            config, registry, stats, book, backlog, inflight, fleet, pumps, replies, intake
        )
        #: The REQUEST decoder with the layouts its fast path knows (the intake's).
        self.request_decoder = intake.request_decoder
        self.on_client = intake.on_client
        self.on_worker = workers.on_worker
        self._sweep_s = 0.0  # when on_tick next looks for idle queues to forget
        #: How each worker is connected, by its id, as STATS names it ("zeromq", "local",
        #: "embedded"): the server's transports say; the core only passes it on.
        self.worker_transport: Callable[[bytes], str] = _zeromq

    # ------------------------------------------------------------------ the server's knobs

    @property
    def recording(self) -> list[Arrival] | None:
        """The arrival trace while recording (None: not recording); the shell writes it
        out (carpool record)."""
        return self.intake.recording

    @recording.setter
    def recording(self, records: list[Arrival] | None) -> None:
        self.intake.recording = records

    @property
    def stats_gate(self) -> Callable[[bytes], bool] | None:
        """Who may read STATS, by client id (None: everyone); the server sets it."""
        return self.intake.stats_gate

    @stats_gate.setter
    def stats_gate(self, gate: Callable[[bytes], bool] | None) -> None:
        self.intake.stats_gate = gate

    @property
    def authenticated_key(self) -> Callable[[bytes], bytes] | None:
        """The authenticated key a client id starts with, part of a request's origin
        (the server sets it under CURVE); None: no keys, a request's origin is its
        client's nonce alone."""
        return self.resends.key_of

    @authenticated_key.setter
    def authenticated_key(self, key_of: Callable[[bytes], bytes] | None) -> None:
        self.resends.key_of = key_of

    @property
    def started_s(self) -> float:
        """When the broker began serving (the server sets it): for register_grace_s after
        it, a model no worker has registered yet is held (an expected name, see
        :meth:`expect`) or UNAVAILABLE, not NOT_FOUND."""
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
    def queued(self) -> int:
        return self.backlog.queued

    @property
    def queued_bytes(self) -> int:
        return self.backlog.queued_bytes

    @property
    def inflight_batches(self) -> int:
        return len(self.inflight)

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
        answer = self.dispatcher.answer_queued
        registry, fleet = self.registry, self.fleet
        ahead: dict[str, int] = {}  # samples kept so far, by model
        stop_by_s = until_s if until_s is not None else float("-inf")
        for queue in list(self.backlog.queues.values()):
            for req in list(queue):
                model = req.model
                keep = until_s is not None and any(registry.serving(model))
                if keep:
                    samples = ahead.get(model, 0) + req.samples
                    completion = fleet.completion(now, model, queue.key, samples)
                    keep = completion is None or now + completion[0] <= stop_by_s
                if keep:
                    ahead[model] = samples
                else:
                    answer(queue, req, ErrorCode.UNAVAILABLE, msg, out, now)
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
        for batch in self.inflight:
            self.workers.fail_batch(batch, ErrorCode.UNAVAILABLE, msg, out)
        self.inflight.clear()
        for worker in list(self.registry.all()):
            self.inflight.take_all(worker)  # (its credits in use: none now)
            out.append(disconnect(worker.wid, "broker stopping"))
        return out

    # ------------------------------------------------------------------ faults

    def changes(self) -> int:
        """Writes so far to the state a request's one answer depends on: the client
        messages that went past their checks (the intake counts each before its first
        write: a queue, a copy's claim, a hold, a cancel), and the writes of the request
        book, the held requests, the worker registry and the in-flight table. The server
        reads it before each message; unchanged after a fault, it shows that the message
        changed no state."""
        return (
            self.intake.writes
            + self.book.changes
            + self.holding.changes
            + self.registry.changes
            + self.inflight.changes
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
            answer = self.replies.internal_error(ClientId(identity), frames or ())
            return [] if answer is None else [answer]
        out: list[Outgoing] = []
        reason = "the broker failed to handle its message (a bug, logged)"
        worker = self.registry.get(WorkerId(identity))
        if worker is not None:
            self.workers.lose_worker(now, worker, reason, out)
        out.append(disconnect(WorkerId(identity), reason))
        return out

    def on_unreachable(self, now: float, side: Side, identity: bytes) -> list[Outgoing]:
        """The shell could not send to a peer (gone, or its queue is full)."""
        out: list[Outgoing] = []
        if side is Side.FRONTEND:
            self.stats.undeliverable += 1
            return out
        worker = self.registry.get(WorkerId(identity))
        if worker is not None:
            self.workers.lose_worker(now, worker, "unreachable", out)
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
        due_s = self.inflight.next_due_s()
        if due_s is not None and due_s <= now:
            self.workers.on_watchdog(now, out)
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
        forgotten = []
        for name in registry.unserved_for(now, config.forget_unserved_s):
            if name in config.models or any(backlog.queued_samples.get(name, ())):
                continue
            registry.forget(name)
            self.fleet.forget(name)
            for key in backlog.forget_model(name):
                self.dispatcher.forget(key)
            self.stats.forget(name)
            self.request_decoder.forget_model(name)
            forgotten.append(name)
        if forgotten:
            logger.info(
                "forgot %d models no worker served for %.0f s: %s",
                len(forgotten),
                config.forget_unserved_s,
                ",".join(forgotten[:8]) + (",..." if len(forgotten) > 8 else ""),
            )
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
                self.inflight.next_due_s(),
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
        return snapshot(
            stats,
            registry,
            backlog.queued,
            backlog.queued_bytes,
            len(self.inflight),
            self.worker_transport,
            models,
        )


def _zeromq(wid: bytes) -> str:
    """A core without a server: every worker is taken for a ZeroMQ peer."""
    return "zeromq"
