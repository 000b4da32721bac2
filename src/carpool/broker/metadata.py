"""metadata.py: the broker's answer to METADATA (§6.6) — pure.

From the live workers' READY: each model's spec (the one its live workers share, with
the union of their limits: the largest ``max_batch`` any of them takes, the loosest
shape rules, broker/limits.py), the names of the workers that serve it, and each one's
own limits.
Models no live worker serves are left out (a client could not use them); a request for
one by name is answered NOT_FOUND, as one for a name the broker never heard of.
"""

from __future__ import annotations

import dataclasses

from carpool.broker.limits import hull
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import ToClient, error, to_client
from carpool.broker.requests import ClientId
from carpool.broker.stats import BrokerStats
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    MetadataRequest,
    ModelMetadata,
    WorkerLimits,
    metadata_reply_frames,
)

__all__ = ["answer", "describe"]


def _model(registry: WorkerRegistry, name: str) -> ModelMetadata | None:
    workers = registry.serving(name)
    spec = registry.specs.get(name)
    if not workers or spec is None:
        return None
    own = [w.models[name] for w in workers]
    spec = dataclasses.replace(
        spec,
        max_batch=registry.max_batch(name),
        preferred_batch=tuple(sorted({p for s in own for p in s.preferred_batch})),
        rules=hull(own),
    )
    limits = sorted(
        {
            WorkerLimits(w.name, s.max_batch, s.preferred_batch, s.rules)
            for w, s in zip(workers, own, strict=True)
        },
        key=lambda w: (w.worker, w.max_batch, repr(w.rules)),
    )
    return ModelMetadata(spec, tuple(sorted({w.name for w in workers})), tuple(limits))


def describe(registry: WorkerRegistry, request: MetadataRequest) -> list[ModelMetadata] | None:
    """The models a METADATA request asks about, sorted by name; None when it names a
    model no live worker serves."""
    if request.model is not None:
        one = _model(registry, request.model)
        return None if one is None else [one]
    found = (_model(registry, name) for name in sorted(registry.specs))
    return [m for m in found if m is not None]


def answer(
    registry: WorkerRegistry, stats: BrokerStats, client: ClientId, request: MetadataRequest
) -> ToClient:
    """The one answer to a METADATA request: the models, or NOT_FOUND for a model no
    live worker serves."""
    delimited = request.delimited
    models = describe(registry, request)
    if models is None:
        msg = f"model {request.model!r} is not served by any worker"
        return error(stats, client, delimited, request.request_id, ErrorCode.NOT_FOUND, msg)
    return to_client(client, delimited, metadata_reply_frames(request.request_id, models))
