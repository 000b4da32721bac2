"""from_worker.py: what a worker says to the broker, one typed union decoded in one place — pure.

:func:`decode_from_worker` turns a worker's message (its frames after the routing id)
into one of :data:`FromWorker`: READY, RESULT (its meta, and its reply frames as the
objects that arrived: never read or copied), FAILED, HEARTBEAT, DISCONNECT, or
:class:`WorkerMalformed` for a message that breaks the protocol (with its command when
the header was readable, so that the broker can tell a stranger's late RESULT from a
registered worker's broken one). A RESULT that an embedded worker built in the broker's
process carries its :class:`ResultMeta` object in place of the meta frame; it is taken as
is, with the one check its decoder makes that the object does not guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ProtocolError
from carpool.common.protocol.frames import Command, Frame, decode_meta, parse_header, view
from carpool.common.protocol.worker_messages import FailedMeta, Ready, ResultMeta


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """READY: a worker announces itself and what it serves."""

    ready: Ready


@dataclass(slots=True)
class WorkerResult:
    """RESULT: a finished batch; ``replies`` are the reply frames, as they arrived. (Not
    frozen, as ResultMeta: one is made per batch on the hot path.)"""

    result: ResultMeta
    replies: Sequence[Frame]


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """FAILED: a batch the worker could not run."""

    failed: FailedMeta


@dataclass(frozen=True, slots=True)
class WorkerHeartbeat:
    """HEARTBEAT; ``rho``: the worker's load in 0..1, None when it sent none (or one out
    of range)."""

    rho: float | None


@dataclass(frozen=True, slots=True)
class WorkerDisconnect:
    """DISCONNECT: the worker is leaving."""


@dataclass(frozen=True, slots=True)
class WorkerMalformed:
    """A message that breaks the protocol: ``error`` says how. ``command``: its header's,
    where the broker asks first whether the sender is registered (a stranger's broken
    RESULT is a late one, answered as any stranger's message); None: broken whoever sent
    it (an unreadable header or meta, a malformed READY, an object RESULT)."""

    command: Command | None
    error: str


FromWorker = (
    WorkerReady | WorkerResult | WorkerFailed | WorkerHeartbeat | WorkerDisconnect | WorkerMalformed
)

_HEARTBEAT, _DISCONNECT = WorkerHeartbeat(None), WorkerDisconnect()


def decode_from_worker(frames: Sequence[Any]) -> FromWorker:
    """The typed message of a worker's frames (after the routing id: frames as a socket
    gives them, or an embedded worker's list with its ResultMeta object). Never raises: a
    message that breaks the protocol is a :class:`WorkerMalformed`."""
    if len(frames) < 2:
        return WorkerMalformed(None, "worker messages have a header and a meta frame")
    second: object = frames[1]
    if type(second) is ResultMeta:  # built in this process (an embedded worker's)
        if any(k < 1 for k in second.frames):
            return WorkerMalformed(None, "result: frames must be a list of ints >= 1")
        return WorkerResult(second, frames[2:])
    try:
        command = parse_header(view(frames[0]))
        meta = decode_meta(view(frames[1]))
    except ProtocolError as exc:
        return WorkerMalformed(None, str(exc))
    if command is Command.READY:
        try:
            return WorkerReady(Ready.from_wire(meta))
        except ProtocolError as exc:
            return WorkerMalformed(None, str(exc))
    try:
        if command is Command.RESULT:
            return WorkerResult(ResultMeta.from_wire(meta), frames[2:])
        if command is Command.HEARTBEAT:
            rho = meta.get("rho")
            if isinstance(rho, (int, float)) and not isinstance(rho, bool) and 0 <= rho <= 1:
                return WorkerHeartbeat(float(rho))
            return _HEARTBEAT
        if command is Command.FAILED:
            return WorkerFailed(FailedMeta.from_wire(meta))
        if command is Command.DISCONNECT:
            return _DISCONNECT
    except ProtocolError as exc:
        return WorkerMalformed(command, str(exc))
    return WorkerMalformed(command, f"command {command.name} is not valid from a worker")
