"""metadata.py: METADATA — what a client may learn of the models a broker serves — pure.

A client asks for one model by name, or for every model; the broker answers from its
live workers' READY (§6.6): each model's inputs and outputs (names, dtypes, shapes with
``-1`` for dynamic dims, shape rules, pad rules and buckets, crops), its batch limits,
the names of the workers that serve it (never a routing id or an address), and each
worker's own limits (:class:`WorkerLimits`: batch limit and shape rules). Modelled
on KServe v2's model metadata (``GET v2/models/<name>``), in this protocol's own types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ProtocolError
from carpool.common.protocol.client_messages import request_id_of
from carpool.common.protocol.frames import (
    Command,
    TensorMeta,
    header,
    pack,
    require_map,
    require_name,
)
from carpool.common.protocol.ready import ModelSpec
from carpool.common.shape_rules import ShapeRule

__all__ = [
    "MetadataRequest",
    "ModelMetadata",
    "WorkerLimits",
    "metadata_reply_frames",
    "parse_metadata_reply",
]

_METADATA = header(Command.METADATA)


@dataclass(frozen=True, slots=True)
class MetadataRequest:
    """METADATA request meta: ``model`` names one model; None asks for all of them.
    ``delimited``: as the broker received it, after an empty delimiter frame (a REQ
    socket), so that its answer goes back after one too (not on the wire)."""

    request_id: int | None = None
    model: str | None = None
    delimited: bool = False

    def to_wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self.request_id is not None:
            meta["id"] = self.request_id
        if self.model is not None:
            meta["model"] = self.model
        return meta

    def to_frames(self) -> list[Any]:
        return [_METADATA, pack(self.to_wire())]

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> MetadataRequest:
        model = meta.get("model")
        if model is not None:
            model = require_name(model, "metadata model")
        return cls(request_id_of(meta), model)


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """What one live worker (by the name it gave) takes of a model: its ``max_batch``,
    ``preferred_batch`` and shape rules (per input, in input order; ``()``: none)."""

    worker: str
    max_batch: int
    preferred_batch: tuple[int, ...] = ()
    rules: tuple[ShapeRule | None, ...] = ()

    def to_wire(self, inputs: Sequence[TensorMeta]) -> dict[str, Any]:
        ruled = zip(inputs, self.rules or [None] * len(inputs), strict=True)
        return {
            "worker": self.worker,
            "max_batch": self.max_batch,
            "preferred_batch": list(self.preferred_batch),
            "inputs": [{"name": t.name, **(r.to_wire() if r else {})} for t, r in ruled],
        }

    @classmethod
    def from_wire(cls, obj: Any, inputs: Sequence[TensorMeta]) -> WorkerLimits:
        m = require_map(obj, "worker limits")
        worker = require_name(m.get("worker"), "worker limits")
        max_batch, preferred = m.get("max_batch"), m.get("preferred_batch", [])
        if type(max_batch) is not int or max_batch < 1:
            raise ProtocolError("worker limits: max_batch must be an int >= 1")
        if not isinstance(preferred, list) or not all(type(p) is int for p in preferred):
            raise ProtocolError("worker limits: preferred_batch must list ints")
        raw = m.get("inputs", [])
        if not isinstance(raw, list) or len(raw) != len(inputs):
            raise ProtocolError("worker limits: inputs must list the model's inputs")
        rules = tuple(
            ShapeRule.from_wire(require_map(d, "worker limits input"), len(t.shape), t.name)
            for d, t in zip(raw, inputs, strict=True)
        )
        return cls(worker, max_batch, tuple(preferred), rules if any(rules) else ())


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """One model as METADATA describes it: its spec, with the union of its live workers'
    limits (the largest ``max_batch``, every ``preferred_batch``, the loosest shape rules
    that every shape one of them admits keeps), the names of the live workers that serve
    it, sorted, and each one's own limits (``limits``, sorted by worker name)."""

    spec: ModelSpec
    workers: tuple[str, ...]
    limits: tuple[WorkerLimits, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        wire = self.spec.to_wire()
        wire["workers"] = list(self.workers)
        wire["limits"] = [w.to_wire(self.spec.inputs) for w in self.limits]
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> ModelMetadata:
        m = require_map(obj, "model metadata")
        workers = m.get("workers", [])
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
            raise ProtocolError("model metadata: workers must be a list of names")
        spec = ModelSpec.from_wire(m)
        raw = m.get("limits", [])
        if not isinstance(raw, list):
            raise ProtocolError("model metadata: limits must be a list")
        limits = tuple(WorkerLimits.from_wire(w, spec.inputs) for w in raw)
        return cls(spec, tuple(workers), limits)


def metadata_reply_frames(request_id: int | None, models: Sequence[ModelMetadata]) -> list[Any]:
    """The frames of a METADATA answer: header and a meta map ``{id, models: [...]}``."""
    meta = {"id": request_id, "models": [m.to_wire() for m in models]}
    return [_METADATA, pack(meta)]


def parse_metadata_reply(meta: dict[str, Any]) -> tuple[int | None, tuple[ModelMetadata, ...]]:
    """The request id and the models of a METADATA answer's meta.

    Raises:
        ProtocolError: the answer is malformed.
    """
    models = meta.get("models")
    if not isinstance(models, list):
        raise ProtocolError("metadata reply: models must be a list")
    return request_id_of(meta), tuple(ModelMetadata.from_wire(m) for m in models)
