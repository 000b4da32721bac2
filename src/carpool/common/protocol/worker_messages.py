"""worker_messages.py: what workers and the broker say to each other — pure.

READY (:class:`Ready` with its :class:`ModelSpec` list), BATCH (:class:`BatchMeta` of
:class:`BatchItem`), RESULT (:class:`ResultMeta`) and FAILED (:class:`FailedMeta`)
metas, their encoders and decoders.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.common import codec
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol.client_messages import ErrorReply
from carpool.common.protocol.frames import (
    MAX_MODELS,
    Command,
    header,
    optional_number,
    require_field,
    require_map,
    require_name,
)
from carpool.common.protocol.refs import ShmRef, parse_batch_refs, shm_wire
from carpool.common.protocol.tensors import Signature, TensorMeta, tensor_list, tensor_signature
from carpool.common.shape_rules import ShapeRule

#: Header frames, built once.
_BATCH, _RESULT = header(Command.BATCH), header(Command.RESULT)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a worker serves for one model: I/O specs (dim 0 is the batch) and batch limits."""

    name: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    max_batch: int
    # Batch sizes the engine runs best at (TensorRT profile sizes); empty means any.
    preferred_batch: tuple[int, ...] = ()
    # Limits on each input's dims beyond its shape, in input order; () when none has any.
    rules: tuple[ShapeRule | None, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        inputs = [t.to_wire() for t in self.inputs]
        for descriptor, rule in zip(inputs, self.rules or [None] * len(inputs), strict=True):
            if rule:
                descriptor.update(rule.to_wire())
        return {
            "name": self.name,
            "inputs": inputs,
            "outputs": [t.to_wire() for t in self.outputs],
            "max_batch": self.max_batch,
            "preferred_batch": list(self.preferred_batch),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ModelSpec:
        m = require_map(obj, "model spec")
        name = require_name(m.get("name"), "model spec")
        inputs = tensor_list(m.get("inputs"), f"model {name} inputs", allow_dynamic=True)
        rules = tuple(
            ShapeRule.from_wire(d, len(t.shape), f"model {name} input {t.name!r}")
            for d, t in zip(m["inputs"], inputs, strict=True)
        )
        outputs = tensor_list(m.get("outputs"), f"model {name} outputs", allow_dynamic=True)
        max_batch = require_field(m, "max_batch", int, f"model {name}")
        if max_batch < 1:
            raise ProtocolError(f"model {name}: max_batch must be >= 1")
        preferred = m.get("preferred_batch", [])
        if not isinstance(preferred, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= max_batch
            for p in preferred
        ):
            raise ProtocolError(f"model {name}: preferred_batch must list ints in 1..max_batch")
        return cls(
            name,
            inputs,
            outputs,
            max_batch,
            tuple(sorted(set(preferred))),
            rules if any(rules) else (),
        )


@dataclass(frozen=True, slots=True)
class Ready:
    """READY meta: a worker announces itself and what it serves."""

    name: str
    # How many batches the broker may have outstanding at this worker (credits).
    slots: int
    models: tuple[ModelSpec, ...]
    # The worker's heartbeat interval; the broker heartbeats it at the same rate.
    heartbeat_ms: int = 1000

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slots": self.slots,
            "models": [m.to_wire() for m in self.models],
            "heartbeat_ms": self.heartbeat_ms,
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> Ready:
        name = require_name(meta.get("name"), "ready")
        slots = require_field(meta, "slots", int, "ready")
        if not 1 <= slots <= 1024:
            raise ProtocolError("ready: slots must be in 1..1024")
        models = meta.get("models")
        if not isinstance(models, list) or not models or len(models) > MAX_MODELS:
            raise ProtocolError(f"ready: models must be a list of 1..{MAX_MODELS} model specs")
        specs = tuple(ModelSpec.from_wire(m) for m in models)
        if len({s.name for s in specs}) != len(specs):
            raise ProtocolError("ready: duplicate model names")
        heartbeat_ms = meta.get("heartbeat_ms", 1000)
        if isinstance(heartbeat_ms, bool) or not isinstance(heartbeat_ms, int):
            raise ProtocolError("ready: heartbeat_ms must be an int")
        if not 10 <= heartbeat_ms <= 600_000:
            raise ProtocolError("ready: heartbeat_ms must be in 10..600000")
        return cls(name, slots, specs, heartbeat_ms)


@dataclass(slots=True)
class BatchItem:
    """One request inside a BATCH. (Not frozen: a worker builds one per request of every
    batch, and a frozen dataclass's ``__init__`` costs ~4 x a plain one.)"""

    request_id: int
    samples: int
    simple: bool
    queue_ms: float
    # Per batch input, in spec order: where its bytes are in shared memory (§5.4), or
    # None for an input in its frame; None when all are in frames.
    shm: tuple[ShmRef | None, ...] | None = None
    # The client reads large outputs from this worker's ring (§5.5).
    shm_outputs: bool = False

    def to_wire(self) -> dict[str, Any]:
        shm = None if self.shm is None else shm_wire(self.shm)
        return batch_item_wire(
            self.request_id, self.samples, self.simple, self.queue_ms, shm, self.shm_outputs
        )


def batch_item_wire(
    request_id: int,
    samples: int,
    simple: bool,
    queue_ms: float,
    shm: list[dict[str, Any] | None] | None = None,
    shm_outputs: bool = False,
) -> dict[str, Any]:
    """BATCH ``requests[i]`` from its fields (``shm`` in wire form: :func:`shm_wire`)."""
    wire: dict[str, Any] = {
        "id": request_id,
        "n": samples,
        "simple": simple,
        "queue_ms": round(queue_ms, 3),
    }
    if shm is not None:
        wire["shm"] = shm
    if shm_outputs:
        wire["shm_outputs"] = True
    return wire


def batch_inputs_wire(inputs: Iterable[TensorMeta]) -> list[dict[str, Any]]:
    """BATCH ``inputs``: one descriptor per input, dim 0 ``-1``."""
    return [t.to_wire() for t in inputs]


def batch_wire(
    batch_id: int, model: str, inputs: list[dict[str, Any]], requests: list[dict[str, Any]]
) -> dict[str, Any]:
    """A BATCH meta from its fields (:func:`batch_inputs_wire`, :func:`batch_item_wire`)."""
    return {"batch": batch_id, "model": model, "inputs": inputs, "requests": requests}


def batch_frames(meta: dict[str, Any], payloads: Sequence[object]) -> list[Any]:
    """Frames of a BATCH whose meta :func:`batch_wire` built; payloads request-major."""
    return [_BATCH, codec.pack(meta), *payloads]


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
    (Not frozen, like BatchItem and ResultMeta: built per batch on the hot path.)"""

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
        return batch_wire(
            self.batch_id,
            self.model,
            batch_inputs_wire(self.inputs),
            [i.to_wire() for i in self.items],
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
        for r in reqs:  # per request of every batch: checks inlined, same rules
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
            append(
                BatchItem(
                    rid,
                    n,
                    bool(r.get("simple", False)),
                    queue_ms,
                    refs,
                    r.get("shm_outputs") is True,
                )
            )
        return cls(batch_id, model, inputs, tuple(items))

    def request_tensors(self, item: BatchItem) -> tuple[TensorMeta, ...]:
        """The concrete tensor metas of one request of this batch."""
        return tuple(TensorMeta(t.name, t.dtype, (item.samples, *t.shape[1:])) for t in self.inputs)


@dataclass(slots=True)
class ResultMeta:
    """RESULT meta: a finished batch. ``frames[i]`` frames of replies follow per request."""

    batch_id: int
    rho: float
    compute_ms: float
    frames: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return result_wire(self.batch_id, self.rho, self.compute_ms, self.frames)

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> ResultMeta:
        batch_id = require_field(meta, "batch", int, "result")
        frames = meta.get("frames")
        if not isinstance(frames, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in frames
        ):
            raise ProtocolError("result: frames must be a list of ints >= 1")
        return cls(
            batch_id,
            optional_number(meta, "rho"),
            optional_number(meta, "compute_ms"),
            tuple(frames),
        )


def result_wire(
    batch_id: int, rho: float, compute_ms: float, frames: Iterable[int]
) -> dict[str, Any]:
    """A RESULT meta from its fields: ``frames[i]``, the frame count of request i's reply."""
    return {
        "batch": batch_id,
        "rho": round(rho, 4),
        "compute_ms": round(compute_ms, 3),
        "frames": list(frames),
    }


def result_frames(meta: dict[str, Any], replies: Sequence[object]) -> list[Any]:
    """Frames of a RESULT whose meta :func:`result_wire` built, then the replies' frames."""
    return [_RESULT, codec.pack(meta), *replies]


@dataclass(frozen=True, slots=True)
class FailedMeta:
    """FAILED meta: a batch the worker could not run."""

    batch_id: int
    code: ErrorCode
    message: str
    rho: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "batch": self.batch_id,
            "code": int(self.code),
            "message": self.message,
            "rho": round(self.rho, 4),
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> FailedMeta:
        batch_id = require_field(meta, "batch", int, "failed")
        err = ErrorReply.from_wire(meta)
        return cls(batch_id, err.code, err.message, optional_number(meta, "rho"))
