"""intake.py: ClientIntake — a client's request, checked against its model and queued, held
or answered at once.

Pure: ``now`` comes in. A request arrives decoded (the core decodes each client message
with the layouts this door remembers, :attr:`ClientIntake.layouts`): one sent again with its
client's nonce goes to :class:`carpool.broker.resends.Resends` first. A request of a
layout checked before comes with it (``Request.layout``); any other is checked against
its model's spec (names, dtypes, shapes, sizes, shared-memory references) and its layout
remembered. Then :func:`carpool.broker.admission.admit`, asked once, lets it in or
refuses it, and a request let in joins its queue, pumped at the end of the turn.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from carpool.broker import limits
from carpool.broker.admission import Layout, Refused, admit, full, layout_of, pending
from carpool.broker.backlog import Backlog
from carpool.broker.config import BrokerConfig
from carpool.broker.fleet import FleetModel
from carpool.broker.holding import HeldRequests
from carpool.broker.pumps import Pumps
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Outgoing, error
from carpool.broker.requests import ClientId, Origin
from carpool.broker.resends import Resends
from carpool.broker.stats import BrokerStats
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.peer_names import peer_tag
from carpool.common.protocol import ClientMalformed, KnownLayouts, Request
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog

logger = logging.getLogger(__name__)

#: Layouts remembered (clients choose shapes; the cache is dropped when full).
_MAX_LAYOUTS = 1024

#: An arrival trace record: (time, model, shape, timeout_ms, priority, the largest batch
#: a live worker of the model takes).
Arrival = tuple[float, str, tuple[int, ...], int, int, int]


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class ClientIntake:
    """Client requests: see the module docstring."""

    config: BrokerConfig
    registry: WorkerRegistry
    stats: BrokerStats
    backlog: Backlog
    fleet: FleetModel
    pumps: Pumps
    holding: HeldRequests
    resends: Resends
    _seq: int = dataclasses.field(init=False, default=0)
    # Request layouts checked once per (model, input names, dtypes, shapes); valid while
    # the model's spec stands (a replaced or forgotten model's are dropped). The core
    # decodes each client message with them.
    layouts: KnownLayouts[Layout] = dataclasses.field(
        init=False, default_factory=lambda: KnownLayouts(_MAX_LAYOUTS)
    )
    # Arrival trace while recording; the shell writes it out (carpool record).
    recording: list[Arrival] | None = dataclasses.field(init=False, default=None)
    # When the broker began serving (the server sets it): for register_grace_s after
    # it, a model no worker has registered yet is held (an expected name) or
    # UNAVAILABLE, not NOT_FOUND.
    started_s: float = dataclasses.field(init=False, default=-math.inf)
    # Requests that went past their checks into changing state (queueing, a copy's
    # claim, holding): counted before the first write, for the core's ``changes``: a
    # fault before it is in a message that changed nothing.
    writes: int = dataclasses.field(init=False, default=0)
    _log_version: RateLimitedLog = dataclasses.field(
        init=False,
        default_factory=lambda: RateLimitedLog(logger, PEER_LINES_PER_MIN, level=logging.INFO),
    )

    def on_request(self, now: float, client: ClientId, request: Request[Layout]) -> list[Outgoing]:
        """A valid REQUEST from ``client``: queue it, hold it, or answer it."""
        origin: Origin | None = None
        if request.nonce is not None:  # sent with its client's nonce
            self.writes += 1  # (from here on the message changes state)
            claim = self.resends.claim(client, request)
            if isinstance(claim, list):  # a copy of a request held
                return claim
            origin = claim
        layout = request.layout
        max_batch = 0
        # (an input in shared memory that needs padding: the model's checks refuse it)
        if layout is not None and (request.shm is None or layout.shapes is None):
            max_batch = self.registry.limit(layout.key)
        if layout is None or not max_batch:
            checked = self._check(now, client, request, origin)
            if isinstance(checked, list):  # refused, or held at the door
                return checked
            layout, max_batch = checked
        return self._enqueue(now, client, request, layout, max_batch, origin)

    def malformed(self, now: float, client: ClientId, msg: ClientMalformed) -> Outgoing:
        """The ERROR that answers a message that breaks the protocol."""
        if msg.version is not None:
            self._log_version(
                "client peer=%s sent protocol version %d", peer_tag(client), msg.version, now=now
            )
        return error(
            self.stats,
            client,
            msg.delimited,
            msg.request_id,
            msg.code,
            msg.message,
            simple=msg.simple,
        )

    def release(self, now: float, models: list[str], out: list[Outgoing]) -> None:
        """A READY registered ``models``: the requests held for them at the door go
        through admission, in arrival order, each with what remains of its budget."""
        holding = self.holding
        if not holding.count:
            return
        holding.on_tick(now, out)  # (those due are answered, not admitted late)
        for model in models:
            for held in holding.release(model):
                # More than HOLD_LEAD_S is left: on_tick answered the rest.
                request = held.request
                request.timeout_ms = max(1, math.floor(1000 * (held.deadline_s - now)))
                out.extend(self.on_request(now, held.client, request))

    def _check(
        self, now: float, client: ClientId, request: Request[Layout], origin: Origin | None
    ) -> tuple[Layout, int] | list[Outgoing]:
        """Check a request against its model: its layout and the largest batch a live
        worker that admits its shapes takes, or what to answer (nothing: it is held)."""
        model = request.model
        spec = self.registry.specs.get(model)
        if spec is None:
            if now < self.started_s + self.config.register_grace_s:
                # Just (re)started: its workers may not have said READY yet, and a client
                # must not take a restart for a model that does not exist. A model the
                # broker expects waits for them (holding.py), if its budget allows.
                self.writes += 1  # (from here on the message may change state)
                if self.holding.hold(now, client, request, origin):
                    return []
                msg = (
                    f"no worker has registered model {model!r} yet; the broker "
                    f"started {now - self.started_s:.1f} s ago"
                )
                return [self._unavailable(now, client, request, msg)]
            return self._refuse(
                client, request, ErrorCode.NOT_FOUND, f"model {model!r} is not served by any worker"
            )
        if not self.registry.serving(model):  # before the payload checks (§6.1)
            msg = f"no live worker serves model {model!r} right now"
            return [self._unavailable(now, client, request, msg)]
        try:
            layout = layout_of(spec, request)
        except ProtocolError as exc:
            return self._refuse(client, request, ErrorCode.INVALID_ARGUMENT, str(exc))
        max_batch = self.registry.limit(layout.key)
        if max_batch == 0:  # no live worker's limits admit its shapes
            named = ((w.name, w.models[model]) for w in self.registry.serving(model))
            msg = limits.refusal(model, layout.key, named)
            return self._refuse(client, request, ErrorCode.INVALID_ARGUMENT, msg)
        if not request.simple:
            self.layouts.remember(request, layout)
        return layout, max_batch

    def _refuse(
        self, client: ClientId, request: Request[Layout], code: ErrorCode, message: str
    ) -> list[Outgoing]:
        rid, delimited, simple = request.request_id, request.delimited, request.simple
        return [error(self.stats, client, delimited, rid, code, message, simple=simple)]

    def _unavailable(
        self, now: float, client: ClientId, request: Request[Layout], message: str
    ) -> Outgoing:
        """UNAVAILABLE at the door; once the broker is stopping, with ``retry`` and the
        time left before it closes (§6.3)."""
        backlog = self.backlog
        return error(
            self.stats,
            client,
            request.delimited,
            request.request_id,
            ErrorCode.UNAVAILABLE,
            message,
            simple=request.simple,
            retry_after_ms=backlog.retry_after_ms(now),
            retry=backlog.stopping,
        )

    def _enqueue(
        self,
        now: float,
        client: ClientId,
        request: Request[Layout],
        layout: Layout,
        max_batch: int,
        origin: Origin | None,
    ) -> list[Outgoing]:
        """Queue a request of ``layout`` (checked: ``max_batch`` > 0) if :func:`admit`
        lets it in, else answer its refusal; the batch forms at the end of the turn.
        ``origin``: the request's, when it carries its client's nonce."""
        self.writes += 1  # (from here on the message changes state: admission may pump)
        timeout_ms = request.timeout_ms
        timeout_s = timeout_ms / 1000.0 if timeout_ms is not None else self.config.default_timeout_s
        out: list[Outgoing] = []
        nbytes = 0
        for frame in request.payloads:
            nbytes += len(frame)
        backlog, pumps, config = self.backlog, self.pumps, self.config
        if full(config, backlog, nbytes):
            # The batches this turn forms anyway may make room: they form now, before
            # the door answers.
            pumps.pump_dirty(now, out)
        priority = request.priority
        verdict = admit(
            layout,
            nbytes,
            timeout_s,
            priority,
            max_batch,
            config,
            backlog,
            self.fleet,
            client=client,
            now=now,
        )
        if self.recording is not None and (type(verdict) is not Refused or verdict.arrival):
            self.recording.append(
                (now, layout.model, layout.shape, round(1000 * timeout_s), int(priority), max_batch)
            )
        if type(verdict) is Refused:
            self.stats.refused(layout.model, verdict.code.name, verdict.shed)
            answer = error(
                self.stats,
                client,
                request.delimited,
                request.request_id,
                verdict.code,
                verdict.message,
                simple=request.simple,
                retry_after_ms=verdict.retry_after_ms,
                retry=verdict.retry,
            )
            out.append(answer)
            return out
        self._seq += 1
        req = pending(self._seq, client, request, layout, now, timeout_s, nbytes, origin)
        backlog.add(req)
        pumps.dirty[req.key] = None  # the batch forms at the end of the turn
        return out
