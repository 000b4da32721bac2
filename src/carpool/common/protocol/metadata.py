"""metadata.py: METADATA — what a client may learn of the models a broker serves — pure.

A client asks for one model by name, or for every model; the broker answers from its
live workers' READY (§6.6): each model's inputs and outputs (names, dtypes, shapes with
``-1`` for dynamic dims, shape rules, pad rules and buckets, crops), its batch limits,
and the names of the workers that serve it (never a routing id or an address). Modelled
on KServe v2's model metadata (``GET v2/models/<name>``), in this protocol's own types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common import codec
from carpool.common.errors import ProtocolError
from carpool.common.protocol.client_messages import request_id_of
from carpool.common.protocol.frames import Command, header, require_map, require_name
from carpool.common.protocol.ready import ModelSpec

__all__ = ["MetadataRequest", "ModelMetadata", "metadata_reply_frames", "parse_metadata_reply"]

_METADATA = header(Command.METADATA)


@dataclass(frozen=True, slots=True)
class MetadataRequest:
    """METADATA request meta: ``model`` names one model; None asks for all of them."""

    request_id: int | None = None
    model: str | None = None

    def to_wire(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self.request_id is not None:
            meta["id"] = self.request_id
        if self.model is not None:
            meta["model"] = self.model
        return meta

    def to_frames(self) -> list[Any]:
        return [_METADATA, codec.pack(self.to_wire())]

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> MetadataRequest:
        model = meta.get("model")
        if model is not None:
            model = require_name(model, "metadata model")
        return cls(request_id_of(meta), model)


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """One model as METADATA describes it: its spec (with the largest ``max_batch`` a
    live worker takes) and the names of the live workers that serve it, sorted."""

    spec: ModelSpec
    workers: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        wire = self.spec.to_wire()
        wire["workers"] = list(self.workers)
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> ModelMetadata:
        m = require_map(obj, "model metadata")
        workers = m.get("workers", [])
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
            raise ProtocolError("model metadata: workers must be a list of names")
        return cls(ModelSpec.from_wire(m), tuple(workers))


def metadata_reply_frames(request_id: int | None, models: Sequence[ModelMetadata]) -> list[Any]:
    """The frames of a METADATA answer: header and a meta map ``{id, models: [...]}``."""
    meta = {"id": request_id, "models": [m.to_wire() for m in models]}
    return [_METADATA, codec.pack(meta)]


def parse_metadata_reply(meta: dict[str, Any]) -> tuple[int | None, tuple[ModelMetadata, ...]]:
    """The request id and the models of a METADATA answer's meta.

    Raises:
        ProtocolError: the answer is malformed.
    """
    models = meta.get("models")
    if not isinstance(models, list):
        raise ProtocolError("metadata reply: models must be a list")
    return request_id_of(meta), tuple(ModelMetadata.from_wire(m) for m in models)
