"""admission.py: Admission — requests from clients, checked and queued or answered at once.

The second layer of :class:`carpool.broker.core.BrokerCore` (pure): a client message is
decoded (the framed form, the simple form, STATS), validated against its model's spec
(names, dtypes, shapes, sizes, shared-memory references), refused at the door when no
worker can take it, the queue is full, or even the best case would miss its deadline,
and otherwise queued for :mod:`carpool.broker.scheduler`'s pump. A request layout that
passed once is remembered by the protocol's RequestDecoder, and the next request with it
takes its fast path, with the same checks and answers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.broker.batcher import (
    ClientId,
    PendingRequest,
    RequestKey,
    request_key,
)
from carpool.broker.config import BrokerConfig
from carpool.broker.scheduler import BatchScheduler, Outgoing, retry_after_ms
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    Command,
    Frame,
    KnownRequest,
    ModelSpec,
    Priority,
    RequestDecoder,
    ShmRef,
    Submit,
    TensorMeta,
    VersionMismatch,
    check_frame_sizes,
    decode_meta,
    decode_simple_request,
    decode_submit,
    encode,
    is_simple_form,
    parse_header,
    request_id_of,
    shm_wire,
    view,
)
from carpool.common.shape_rules import ShapeRule

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Layout:
    """A request shape already validated against its model (for the fast path)."""

    model: str
    key: RequestKey
    shape: tuple[int, ...]  # the first input's shape, for the arrival trace
    samples: int
    order: tuple[int, ...] | None  # request frame index per spec input; None: the same


#: Layouts remembered (clients choose shapes; the cache is dropped when full).
_MAX_LAYOUTS = 1024


class Admission(BatchScheduler):
    """Client messages: see the module docstring."""

    def __init__(self, config: BrokerConfig | None = None, *, defer_pumps: bool = False) -> None:
        super().__init__(config, defer_pumps=defer_pumps)
        # Request layouts validated once per (model, input names, dtypes, shapes); valid
        # while the model's spec stands (``_respec`` drops a replaced model's).
        self.request_decoder: RequestDecoder[_Layout] = RequestDecoder(_MAX_LAYOUTS)

    def _respec(self, spec: ModelSpec, worker: str, out: list[Outgoing]) -> None:
        """A model no live worker served is registered again with a different spec:
        forget the layouts checked against the old one, and answer the queued requests
        that no longer fit (the rest ride as they are)."""
        self.request_decoder.forget_model(spec.name)
        answered = 0
        for key, queue in self._queues.items():
            if key[0] != spec.name:
                continue
            for req in list(queue):
                misfit = _queued_misfit(spec, req)
                if misfit is not None:
                    self._answer_queued(queue, req, misfit[0], misfit[1], out)
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
                snapshot = self.snapshot()
                if len(frames) > 1:  # echo the caller's id, so it can match the reply
                    snapshot["id"] = request_id_of(decode_meta(view(frames[1])))
                return [self._to_client(client, delimited, encode(Command.STATS, snapshot))]
            if command is not Command.REQUEST:
                raise ProtocolError(f"command {command.name} is not valid from a client")
            if len(frames) < 2:
                raise ProtocolError("REQUEST needs a meta frame")
            meta = decode_meta(view(frames[1]))
            request = self.request_decoder.decode(meta, frames[2:])
            if isinstance(request, KnownRequest):  # a layout validated before
                layout = request.layout
                if self.registry.max_batch(layout.model):
                    return self._enqueue(
                        now,
                        client,
                        delimited,
                        request.request_id,
                        layout,
                        frames[2:],
                        request.timeout_ms,
                        request.priority,
                        False,
                        request.refs,
                        request.shm_outputs,
                    )
                request = decode_submit(meta)  # the full path answers UNAVAILABLE
            submit = request
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
            if now < self.started_s + self.config.register_grace_s:
                # Just (re)started: its workers may not have said READY yet, and a client
                # must not take a restart for a model that does not exist.
                msg = (
                    f"no worker has registered model {submit.model!r} yet; the broker "
                    f"started {now - self.started_s:.1f} s ago"
                )
                code = ErrorCode.UNAVAILABLE
                return [self._error(client, delimited, rid, code, msg, simple=simple)]
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
            None if order == tuple(range(len(order))) else order,
        )
        if not simple:
            self.request_decoder.remember(submit, layout)
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
        if self.stopping:
            msg = "the broker is stopping; retry with another broker or after its restart"
            code = ErrorCode.UNAVAILABLE
            return [self._error(client, delimited, rid, code, msg, simple=simple)]
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
                (now, model, layout.shape, round(1000 * timeout_s), int(priority), max_batch)
            )
        key = layout.key
        out: list[Outgoing] = []
        nbytes = 0
        for frame in payloads:
            nbytes += len(frame)
        room = self.config.max_queued_mib << 20
        if nbytes > room:
            msg = (
                f"request of {nbytes} payload bytes exceeds the broker's queue "
                f"(max_queued_mib {self.config.max_queued_mib})"
            )
            code = ErrorCode.INVALID_ARGUMENT
            return [self._error(client, delimited, rid, code, msg, simple=simple)]
        full = self.queued >= self.config.max_queued or self.queued_bytes + nbytes > room
        if full and (self._dirty or self._dirty_models):
            # Deferred mode: what can leave this turn leaves before the door closes.
            self._pump_dirty(now, out)
            full = self.queued >= self.config.max_queued or self.queued_bytes + nbytes > room
        if full:
            # Until costs are fitted the drain time is unknown: suggest a modest pause.
            drain_s = self._drain_time_s(model, key, self.queued) or 0.05
            out.append(
                self._error(
                    client,
                    delimited,
                    rid,
                    ErrorCode.OVERLOADED,
                    f"broker queue full ({self.queued} requests, {self.queued_bytes} bytes)",
                    simple=simple,
                    retry_after_ms=retry_after_ms(drain_s),
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
            nbytes=nbytes,
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
    rules = spec.rules
    for want in spec.inputs:
        index, got = given[want.name]
        problem = _misfit(want, got.dtype, got.shape, rules[len(order)] if rules else None)
        if problem is not None:
            raise ProtocolError(problem)
        if samples not in (-1, got.shape[0]):
            raise ProtocolError("all inputs of a request must have the same dim 0 (samples)")
        samples = got.shape[0]
        ordered_inputs.append(got)
        order.append(index)
    return tuple(ordered_inputs), tuple(order), samples


def _misfit(
    want: TensorMeta, dtype: str, shape: tuple[int, ...], rule: ShapeRule | None
) -> str | None:
    """Why a request input of ``dtype`` and ``shape`` does not fit the model input
    ``want`` under its shape ``rule`` (None: it fits)."""
    if dtype != want.dtype:
        return f"input {want.name!r}: dtype {dtype}, model takes {want.dtype}"
    if len(shape) != len(want.shape):
        return (
            f"input {want.name!r}: shape {list(shape)} has rank {len(shape)}, "
            f"model takes rank {len(want.shape)} {_spec_shape(want.shape)}"
        )
    for g, w in zip(shape[1:], want.shape[1:], strict=True):
        if w != -1 and g != w:
            fit = _spec_shape(want.shape)
            return f"input {want.name!r}: shape {list(shape)} does not fit {fit}"
    broken = rule.violation(shape) if rule is not None else None
    if broken is not None:
        return f"input {want.name!r}: shape {list(shape)}: {broken}"
    return None


def _queued_misfit(spec: ModelSpec, req: PendingRequest) -> tuple[ErrorCode, str] | None:
    """Why a request queued under an earlier spec of its model does not fit ``spec``
    (None: it fits, and may ride as it is). Its payloads lie in the earlier spec's input
    order, so a request that fits but with its inputs in another order is sent back to
    be resent (only then: a resend of one that does not fit would be refused)."""
    given = {name: (dtype, item) for name, dtype, item in req.key[1]}
    names = [name for name, _, _ in req.key[1]]
    expected = [t.name for t in spec.inputs]
    if set(names) != set(expected):
        msg = f"model {spec.name!r} now takes inputs {expected}, request has {names}"
        return ErrorCode.INVALID_ARGUMENT, msg
    rules = spec.rules
    for i, want in enumerate(spec.inputs):
        dtype, item = given[want.name]
        problem = _misfit(want, dtype, (req.samples, *item), rules[i] if rules else None)
        if problem is not None:
            msg = f"model {spec.name!r} was re-registered while the request was queued: {problem}"
            return ErrorCode.INVALID_ARGUMENT, msg
    if names != expected:
        msg = f"model {spec.name!r} was re-registered with its inputs in another order"
        return ErrorCode.UNAVAILABLE, f"{msg} while the request was queued; resend it"
    return None


def _spec_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("?" if d == -1 else str(d) for d in shape) + "]"
