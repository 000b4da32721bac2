"""intake.py: the door (ClientIntake, Resends): a client's request checked against its model, then
let in (queued) or refused.

Pure: ``now`` comes in. A request arrives decoded (the core decodes each client message
with the layouts this door remembers, :attr:`ClientIntake.layouts`). A request of a
layout checked before comes with it (``Request.layout``); any other is checked against
its model's spec (names, dtypes, shapes, sizes, shared-memory references) and its layout
remembered. Then :func:`carpool.broker.admission.admit`, asked once, lets it in or
refuses it. :meth:`ClientIntake.admit` returns the request book's entry of a request let
in (built there, its payloads in spec order, and queued in the backlog) or the
:class:`~carpool.broker.admission.Refused` that answers it; the core routes what follows
(the queue's pump, a hold at the door, the error reply).

A request sent again, and a client's CANCEL (protocol.md §6.1, §6.5), are
:class:`Resends`'s. A request that carries its client's nonce (REQUEST ``client``, 16
random bytes the client draws once) has an origin: the nonce, after the client's
authenticated key under CURVE (the server sets :attr:`Resends.key_of`; without it the
nonce alone). The request book indexes the requests it holds by (origin, id), and the
holding area its held ones; both entries leave when the request has had its answer, so
the index is bounded by the queue and in-flight limits.

- A REQUEST whose (origin, id) is a request still held (at the door, queued or at a
  worker) is a copy sent again after the client lost its connection: it is not run
  again and gets no answer of its own. The held request's one answer goes to the
  connection the copy came by, and the request's share of the per-client limits moves
  there with it (:meth:`Resends.claim`). A copy that names another model than the
  request it matches is answered INVALID_ARGUMENT, and the request goes on as it was.
- A CANCEL of a request held at the door or queued drops it and answers it CANCELLED on
  the connection its latest copy came by; of one at a worker, or one the broker does not
  hold, it does nothing (:meth:`Resends.cancel`). A CANCEL is never answered itself.

Only the holder of a nonce can claim its requests' answers: the broker never sends a
nonce back. Under CURVE the key is part of the origin, so a nonce seen by another key
matches nothing (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from carpool.broker import limits
from carpool.broker.admission import Layout, admit, layout_of
from carpool.broker.backlog import Backlog
from carpool.broker.config import BrokerConfig
from carpool.broker.fleet import FleetModel
from carpool.broker.holding import HeldRequests
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Outgoing, Refused, error
from carpool.broker.requests import ClientId, Origin, PendingRequest, RequestBook, RequestState
from carpool.broker.stats import BrokerStats
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.peer_names import peer_tag
from carpool.common.protocol import Cancel, ClientMalformed, KnownLayouts, Request
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog

logger = logging.getLogger(__name__)

#: Layouts remembered (clients choose shapes; the cache is dropped when full).
_MAX_LAYOUTS = 1024

#: An arrival trace record: (time, model, shape, timeout_ms, priority, the largest batch
#: a live worker of the model takes).
Arrival = tuple[float, str, tuple[int, ...], int, int, int]


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class ClientIntake:
    """The door: see the module docstring."""

    config: BrokerConfig
    registry: WorkerRegistry
    backlog: Backlog
    fleet: FleetModel
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
    # Requests let in: counted before the first write (the queue), for the core's
    # ``changes``: a fault before it is in a message that changed nothing. Each request
    # let in has its count as its ``seq`` (the broker-wide arrival order).
    writes: int = dataclasses.field(init=False, default=0)
    _log_version: RateLimitedLog = dataclasses.field(
        init=False,
        default_factory=lambda: RateLimitedLog(logger, PEER_LINES_PER_MIN, level=logging.INFO),
    )

    def admit(
        self,
        now: float,
        client: ClientId,
        request: Request[Layout],
        origin: Origin | None,
        is_full: bool | None = None,
    ) -> PendingRequest | Refused:
        """A valid REQUEST from ``client`` (``origin``: its own, when it carries its
        client's nonce): its entry, queued, or why it is refused (or held). ``is_full``:
        whether the queue has no room for it (:func:`~carpool.broker.admission.full`;
        None: asked here)."""
        layout = request.layout
        max_batch = 0
        # (an input in shared memory that needs padding: the model's checks refuse it)
        if layout is not None and (request.shm is None or layout.shapes is None):
            # (limit's figure) speed: docs/benchmarks.md "Why the hot path looks as it does"
            max_batch = self.registry.eligible(layout.key)[1]
        if layout is None or not max_batch:
            checked = self._check(now, request)
            if isinstance(checked, Refused):
                return checked
            layout, max_batch = checked
        timeout_ms = request.timeout_ms
        timeout_s = timeout_ms / 1000.0 if timeout_ms is not None else self.config.default_timeout_s
        priority, nbytes = request.priority, request.nbytes
        verdict = admit(
            layout,
            nbytes,
            timeout_s,
            priority,
            max_batch,
            self.config,
            self.backlog,
            self.fleet,
            client,
            now,
            is_full,
        )
        if self.recording is not None and (type(verdict) is not Refused or verdict.arrival):
            self.recording.append(
                (now, layout.model, layout.shape, round(1000 * timeout_s), int(priority), max_batch)
            )
        if type(verdict) is Refused:
            return verdict
        # (From here on the message changes state.) Its count is the request's ``seq``.
        self.writes = seq = self.writes + 1
        # The request book's entry: payloads and shared-memory references in spec order.
        payloads, refs, order = request.payloads, request.shm, layout.order
        if order is not None:
            payloads = [payloads[i] for i in order]
            if refs is not None:
                refs = tuple(refs[i] for i in order)
        # (positional, in order) speed: docs/benchmarks.md "Why the hot path looks as it does"
        req = PendingRequest(
            seq,
            client,
            request.delimited,
            request.request_id,
            request.simple,
            layout.model,
            layout.key,
            layout.samples,
            priority,
            now,
            now + timeout_s,
            payloads,
            refs,
            request.shm_outputs,
            nbytes,
            layout.shapes,
            origin,
        )
        self.backlog.add(req)
        return req

    def malformed(self, now: float, client: ClientId, msg: ClientMalformed) -> None:
        """A message that breaks the protocol (the core answers it): a protocol version
        we do not speak is logged."""
        if msg.version is not None:
            self._log_version(
                "client peer=%s sent protocol version %d", peer_tag(client), msg.version, now=now
            )

    def _check(self, now: float, request: Request[Layout]) -> tuple[Layout, int] | Refused:
        """Check a request against its model: its layout and the largest batch a live
        worker that admits its shapes takes, or why it is refused."""
        model = request.model
        spec = self.registry.specs.get(model)
        if spec is None:
            if now < self.started_s + self.config.register_grace_s:
                # Just (re)started: its workers may not have said READY yet, and a client
                # must not take a restart for a model that does not exist. A model the
                # broker expects waits for them (holding.py), if its budget allows.
                msg = (
                    f"no worker has registered model {model!r} yet; the broker "
                    f"started {now - self.started_s:.1f} s ago"
                )
                return self._unavailable(now, msg, hold=True)
            msg = f"model {model!r} is not served by any worker"
            return Refused(ErrorCode.NOT_FOUND, msg, counted=False)
        if not self.registry.serving(model):  # before the payload checks (§6.1)
            return self._unavailable(now, f"no live worker serves model {model!r} right now")
        try:
            layout = layout_of(spec, request)
        except ProtocolError as exc:
            return Refused(ErrorCode.INVALID_ARGUMENT, str(exc), counted=False)
        max_batch = self.registry.limit(layout.key)
        if max_batch == 0:  # no live worker's limits admit its shapes
            named = ((w.name, w.models[model]) for w in self.registry.serving(model))
            msg = limits.refusal(model, layout.key, named)
            return Refused(ErrorCode.INVALID_ARGUMENT, msg, counted=False)
        if not request.simple:
            self.layouts.remember(request, layout)
        return layout, max_batch

    def _unavailable(self, now: float, message: str, *, hold: bool = False) -> Refused:
        """UNAVAILABLE at the door; once the broker is stopping, with ``retry`` and the
        time left before it closes (§6.3)."""
        backlog = self.backlog
        hint, retry = backlog.retry_after_ms(now), backlog.stopping
        return Refused(ErrorCode.UNAVAILABLE, message, hint, retry=retry, counted=False, hold=hold)


_QUEUED = RequestState.QUEUED


class Resends:
    """Copies of requests and CANCELs; see the module docstring."""

    def __init__(self, book: RequestBook, holding: HeldRequests, stats: BrokerStats) -> None:
        self._by_origin = book.by_origin
        self._book = book
        self._holding = holding
        self._stats = stats
        #: Claims and CANCELs that went past their checks (the core's ``changes``).
        self.changes = 0
        #: The authenticated key a client id starts with (the server sets it under
        #: CURVE); None: no keys, a request's origin is its nonce alone.
        self.key_of: Callable[[bytes], bytes] | None = None

    def origin(self, client: ClientId, nonce: bytes, request_id: int) -> Origin:
        """The (origin, id) a request of ``client`` with ``nonce`` is known by."""
        key_of = self.key_of
        return (nonce if key_of is None else key_of(client) + nonce, request_id)

    def claim(self, client: ClientId, request: Request[Any]) -> Origin | list[Outgoing]:
        """``request``, sent with its client's nonce, came from ``client``: its (origin,
        id) when it is no copy of a request held (the caller admits it with that origin),
        else what to send: nothing (the held request answers on ``client``'s connection)
        or, for a copy that names another model, its INVALID_ARGUMENT. (One call: it runs
        for every request sent with a nonce.)"""
        self.changes += 1  # (from here on the message may change state)
        key_of, nonce, delimited = self.key_of, request.nonce, request.delimited
        assert nonce is not None
        origin = (nonce if key_of is None else key_of(client) + nonce, request.request_id)
        req = self._by_origin.get(origin)
        holding = self._holding
        entry = None
        if req is None:
            if not holding.count:
                return origin
            entry = holding.by_origin.get(origin)
            if entry is None:
                return origin
            held_model = entry.request.model
        else:
            held_model = req.model
        if held_model != request.model:
            msg = (
                f"request {origin[1]} of this client is at the broker for model "
                f"{held_model!r}; a request sent again must name the same model"
            )
            code = ErrorCode.INVALID_ARGUMENT
            return [error(self._stats, client, delimited, origin[1], code, msg)]
        if req is not None:
            self._book.redirect(req, client, delimited)
        else:
            assert entry is not None
            holding.redirect(entry, client, delimited)
        self._stats.resent += 1
        return []

    def cancel(
        self, client: ClientId, cancel: Cancel, out: list[Outgoing]
    ) -> PendingRequest | None:
        """A valid CANCEL from ``client``: a request it names that is held at the door is
        dropped and answered CANCELLED (into ``out``); one that is queued is returned,
        for the caller to take out of its queue and answer CANCELLED; nothing else
        changes."""
        self.changes += 1
        origin = self.origin(client, cancel.client, cancel.request_id)
        req = self._by_origin.get(origin)
        if req is not None:
            if req.state is _QUEUED:
                self._stats.cancelled += 1
                return req
        elif self._holding.cancel(origin, out):
            self._stats.cancelled += 1
        return None
