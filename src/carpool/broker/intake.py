"""intake.py: ClientIntake — messages from clients, checked and queued or answered at once.

Pure: ``now`` comes in. A client message is decoded (the framed form, the simple form,
STATS, METADATA, CANCEL), validated against its model's spec (names, dtypes, shapes, sizes,
shared-memory references), let in or refused by :func:`carpool.broker.admission.admit`,
and queued for the :class:`carpool.broker.dispatcher.Dispatcher`. A request sent again
with its client's nonce, and a CANCEL, go to :class:`carpool.broker.resends.Resends`. A
request layout that passed once is remembered by the protocol's RequestDecoder, and the
next request with it takes its fast path, with the same checks and answers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from carpool.broker import limits, metadata
from carpool.broker.admission import (
    FULL_UNTIL_PUMPED,
    Layout,
    Refused,
    admit,
    layout_of,
    queued_misfit,
)
from carpool.broker.backlog import Backlog
from carpool.broker.config import BrokerConfig
from carpool.broker.dispatcher import Dispatcher
from carpool.broker.fleet import FleetModel
from carpool.broker.holding import HeldRequests
from carpool.broker.pumps import Pumps
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Outgoing, Replies
from carpool.broker.requests import ClientId, Origin, PendingRequest, Received
from carpool.broker.resends import Resends
from carpool.broker.stats import BrokerStats
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.peer_names import peer_tag
from carpool.common.protocol import (
    Cancel,
    Command,
    Frame,
    KnownRequest,
    ModelSpec,
    Priority,
    RequestDecoder,
    ShmRef,
    VersionMismatch,
    decode_meta,
    decode_simple_request,
    decode_submit,
    encode,
    is_simple_form,
    parse_header,
    request_id_of,
    view,
)
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog

logger = logging.getLogger(__name__)

#: Layouts remembered (clients choose shapes; the cache is dropped when full).
_MAX_LAYOUTS = 1024

#: An arrival trace record: (time, model, shape, timeout_ms, priority, the largest batch
#: a live worker of the model takes).
Arrival = tuple[float, str, tuple[int, ...], int, int, int]


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class ClientIntake:
    """Client messages: see the module docstring."""

    config: BrokerConfig
    registry: WorkerRegistry
    stats: BrokerStats
    backlog: Backlog
    fleet: FleetModel
    dispatcher: Dispatcher
    pumps: Pumps
    replies: Replies
    snapshot: Callable[[float], dict[str, Any]]
    holding: HeldRequests
    resends: Resends
    _seq: int = dataclasses.field(init=False, default=0)
    # Request layouts validated once per (model, input names, dtypes, shapes); valid
    # while the model's spec stands (``respec`` drops a replaced model's).
    request_decoder: RequestDecoder[Layout] = dataclasses.field(
        init=False, default_factory=lambda: RequestDecoder(_MAX_LAYOUTS)
    )
    # Arrival trace while recording; the shell writes it out (carpool record).
    recording: list[Arrival] | None = dataclasses.field(init=False, default=None)
    # When the broker began serving (the server sets it): for register_grace_s after
    # it, a model no worker has registered yet is held (an expected name) or
    # UNAVAILABLE, not NOT_FOUND.
    started_s: float = dataclasses.field(init=False, default=-math.inf)
    # Who may read STATS, by client id (the server sets it under CURVE: operators'
    # keys only); None: everyone.
    stats_gate: Callable[[bytes], bool] | None = dataclasses.field(init=False, default=None)
    # Messages that went past their checks into changing state (queueing, a copy's
    # claim, holding, a cancel): counted before the first write, for the core's
    # ``changes``: a fault before it is in a message that changed nothing.
    writes: int = dataclasses.field(init=False, default=0)
    _log_version: RateLimitedLog = dataclasses.field(
        init=False,
        default_factory=lambda: RateLimitedLog(logger, PEER_LINES_PER_MIN, level=logging.INFO),
    )

    def release(self, now: float, models: Iterable[str], out: list[Outgoing]) -> None:
        """A READY registered ``models``: the requests held for them at the door go
        through admission, in arrival order, each with what remains of its budget."""
        holding = self.holding
        if not holding.count:
            return
        holding.on_tick(now, out)  # (those due are answered, not admitted late)
        for model in models:
            for held in holding.release(model):
                # More than HOLD_LEAD_S is left: on_tick answered the rest.
                left_ms = math.floor(1000 * (held.deadline_s - now))
                received = held.received
                submit = dataclasses.replace(received.submit, timeout_ms=max(1, left_ms))
                out.extend(self._admit(now, dataclasses.replace(received, submit=submit)))

    def respec(self, spec: ModelSpec, worker: str, out: list[Outgoing]) -> None:
        """A model no live worker served is registered again with a different spec:
        forget the layouts checked against the old one, and answer the queued requests
        that no longer fit (the rest ride as they are)."""
        self.request_decoder.forget_model(spec.name)
        answered = 0
        for key, queue in self.backlog.queues.items():
            if key[0] != spec.name:
                continue
            for req in list(queue):
                misfit = queued_misfit(spec, req)
                if misfit is not None:
                    self.dispatcher.answer_queued(queue, req, misfit[0], misfit[1], out)
                    answered += 1
        logger.warning(
            "model %s re-registered by worker %s with different inputs or outputs; "
            "%d queued requests no longer fit and were answered",
            spec.name,
            worker,
            answered,
        )

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
                sid = request_id_of(decode_meta(view(frames[1]))) if len(frames) > 1 else None
                gate = self.stats_gate
                if gate is not None and not gate(identity):
                    return [
                        self.replies.error(
                            client,
                            delimited,
                            sid,
                            ErrorCode.PERMISSION_DENIED,
                            "STATS is answered to operator keys only",
                        )
                    ]
                snapshot = self.snapshot(now)
                if len(frames) > 1:  # echo the caller's id, so it can match the reply
                    snapshot["id"] = sid
                return [self.replies.to_client(client, delimited, encode(Command.STATS, snapshot))]
            if command is Command.METADATA:
                return [metadata.answer(self.registry, self.replies, client, delimited, frames)]
            if command is not Command.REQUEST:
                if command is Command.CANCEL:
                    if len(frames) != 2:
                        raise ProtocolError("CANCEL is a header and a meta frame")
                    meta = decode_meta(view(frames[1]))
                    cancel = Cancel.from_wire(meta)
                    self.writes += 1  # (from here on the message changes state)
                    return self.resends.cancel(client, cancel)
                raise ProtocolError(f"command {command.name} is not valid from a client")
            if len(frames) < 2:
                raise ProtocolError("REQUEST needs a meta frame")
            meta = decode_meta(view(frames[1]))
            payloads = frames[2:]
            request = self.request_decoder.decode(meta, payloads)
            if isinstance(request, KnownRequest):  # a layout validated before
                layout = request.layout
                origin: Origin | None = None
                if request.client is not None:  # sent with its client's nonce
                    self.writes += 1  # (from here on the message changes state)
                    claim = self.resends.claim(
                        client, delimited, request.client, request.request_id, layout.model
                    )
                    if isinstance(claim, list):  # a copy of a request held
                        return claim
                    origin = claim
                max_batch = self.registry.limit(layout.key)
                # (an input in shared memory that needs padding: the full path refuses it)
                if max_batch and (request.refs is None or layout.shapes is None):
                    return self._enqueue(
                        now,
                        client,
                        delimited,
                        request.request_id,
                        layout,
                        payloads,
                        max_batch,
                        request.timeout_ms,
                        request.priority,
                        False,
                        request.refs,
                        request.shm_outputs,
                        origin,
                    )
                request = decode_submit(meta)  # the full path answers UNAVAILABLE
            submit = request
        except VersionMismatch as exc:
            self._log_version(
                "client peer=%s sent protocol version %d", peer_tag(identity), exc.version, now=now
            )
            return [
                self.replies.error(client, delimited, None, ErrorCode.UNSUPPORTED_VERSION, str(exc))
            ]
        except ProtocolError as exc:
            rid = request_id_of(meta)
            return [
                self.replies.error(client, delimited, rid, ErrorCode.INVALID_ARGUMENT, str(exc))
            ]
        return self._admit(now, Received(client, delimited, submit, frames[2:], False))

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
            return [self.replies.error(client, delimited, rid, code, str(exc), simple=True)]
        return self._admit(now, Received(client, delimited, submit, payloads, True))

    def _admit(self, now: float, received: Received) -> list[Outgoing]:
        """Validate a decoded request against its model; queue it or answer an error."""
        client, delimited, submit, payloads, simple = (
            received.client,
            received.delimited,
            received.submit,
            received.payloads,
            received.simple,
        )
        rid = submit.request_id
        origin: Origin | None = None
        if submit.client is not None:  # sent with its client's nonce
            self.writes += 1  # (from here on the message changes state)
            claim = self.resends.claim(client, delimited, submit.client, rid, submit.model)
            if isinstance(claim, list):  # a copy of a request held
                return claim
            origin = claim
        spec = self.registry.specs.get(submit.model)
        if spec is None:
            if now < self.started_s + self.config.register_grace_s:
                # Just (re)started: its workers may not have said READY yet, and a client
                # must not take a restart for a model that does not exist. A model the
                # broker expects waits for them (holding.py), if its budget allows.
                self.writes += 1  # (from here on the message may change state)
                if self.holding.hold(now, received, origin):
                    return []
                msg = (
                    f"no worker has registered model {submit.model!r} yet; the broker "
                    f"started {now - self.started_s:.1f} s ago"
                )
                return [self._unavailable(now, received, msg)]
            msg = f"model {submit.model!r} is not served by any worker"
            return [
                self.replies.error(client, delimited, rid, ErrorCode.NOT_FOUND, msg, simple=simple)
            ]
        if not self.registry.serving(spec.name):  # before the payload checks (§6.1)
            msg = f"no live worker serves model {spec.name!r} right now"
            return [self._unavailable(now, received, msg)]
        try:
            layout = layout_of(spec, submit, payloads)
        except ProtocolError as exc:
            code = ErrorCode.INVALID_ARGUMENT
            return [self.replies.error(client, delimited, rid, code, str(exc), simple=simple)]
        max_batch = self.registry.limit(layout.key)
        if max_batch == 0:  # no live worker's limits admit its shapes
            named = ((w.name, w.models[spec.name]) for w in self.registry.serving(spec.name))
            msg = limits.refusal(spec.name, layout.key, named)
            code = ErrorCode.INVALID_ARGUMENT
            return [self.replies.error(client, delimited, rid, code, msg, simple=simple)]
        if not simple:
            self.request_decoder.remember(submit, layout)
        return self._enqueue(
            now,
            client,
            delimited,
            rid,
            layout,
            payloads,
            max_batch,
            submit.timeout_ms,
            submit.priority,
            simple,
            submit.shm,
            submit.shm_outputs,
            origin,
        )

    def _unavailable(self, now: float, r: Received, message: str) -> Outgoing:
        """UNAVAILABLE at the door; once the broker is stopping, with ``retry`` and the
        time left before it closes (§6.3)."""
        code, rid, backlog = ErrorCode.UNAVAILABLE, r.submit.request_id, self.backlog
        return self.replies.error(
            r.client,
            r.delimited,
            rid,
            code,
            message,
            simple=r.simple,
            retry_after_ms=backlog.retry_after_ms(now),
            retry=backlog.stopping,
        )

    def _enqueue(
        self,
        now: float,
        client: ClientId,
        delimited: bool,
        rid: int,
        layout: Layout,
        payloads: Sequence[Frame],
        max_batch: int,
        timeout_ms: int | None,
        priority: Priority,
        simple: bool,
        refs: tuple[ShmRef | None, ...] | None = None,
        shm_outputs: bool = False,
        origin: Origin | None = None,
    ) -> list[Outgoing]:
        """Queue a valid request if :func:`admit` lets it in, else answer its refusal; the
        batch forms at the end of the turn. ``refs``: the inputs'
        shared-memory references, in the request's order (§5.4); ``max_batch``: the
        largest batch a live worker that admits its shapes takes (> 0: both callers checked);
        ``origin``: the request's, when it carries its client's nonce."""
        self.writes += 1  # (from here on the message changes state: admission may pump)
        model = layout.model
        timeout_s = timeout_ms / 1000.0 if timeout_ms is not None else self.config.default_timeout_s
        out: list[Outgoing] = []
        nbytes = 0
        for frame in payloads:
            nbytes += len(frame)
        backlog, pumps, config, fleet = self.backlog, self.pumps, self.config, self.fleet
        # Asked as pumpable first: only a full queue reads that, and pump_dirty with
        # nothing marked forms nothing, so the second answer is the one a False would
        # have had. What can leave this turn leaves before the door closes; asked
        # again, not pumpable, the answer is final.
        for pumpable in (True, False):
            verdict = admit(
                layout,
                nbytes,
                timeout_s,
                priority,
                max_batch,
                pumpable,
                config,
                backlog,
                fleet,
                client=client,
                now=now,
            )
            if verdict is not FULL_UNTIL_PUMPED:
                break
            pumps.pump_dirty(now, out, self.dispatcher.pump)
        if self.recording is not None and (type(verdict) is not Refused or verdict.arrival):
            self.recording.append(
                (now, model, layout.shape, round(1000 * timeout_s), int(priority), max_batch)
            )
        if type(verdict) is Refused:
            self.stats.refused(model, verdict.code.name, verdict.shed)
            error = self.replies.error(
                client,
                delimited,
                rid,
                verdict.code,
                verdict.message,
                simple=simple,
                retry_after_ms=verdict.retry_after_ms,
                retry=verdict.retry,
            )
            out.append(error)
            return out
        key = layout.key
        samples = layout.samples
        if layout.order is not None:
            payloads = [payloads[i] for i in layout.order]
            if refs is not None:
                refs = tuple(refs[i] for i in layout.order)
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
            refs,
            shm_outputs,
            nbytes,
            layout.shapes,
            origin,
        )
        backlog.add(req)
        pumps.dirty[key] = None  # the batch forms at the end of the turn
        return out
