"""from_worker.py: what a worker says to the broker, one typed union decoded in one place — pure.

:func:`decode_from_worker` turns a worker's message (its frames after the routing id)
into one of :data:`FromWorker`: READY, RESULT (its meta, and its reply frames as the
objects that arrived: never read or copied), FAILED, HEARTBEAT, DISCONNECT, or
:class:`WorkerMalformed` for a message that breaks the protocol (with its command when
the header was readable, so that the broker can tell a stranger's late RESULT from a
registered worker's broken one). Each message's ``to_frames`` is its one encoder. A
worker in the broker's own process hands the broker these objects, with no frames in
between (:func:`checked_from_worker` makes the one check of a decoder that a RESULT's type does not
guarantee).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ProtocolError
from carpool.common.protocol.frames import Command, Frame, decode_meta, encode, parse_header
from carpool.common.protocol.ready import Ready
from carpool.common.protocol.telemetry import Telemetry
from carpool.common.protocol.worker_messages import FailedMeta, ResultMeta, result_frames


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """READY: a worker announces itself and what it serves."""

    ready: Ready

    def to_frames(self) -> list[Any]:
        return encode(Command.READY, self.ready.to_wire())


@dataclass(slots=True)
class WorkerResult:
    """RESULT: a finished batch; ``replies`` are the reply frames, as they arrived. (Not
    frozen, for speed: docs/benchmarks.md "Why the hot path looks as it does".)"""

    result: ResultMeta
    replies: Sequence[Frame]

    def to_frames(self) -> list[Any]:
        return result_frames(self.result.to_wire(), self.replies)


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """FAILED: a batch the worker could not run."""

    failed: FailedMeta

    def to_frames(self) -> list[Any]:
        return encode(Command.FAILED, self.failed.to_wire())


@dataclass(frozen=True, slots=True)
class WorkerHeartbeat:
    """HEARTBEAT; ``rho``: the worker's load in 0..1, None when it sent none (or one out
    of range). ``busy_ms``: how long the worker's inference thread has been running its
    current batch (0: idle), None when it sent none (or an invalid one): a worker that
    does not report it is taken for healthy (docs/protocol.md §10.6)."""

    rho: float | None
    busy_ms: int | None = None
    # The worker's host and device, when it took a sample for this message (§8.2).
    telemetry: Telemetry | None = None

    def to_frames(self) -> list[Any]:
        meta: dict[str, Any] = {}
        if self.rho is not None:
            meta["rho"] = round(self.rho, 4)
        if self.busy_ms is not None:
            meta["busy_ms"] = self.busy_ms
        if self.telemetry is not None:
            meta["telemetry"] = self.telemetry.to_wire()
        return encode(Command.HEARTBEAT, meta)


@dataclass(frozen=True, slots=True)
class WorkerDisconnect:
    """DISCONNECT: the worker is leaving; ``reason``, for the broker's log."""

    reason: str = ""

    def to_frames(self) -> list[Any]:
        return encode(Command.DISCONNECT, {"reason": self.reason})


@dataclass(frozen=True, slots=True)
class WorkerMalformed:
    """A message that breaks the protocol: ``error`` says how. ``command``: its header's,
    where the broker asks first whether the sender is registered (a stranger's broken
    RESULT is a late one, answered as any stranger's message); None: broken whoever sent
    it (an unreadable header or meta, a malformed READY, an object RESULT)."""

    command: Command | None
    error: str


#: What a worker sends (each has its ``to_frames``).
ToBroker = WorkerReady | WorkerResult | WorkerFailed | WorkerHeartbeat | WorkerDisconnect
#: What the broker receives from a worker.
FromWorker = ToBroker | WorkerMalformed

_HEARTBEAT = WorkerHeartbeat(None)


def checked_from_worker(msg: FromWorker) -> FromWorker:
    """A message built in this process (an embedded worker's), with the one check of
    :func:`decode_from_worker` that its type does not guarantee."""
    if type(msg) is WorkerResult and any(k < 1 for k in msg.result.frames):
        return WorkerMalformed(None, "result: frames must be a list of ints >= 1")
    return msg


def decode_from_worker(frames: Sequence[Any]) -> FromWorker:
    """The typed message of a worker's frames (after the routing id, as a socket gives
    them). Never raises: a message that breaks the protocol is a :class:`WorkerMalformed`."""
    if len(frames) < 2:
        return WorkerMalformed(None, "worker messages have a header and a meta frame")
    try:
        command = parse_header(memoryview(frames[0]))
        meta = decode_meta(memoryview(frames[1]))
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
            busy_ms = meta.get("busy_ms")
            if not (isinstance(busy_ms, int) and not isinstance(busy_ms, bool) and busy_ms >= 0):
                busy_ms = None
            telemetry = Telemetry.from_wire(meta.get("telemetry"))
            if isinstance(rho, (int, float)) and not isinstance(rho, bool) and 0 <= rho <= 1:
                return WorkerHeartbeat(float(rho), busy_ms, telemetry)
            if busy_ms is None and telemetry is None:
                return _HEARTBEAT
            return WorkerHeartbeat(None, busy_ms, telemetry)
        if command is Command.FAILED:
            return WorkerFailed(FailedMeta.from_wire(meta))
        if command is Command.DISCONNECT:
            reason = meta.get("reason", "")
            return WorkerDisconnect(reason if isinstance(reason, str) else "")
    except ProtocolError as exc:
        return WorkerMalformed(command, str(exc))
    return WorkerMalformed(command, f"command {command.name} is not valid from a worker")
