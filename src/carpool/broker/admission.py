"""admission.py: the door — may a valid request queue? — and the checks of a request
against its model's spec. Pure: no state is changed here.

:func:`admit` answers :class:`Admitted` or :class:`Refused` for a request that passed
validation: refused when the broker is stopping, the request is larger than any batch,
the queue is full (by count or payload bytes), its client already holds its share
(``max_client_requests``, ``max_client_mib``: queued or at workers), or even the best
case (the work queued ahead at full speed, then this request) ends past its deadline.
:func:`conform` checks a request's inputs against its model (names, dtypes, shapes), and
:func:`bucketed` puts a padded model's request in its bucket (§8.1); :func:`layout_of`
does both and gives the :class:`Layout` a request that passed is remembered by (the
protocol's :class:`~carpool.common.protocol.KnownLayouts`: a later request of the same
layout comes decoded with it). Shape rules and batch limits are each worker's own: the
registry says which workers admit a layout's key (broker/limits.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from carpool.broker.batcher import RequestQueue, request_key
from carpool.broker.replies import Refused, retry_after_ms
from carpool.broker.requests import ClientId, PendingRequest, RequestKey
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    Frame,
    ModelSpec,
    Request,
    ShmRef,
    TensorMeta,
    check_frame_sizes,
)

if TYPE_CHECKING:
    from carpool.broker.backlog import Backlog
    from carpool.broker.config import BrokerConfig
    from carpool.broker.fleet import FleetModel
    from carpool.broker.registry import WorkerRegistry


@dataclass(frozen=True, slots=True)
class Layout:
    """A request shape already validated against its model (for the fast path)."""

    model: str
    key: RequestKey
    shape: tuple[int, ...]  # the first input's shape, for the arrival trace
    samples: int
    order: tuple[int, ...] | None  # request frame index per spec input; None: the same
    # Its own item shapes per spec input where they differ from its bucket's (the key's):
    # BATCH ``requests[i].shapes`` (§8.3); None: it has the bucket's shape.
    shapes: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request may queue (:data:`ADMITTED`, the one instance)."""


ADMITTED = Admitted()
_STOPPING = "the broker is stopping; retry with another broker or after its restart"


def admit(
    layout: Layout,
    nbytes: int,
    timeout_s: float,
    priority: int,
    max_batch: int,
    config: BrokerConfig,
    backlog: Backlog,
    fleet: FleetModel,
    client: ClientId,
    now: float,
    is_full: bool | None = None,
) -> Admitted | Refused:
    """May a valid request of ``layout`` (``nbytes`` of payload, due in ``timeout_s``,
    of ``priority``, from ``client``) queue ``now``? ``max_batch``: the largest batch a live
    worker that admits its shapes takes (> 0). A full queue refuses it: the caller forms
    this turn's batches first where they would make room, and may pass what :func:`full`
    says then (``is_full``; None: asked here)."""
    if backlog.stopping:
        hint = backlog.retry_after_ms(now)
        return Refused(ErrorCode.UNAVAILABLE, _STOPPING, hint, arrival=False, retry=True)
    model = layout.model
    samples = layout.samples
    if samples > max_batch:
        msg = (
            f"request has {samples} samples; model {model!r} accepts at most {max_batch} per batch"
        )
        return Refused(ErrorCode.INVALID_ARGUMENT, msg, arrival=False)
    room, client_room = config.max_queued_mib << 20, config.max_client_mib << 20
    if nbytes > room or nbytes > client_room:
        what, key, mib = (
            ("the broker's queue", "max_queued_mib", config.max_queued_mib)
            if nbytes > room
            else ("what one client may have queued", "max_client_mib", config.max_client_mib)
        )
        msg = f"request of {nbytes} payload bytes exceeds {what} ({key} {mib})"
        return Refused(ErrorCode.INVALID_ARGUMENT, msg)
    if full(config, backlog, nbytes) if is_full is None else is_full:
        queued = backlog.queued
        # Until costs are fitted the drain time is unknown: suggest a modest pause.
        drain_s = fleet.drain_time_s(model, layout.key, queued) or 0.05
        msg = f"broker queue full ({queued} requests, {backlog.queued_bytes} bytes)"
        return Refused(ErrorCode.OVERLOADED, msg, retry_after_ms(drain_s))
    # (Backlog.held, inlined) speed: docs/benchmarks.md "Why the hot path looks as it does"
    mine = backlog.held_by.get(client)
    held, held_bytes = (0, 0) if mine is None else mine
    if held >= config.max_client_requests or held_bytes + nbytes > client_room:
        # Its own requests must drain first: pumping this turn frees no such room (a
        # request at a worker is still held).
        drain_s = fleet.drain_time_s(model, layout.key, held) or 0.05
        msg = (
            f"this client already has {held} requests ({held_bytes} payload bytes) at the "
            f"broker (max_client_requests {config.max_client_requests}, max_client_mib "
            f"{config.max_client_mib})"
        )
        return Refused(ErrorCode.OVERLOADED, msg, retry_after_ms(drain_s))
    policy = fleet.policy(model)
    if policy.edf:
        # The SLA countdown at the door: the predicted completion (the soonest a worker
        # is free, the work queued ahead, then this request's batch) held against the
        # deadline less the model's headroom, as the policy holds its batches: say now
        # what would only be shed later. The work ahead: its own queue's samples, and
        # the batches the model's other queues (other shapes or buckets) will form.
        own, batches = backlog.ahead(layout.key, priority)
        completion = fleet.completion(now, model, layout.key, own + samples, batches)
        budget_s = (1.0 - fleet.batching_for(model).admit_headroom) * timeout_s
        if completion is not None and policy.refuses(*completion, budget_s):
            finish_s = completion[0]
            msg = (
                f"cannot meet the {1000 * timeout_s:.0f} ms deadline: predicted "
                f"completion in {1000 * finish_s:.0f} ms"
            )
            return Refused(ErrorCode.DEADLINE_EXCEEDED, msg, shed=True)
    return ADMITTED


def full(config: BrokerConfig, backlog: Backlog, nbytes: int) -> bool:
    """Whether the queue has no room for a request of ``nbytes`` (by count or bytes)."""
    return (
        backlog.queued >= config.max_queued
        or backlog.queued_bytes + nbytes > config.max_queued_mib << 20
    )


def conform(
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
        problem = misfit(want, got.dtype, got.shape)
        if problem is not None:
            raise ProtocolError(problem)
        if samples not in (-1, got.shape[0]):
            raise ProtocolError("all inputs of a request must have the same dim 0 (samples)")
        samples = got.shape[0]
        ordered_inputs.append(got)
        order.append(index)
    return tuple(ordered_inputs), tuple(order), samples


def bucketed(
    spec: ModelSpec,
    inputs: Sequence[TensorMeta],
    order: Sequence[int],
    refs: Sequence[ShmRef | None] | None,
) -> tuple[tuple[TensorMeta, ...], tuple[tuple[int, ...], ...] | None]:
    """A conforming request (``inputs`` in spec order, ``order`` their index among the
    request's, ``refs`` its shared-memory references in its order) of a model with pad
    rules, as its queue sees it: each padded input with its bucket's item shape
    (:meth:`PadRule.bucket <carpool.common.padding.PadRule.bucket>`), and the request's
    own item shapes where any differs from the bucket (else None).

    Raises:
        ProtocolError: an input fits no bucket (naming it, its shape and what the rule
            allows), or an input that needs padding is in shared memory (§5.4: only a
            bucket-shaped input may be).
    """
    out: list[TensorMeta] = []
    own: list[tuple[int, ...]] = []
    differs = False
    for i, (t, rule) in enumerate(zip(inputs, spec.pads, strict=True)):
        item = t.shape[1:]
        own.append(item)
        if rule is None:
            out.append(t)
            continue
        bucket = rule.bucket(item)
        if bucket is None:
            raise ProtocolError(
                f"input {t.name!r}: shape {list(t.shape)} fits no bucket of model "
                f"{spec.name!r}; it takes {rule.allowed()}"
            )
        if bucket != item:
            if refs is not None and refs[order[i]] is not None:
                raise ProtocolError(
                    f"input {t.name!r}: shape {list(t.shape)} is padded to its bucket "
                    f"{list(bucket)}; an input in shared memory must have its bucket's shape"
                )
            differs = True
            t = TensorMeta(t.name, t.dtype, (t.shape[0], *bucket))
        out.append(t)
    return tuple(out), (tuple(own) if differs else None)


def layout_of(spec: ModelSpec, request: Request[Layout]) -> Layout:
    """The layout of a request that conforms to ``spec`` (:func:`conform`), in its bucket
    where the model is padded (:func:`bucketed`).

    Raises:
        ProtocolError: it does not conform, or fits no bucket.
    """
    inputs, order, samples = conform(spec, request.inputs, request.payloads, request.shm)
    shape = inputs[0].shape
    shapes = None
    if spec.pads:  # queued by bucket (§8.1)
        inputs, shapes = bucketed(spec, inputs, order, request.shm)
    in_order = order == tuple(range(len(order)))
    key = request_key(spec.name, inputs)
    return Layout(spec.name, key, shape, samples, None if in_order else order, shapes)


def misfit(want: TensorMeta, dtype: str, shape: tuple[int, ...]) -> str | None:
    """Why a request input of ``dtype`` and ``shape`` does not fit the model input
    ``want`` (None: it fits)."""
    if dtype != want.dtype:
        return f"input {want.name!r}: dtype {dtype}, model takes {want.dtype}"
    if len(shape) != len(want.shape):
        return (
            f"input {want.name!r}: shape {list(shape)} has rank {len(shape)}, "
            f"model takes rank {len(want.shape)} {spec_shape(want.shape)}"
        )
    for g, w in zip(shape[1:], want.shape[1:], strict=True):
        if w != -1 and g != w:
            fit = spec_shape(want.shape)
            return f"input {want.name!r}: shape {list(shape)} does not fit {fit}"
    return None


def queued_misfit(spec: ModelSpec, req: PendingRequest) -> tuple[ErrorCode, str] | None:
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
    pads, own = spec.pads, req.shapes
    rebucketed = False
    for i, want in enumerate(spec.inputs):
        dtype, bucket = given[want.name]
        item = bucket if own is None else own[names.index(want.name)]
        problem = misfit(want, dtype, (req.samples, *item))
        if problem is not None:
            msg = f"model {spec.name!r} was re-registered while the request was queued: {problem}"
            return ErrorCode.INVALID_ARGUMENT, msg
        rule = pads[i] if pads else None
        if (item if rule is None else rule.bucket(item)) != bucket:
            rebucketed = True
    if names != expected or rebucketed:
        what = "inputs in another order" if names != expected else "other buckets"
        msg = f"model {spec.name!r} was re-registered with its {what}"
        return ErrorCode.UNAVAILABLE, f"{msg} while the request was queued; resend it"
    return None


def unfinishable(
    now: float,
    until_s: float | None,
    queues: dict[RequestKey, RequestQueue],
    registry: WorkerRegistry,
    fleet: FleetModel,
) -> list[tuple[RequestQueue, PendingRequest]]:
    """The queued requests that cannot be answered by ``until_s`` (None: all of them): no
    live worker serves its model, or its predicted completion, behind what is queued
    ahead of it, lies past ``until_s`` (a stopping broker answers them at once)."""
    out = []
    ahead: dict[str, int] = {}  # samples kept so far, by model
    stop_by_s = until_s if until_s is not None else float("-inf")
    for queue in queues.values():
        for req in queue:
            model = req.model
            keep = until_s is not None and any(registry.serving(model))
            if keep:
                samples = ahead.get(model, 0) + req.samples
                completion = fleet.completion(now, model, queue.key, samples)
                keep = completion is None or now + completion[0] <= stop_by_s
            if keep:
                ahead[model] = samples
            else:
                out.append((queue, req))
    return out


def misfits(
    spec: ModelSpec, queues: dict[RequestKey, RequestQueue]
) -> list[tuple[RequestQueue, PendingRequest, ErrorCode, str]]:
    """The queued requests of ``spec``'s model that no longer fit it (the model was
    registered again with another spec), each with its queue and its answer."""
    out = []
    for key, queue in queues.items():
        if key[0] == spec.name:
            for req in queue:
                misfit = queued_misfit(spec, req)
                if misfit is not None:
                    out.append((queue, req, *misfit))
    return out


def spec_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("?" if d == -1 else str(d) for d in shape) + "]"
