"""from_broker.py: what the broker says to a worker, one typed union decoded in one place — pure.

:func:`decode_from_broker` turns the broker's message (its frames, as the worker's
socket gives them) into one of :data:`FromBroker`: BATCH (its meta, and the payload
frames as the objects that arrived: never read or copied), HEARTBEAT, DISCONNECT, or
:class:`BrokerMalformed` for a message that breaks the protocol (with the batch's id
where a BATCH's meta is readable, so that the worker can answer it FAILED and the
broker gets its credit back). Each message's ``to_frames`` is its one encoder. A worker
in the broker's own process is handed these objects, with no frames in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ProtocolError
from carpool.common.protocol.frames import (
    Command,
    Frame,
    decode_meta,
    encode,
    header,
    parse_header,
    view,
)
from carpool.common.protocol.worker_messages import BatchInputCache, BatchMeta

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
