"""worker_messages.py: what the broker says to workers — pure.

The BATCH meta (:class:`BatchMeta` of :class:`BatchItem`), its encoders and decoders;
READY is in :mod:`.ready`, and RESULT and FAILED, with the worker's side as one typed
union, in :mod:`.from_worker`.

What the broker says to a worker is one typed union decoded in one place:
:func:`decode_from_broker` turns the broker's message (its frames, as the worker's
socket gives them) into one of :data:`FromBroker`: BATCH (its meta, and the payload
frames as the objects that arrived: never read or copied), HEARTBEAT, DISCONNECT, or
:class:`BrokerMalformed` for a message that breaks the protocol (with the batch's id
where a BATCH's meta is readable, so that the worker can answer it FAILED and the
broker gets its credit back). Each message's ``to_frames`` is its one encoder. A worker
in the broker's own process is handed these objects, with no frames in between.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.common.errors import ProtocolError
from carpool.common.protocol.frames import (
    Command,
    Frame,
    Signature,
    TensorMeta,
    decode_meta,
    encode,
    header,
    optional_number,
    pack,
    parse_header,
    require_field,
    require_map,
    require_name,
    tensor_list,
    tensor_signature,
    view,
)
from carpool.common.protocol.refs import ShmRef, parse_batch_refs, shm_wire

#: Header frames, built once.
_BATCH = header(Command.BATCH)


@dataclass(slots=True)
class BatchItem:
    """One request inside a BATCH. Not frozen, for speed:
    docs/benchmarks.md "Why the hot path looks as it does"."""

    request_id: int
    samples: int
    simple: bool
    queue_ms: float
    # Per batch input, in spec order: where its bytes are in shared memory (§5.4), or
    # None for an input in its frame; None when all are in frames.
    shm: tuple[ShmRef | None, ...] | None = None
    # The client reads large outputs from this worker's ring (§5.5).
    shm_outputs: bool = False
    # Per batch input, in spec order: this request's own item shape (its shape without
    # dim 0), where it differs from the batch's bucket (§8.3: padded into it, its outputs
    # cropped back); None when every input has the bucket's shape.
    shapes: tuple[tuple[int, ...], ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        """BATCH ``requests[i]``."""
        return item_wire(
            self.request_id,
            self.samples,
            self.simple,
            self.queue_ms,
            self.shm,
            self.shm_outputs,
            self.shapes,
        )


def item_wire(
    request_id: int,
    samples: int,
    simple: bool,
    queue_ms: float,
    shm: tuple[ShmRef | None, ...] | None,
    shm_outputs: bool,
    shapes: tuple[tuple[int, ...], ...] | None,
) -> dict[str, Any]:
    """BATCH ``requests[i]`` from a :class:`BatchItem`'s fields (the broker encodes its
    dispatched requests with it, without the item)."""
    wire: dict[str, Any] = {
        "id": request_id,
        "n": samples,
        "simple": simple,
        "queue_ms": queue_ms,  # (not rounded: a float packs in 9 bytes either way)
    }
    if shm is not None:
        wire["shm"] = shm_wire(shm)
    if shm_outputs:
        wire["shm_outputs"] = True
    if shapes is not None:
        wire["shapes"] = shapes
    return wire


def batch_frames(
    batch_id: int,
    model: str,
    inputs: list[dict[str, Any]],
    requests: list[dict[str, Any]],
    payloads: Sequence[object],
) -> list[Any]:
    """A BATCH's frames from its meta's wire fields (``inputs``: each input's
    :meth:`TensorMeta.to_wire`; ``requests``: each item's :func:`item_wire`) and its
    ``payloads``, request-major."""
    meta = {"batch": batch_id, "model": model, "inputs": inputs, "requests": requests}
    return [_BATCH, pack(meta), *payloads]


class BatchInputCache:
    """BATCH ``inputs`` lists that passed validation, by signature: a worker sees the
    same few in every batch and validates each once. The same list decodes to the same
    tuple while it is remembered (dropped all at once when ``max_entries`` are)."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._known: dict[Signature, tuple[TensorMeta, ...]] = {}

    def inputs(self, raw: Any) -> tuple[TensorMeta, ...]:
        """The validated input specs of a BATCH ``inputs`` list."""
        sig = tensor_signature(raw)
        inputs = None if sig is None else self._known.get(sig)
        if inputs is None:
            inputs = tensor_list(raw, "batch inputs", allow_dynamic=True)
            if sig is not None:
                if len(self._known) >= self.max_entries:
                    self._known.clear()
                self._known[sig] = inputs
        return inputs


@dataclass(slots=True)
class BatchMeta:
    """BATCH meta: requests of one model and one item shape, stacked along dim 0.
    (Not frozen, for speed: docs/benchmarks.md "Why the hot path looks as it does".)"""

    batch_id: int
    model: str
    # Per-input spec with shape[0] == -1: each request brings `samples` rows.
    inputs: tuple[TensorMeta, ...]
    items: tuple[BatchItem, ...]
    _total: int = field(default=-1, repr=False, compare=False)

    @property
    def total_samples(self) -> int:
        total = self._total
        if total < 0:  # the items never change: summed once
            total = self._total = sum(i.samples for i in self.items)
        return total

    def to_wire(self) -> dict[str, Any]:
        return {
            "batch": self.batch_id,
            "model": self.model,
            "inputs": [t.to_wire() for t in self.inputs],
            "requests": [i.to_wire() for i in self.items],
        }

    def to_frames(self, payloads: Sequence[object]) -> list[Any]:
        """The BATCH's frames; ``payloads`` request-major."""
        return batch_frames(
            self.batch_id,
            self.model,
            [t.to_wire() for t in self.inputs],
            [i.to_wire() for i in self.items],
            payloads,
        )

    @classmethod
    def from_wire(cls, meta: dict[str, Any], known: BatchInputCache | None = None) -> BatchMeta:
        """A BATCH meta checked; ``known``: input lists validated before (a worker's)."""
        batch_id = require_field(meta, "batch", int, "batch")
        model = require_name(meta.get("model"), "batch model")
        raw_inputs = meta.get("inputs")
        if known is None:
            inputs = tensor_list(raw_inputs, "batch inputs", allow_dynamic=True)
        else:
            inputs = known.inputs(raw_inputs)
        reqs = meta.get("requests")
        if not isinstance(reqs, list) or not reqs:
            raise ProtocolError("batch: requests must be a non-empty list")
        items: list[BatchItem] = []
        append = items.append
        for r in reqs:  # checks inlined for speed (docs/benchmarks.md), same rules
            if type(r) is not dict:
                require_map(r, "batch request")  # raises with the usual message
            rid = r.get("id")
            n = r.get("n")
            if type(rid) is not int or not 0 <= rid < 2**64 or type(n) is not int or n < 1:
                raise ProtocolError("batch: each request needs an 'id' and 'n' >= 1")
            queue_ms = r.get("queue_ms", 0.0)
            if type(queue_ms) is not float or not math.isfinite(queue_ms):
                queue_ms = optional_number(r, "queue_ms")
            refs = r.get("shm")
            if refs is not None:
                refs = parse_batch_refs(refs, len(inputs))
            shapes = r.get("shapes")
            if shapes is not None:
                shapes = own_shapes(shapes, inputs)
            append(
                BatchItem(
                    rid,
                    n,
                    bool(r.get("simple", False)),
                    queue_ms,
                    refs,
                    r.get("shm_outputs") is True,
                    shapes,
                )
            )
        return cls(batch_id, model, inputs, tuple(items))

    def request_tensors(self, item: BatchItem) -> tuple[TensorMeta, ...]:
        """The concrete tensor metas of one request of this batch (its own shapes)."""
        shapes = item.shapes or [t.shape[1:] for t in self.inputs]
        return tuple(
            TensorMeta(t.name, t.dtype, (item.samples, *shape))
            for t, shape in zip(self.inputs, shapes, strict=True)
        )


def own_shapes(raw: Any, inputs: Sequence[TensorMeta]) -> tuple[tuple[int, ...], ...]:
    """BATCH ``requests[i].shapes`` checked against the batch's bucket ``inputs``: one
    item shape per input, of its rank, each dim at most the bucket's (§8.3).

    Raises:
        ProtocolError: naming the input and the shape that does not fit.
    """
    if not isinstance(raw, list) or len(raw) != len(inputs):
        raise ProtocolError(f"batch: request shapes must list one shape per input ({len(inputs)})")
    out = []
    for shape, t in zip(raw, inputs, strict=True):
        bucket = t.shape[1:]
        if (
            not isinstance(shape, list)
            or len(shape) != len(bucket)
            or not all(type(d) is int and 0 <= d <= b for d, b in zip(shape, bucket, strict=True))
        ):
            raise ProtocolError(
                f"batch: input {t.name!r}: request shape {shape!r} does not fit the "
                f"batch's bucket {list(bucket)} (same rank, no dim larger)"
            )
        out.append(tuple(shape))
    return tuple(out)


_HEARTBEAT_FRAMES = (header(Command.HEARTBEAT), encode(Command.HEARTBEAT, {})[1])


@dataclass(slots=True)
class BrokerBatch:
    """BATCH: requests to run as one batch; ``payloads``, request-major, as they arrived.
    (Not frozen, for speed: docs/benchmarks.md "Why the hot path looks as it does".)"""

    batch: BatchMeta
    payloads: Sequence[Frame]

    def to_frames(self) -> list[Any]:
        return self.batch.to_frames(self.payloads)

    def to_message(self) -> BrokerBatch:
        return self


@dataclass(frozen=True, slots=True)
class BrokerHeartbeat:
    """HEARTBEAT: the broker is alive."""

    def to_frames(self) -> list[Any]:
        return list(_HEARTBEAT_FRAMES)

    def to_message(self) -> BrokerHeartbeat:
        return self


@dataclass(frozen=True, slots=True)
class BrokerDisconnect:
    """DISCONNECT: the broker tells the worker to go (and to connect again, MDP's rule)."""

    reason: str = ""

    def to_frames(self) -> list[Any]:
        return encode(Command.DISCONNECT, {"reason": self.reason})

    def to_message(self) -> BrokerDisconnect:
        return self


@dataclass(frozen=True, slots=True)
class BrokerMalformed:
    """A message from the broker that breaks the protocol: ``error`` says how.
    ``batch_id``: a BATCH's id, where its meta was readable (answer it FAILED)."""

    error: str
    batch_id: int | None = None


FromBroker = BrokerBatch | BrokerHeartbeat | BrokerDisconnect | BrokerMalformed

#: The one HEARTBEAT a broker sends (it has no fields).
HEARTBEAT_TO_WORKER = BrokerHeartbeat()


def decode_from_broker(frames: Sequence[Any], known: BatchInputCache | None = None) -> FromBroker:
    """The typed message of the broker's frames. ``known``: the worker's BATCH input
    lists validated before. Never raises: a message that breaks the protocol is a
    :class:`BrokerMalformed`."""
    if len(frames) < 2:
        return BrokerMalformed("broker messages have a header and a meta frame")
    try:
        command = parse_header(view(frames[0]))
        meta = decode_meta(view(frames[1]))
    except ProtocolError as exc:
        return BrokerMalformed(str(exc))
    if command is Command.BATCH:
        try:
            return BrokerBatch(BatchMeta.from_wire(meta, known), frames[2:])
        except ProtocolError as exc:
            batch_id = meta.get("batch")
            return BrokerMalformed(str(exc), batch_id if type(batch_id) is int else None)
    if command is Command.HEARTBEAT:
        return HEARTBEAT_TO_WORKER
    if command is Command.DISCONNECT:
        reason = meta.get("reason", "")
        return BrokerDisconnect(reason if isinstance(reason, str) else "")
    return BrokerMalformed(f"command {command.name} is not valid from a broker")
