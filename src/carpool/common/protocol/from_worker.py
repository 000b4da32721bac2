"""from_worker.py: what a worker says to the broker, one typed union decoded in one place — pure.

:func:`decode_from_worker` turns a worker's message (its frames after the routing id)
into one of :data:`FromWorker`: READY, RESULT (:class:`ResultMeta`, and its reply frames
as the objects that arrived: never read or copied), FAILED (:class:`FailedMeta`),
HEARTBEAT, DISCONNECT, or
:class:`WorkerMalformed` for a message that breaks the protocol (with its command when
the header was readable, so that the broker can tell a stranger's late RESULT from a
registered worker's broken one). Each message's ``to_frames`` is its one encoder. A
worker in the broker's own process hands the broker these objects, with no frames in
between (:func:`checked_from_worker` makes the one check of a decoder that a RESULT's type does not
guarantee).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol.client_messages import ErrorReply
from carpool.common.protocol.frames import (
    Command,
    Frame,
    decode_meta,
    encode,
    header,
    optional_number,
    pack,
    parse_header,
    require_field,
)
from carpool.common.protocol.ready import Ready
from carpool.common.protocol.telemetry import Telemetry

#: The RESULT header frame, built once.
_RESULT = header(Command.RESULT)
#: The commands a worker sends, as globals.
# speed: docs/benchmarks.md "Why the hot path looks as it does"
_READY, _RESULTS, _FAILED, _HEARTBEAT_, _DISCONNECT = (
    Command.READY,
    Command.RESULT,
    Command.FAILED,
    Command.HEARTBEAT,
    Command.DISCONNECT,
)
#: The header frames of the commands a worker sends, to their command: one lookup.
_HEADERS = {header(c): c for c in (_READY, _RESULTS, _FAILED, _HEARTBEAT_, _DISCONNECT)}


@dataclass(slots=True)
class ResultMeta:
    """RESULT meta: a finished batch. ``frames[i]`` frames of replies follow per request."""

    batch_id: int
    rho: float
    compute_ms: float
    frames: tuple[int, ...]
    # A batch padded into a bucket (§8.4): (elements padding added, elements of the
    # bucket-shaped inputs), over the padded inputs; None for a model without pad rules.
    padding: tuple[int, int] | None = None
    # The worker's host and device, when it took a sample for this message (§8.2).
    telemetry: Telemetry | None = None
    # The worker's CPU for the batch outside compute_ms's time (§8.4); 0: not measured.
    cpu_ms: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return result_wire(
            self.batch_id,
            self.rho,
            self.compute_ms,
            self.frames,
            self.padding,
            self.telemetry,
            self.cpu_ms,
        )

    @classmethod
    def from_wire(cls, meta: dict[str, Any]) -> ResultMeta:
        """A RESULT meta checked, its checks inlined for speed (docs/benchmarks.md; the rules of
        :func:`~carpool.common.protocol.frames.require_field` and
        :func:`~carpool.common.protocol.frames.optional_number`)."""
        batch_id = meta.get("batch")
        if type(batch_id) is not int:
            batch_id = require_field(meta, "batch", int, "result")
        frames = meta.get("frames")
        if not isinstance(frames, list):
            raise ProtocolError("result: frames must be a list of ints >= 1")
        for k in frames:
            if type(k) is not int or k < 1:
                raise ProtocolError("result: frames must be a list of ints >= 1")
        padding = meta.get("padding")
        if padding is not None:
            if not (
                type(padding) is list
                and len(padding) == 2
                and all(type(k) is int for k in padding)
                and 0 <= padding[0] <= padding[1]
            ):
                raise ProtocolError("result: padding must be [padded, bucket] elements")
            padding = (padding[0], padding[1])
        rho = meta.get("rho", 0.0)
        if type(rho) is not float or not math.isfinite(rho):
            rho = optional_number(meta, "rho")
        compute_ms = meta.get("compute_ms", 0.0)
        if type(compute_ms) is not float or not math.isfinite(compute_ms):
            compute_ms = optional_number(meta, "compute_ms")
        cpu_ms = meta.get("cpu_ms", 0.0)
        if type(cpu_ms) is not float or not math.isfinite(cpu_ms):
            cpu_ms = optional_number(meta, "cpu_ms")
        telemetry = meta.get("telemetry")
        if telemetry is not None:
            telemetry = Telemetry.from_wire(telemetry)
        return cls(batch_id, rho, compute_ms, tuple(frames), padding, telemetry, cpu_ms)


def result_wire(
    batch_id: int,
    rho: float,
    compute_ms: float,
    frames: Iterable[int],
    padding: tuple[int, int] | None = None,
    telemetry: Telemetry | None = None,
    cpu_ms: float = 0.0,
) -> dict[str, Any]:
    """A RESULT meta from its fields: ``frames[i]``, the frame count of request i's reply;
    ``padding``: a padded batch's (padded, bucket) elements; ``telemetry``: a sample of
    the worker's host and device (§8.2); ``cpu_ms``: the worker's CPU for the batch (left
    off at 0: not measured)."""
    wire: dict[str, Any] = {
        "batch": batch_id,
        "rho": round(rho, 4),
        "compute_ms": round(compute_ms, 3),
        "frames": list(frames),
    }
    if padding is not None:
        wire["padding"] = list(padding)
    if telemetry is not None:
        wire["telemetry"] = telemetry.to_wire()
    if cpu_ms > 0:
        wire["cpu_ms"] = round(cpu_ms, 3)
    return wire


def result_frames(meta: dict[str, Any], replies: Sequence[object]) -> list[Any]:
    """Frames of a RESULT whose meta :func:`result_wire` built, then the replies' frames."""
    return [_RESULT, pack(meta), *replies]


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
        # speed: docs/benchmarks.md "Why the hot path looks as it does"
        command = _HEADERS.get(bytes(frames[0]))  # (a v1 header of a worker's command)
        if command is None:
            command = parse_header(memoryview(frames[0]))
        meta = decode_meta(frames[1])
    except ProtocolError as exc:
        return WorkerMalformed(None, str(exc))
    if command is _RESULTS:
        try:
            return WorkerResult(ResultMeta.from_wire(meta), frames[2:])
        except ProtocolError as exc:
            return WorkerMalformed(command, str(exc))
    if command is _READY:
        try:
            return WorkerReady(Ready.from_wire(meta))
        except ProtocolError as exc:
            return WorkerMalformed(None, str(exc))
    try:
        if command is _HEARTBEAT_:
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
        if command is _FAILED:
            return WorkerFailed(FailedMeta.from_wire(meta))
        if command is _DISCONNECT:
            reason = meta.get("reason", "")
            return WorkerDisconnect(reason if isinstance(reason, str) else "")
    except ProtocolError as exc:
        return WorkerMalformed(command, str(exc))
    return WorkerMalformed(command, f"command {command.name} is not valid from a worker")
