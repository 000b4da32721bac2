"""replies.py: what the broker core sends, and its typed error replies.

Pure: the core's events return lists of :data:`Outgoing`: :class:`ToClient` (a client's
id and the frames for it) or :class:`ToWorker` (a worker's id and a typed message, which
its transport encodes, or hands as is to a worker in this process); the server sends
them. Error replies are counted in the stats: each function here takes them, except
:func:`request_error`, which notes its reply in a part's
:class:`~carpool.broker.stats.Notes` for the core to count. The callers give OVERLOADED's
retry hint and say which UNAVAILABLE carries ``retry`` (one for a request that did not
run, from the moment the broker is told to stop: protocol.md §6.3, §11).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    HEARTBEAT_TO_WORKER,
    MAX_TIMEOUT_MS,
    BrokerDisconnect,
    Command,
    ErrorReply,
    Frame,
    FromBroker,
    Request,
    decode_meta,
    encode_error,
    is_simple_form,
    parse_header,
    request_id_of,
    view,
)

if TYPE_CHECKING:
    from carpool.broker.requests import ClientId, PendingRequest, WorkerId
    from carpool.broker.stats import BrokerStats, Notes

logger = logging.getLogger(__name__)


class Side(Enum):
    FRONTEND = "frontend"  # clients
    BACKEND = "backend"  # workers


class WorkerBound(Protocol):
    """A message for a worker, in the two forms its transports need."""

    def to_frames(self) -> list[Any]:
        """Its frames, for a socket (its message's one encoder)."""
        ...

    def to_message(self) -> FromBroker:
        """The typed message, for a worker in the broker's process."""
        ...


@dataclass(slots=True)
class ToClient:
    """Frames to send to the client ``identity``. Not frozen, for speed:
    docs/benchmarks.md "Why the hot path looks as it does"."""

    side: ClassVar[Side] = Side.FRONTEND
    identity: bytes
    frames: Sequence[Any]


@dataclass(slots=True)
class ToWorker:
    """A message to send to the worker ``identity``."""

    side: ClassVar[Side] = Side.BACKEND
    identity: bytes
    message: WorkerBound


Outgoing = ToClient | ToWorker


@dataclass(frozen=True, slots=True)
class Refused:
    """A request not let in: answered with an error now (:func:`refusal`)."""

    code: ErrorCode
    message: str
    retry_after_ms: int | None = None
    # It counts as an arrival of the model's traffic (it was refused for the queue or
    # its deadline, not for the broker stopping or a batch it can never fit).
    arrival: bool = True
    shed: bool = False  # refused as hopeless (counted with the requests shed)
    retry: bool = False  # the broker is stopping: the request may be sent again (§6.3)
    # Counted among its model's refusals (STATS): the door's verdicts, not the checks
    # against a model (whose name may be any a client chose).
    counted: bool = True
    # Its model is expected back (just after a start): the request waits at the door if
    # the holding area takes it, else this is its answer.
    hold: bool = False


def retry_after_ms(drain_s: float) -> int:
    """OVERLOADED's hint: the queue's drain time, in 1 ms..MAX_TIMEOUT_MS (a fitted cost
    can be anything a worker reported; the hint must stay a small integer)."""
    if not math.isfinite(drain_s):
        return MAX_TIMEOUT_MS
    return min(MAX_TIMEOUT_MS, max(1, round(1000 * drain_s)))


def disconnect(wid: WorkerId, reason: str) -> ToWorker:
    """Tell a worker to go (MDP's DISCONNECT)."""
    return ToWorker(wid, BrokerDisconnect(reason))


def heartbeat(wid: WorkerId) -> ToWorker:
    """The broker's HEARTBEAT to a worker."""
    return ToWorker(wid, HEARTBEAT_TO_WORKER)


def to_client(client: ClientId, delimited: bool, frames: Sequence[Any]) -> ToClient:
    """A reply to ``client``, after an empty delimiter frame when its message had one."""
    return ToClient(client, [b"", *frames] if delimited else list(frames))


def error(
    stats: BrokerStats,
    client: ClientId,
    delimited: bool,
    request_id: int | None,
    code: ErrorCode,
    message: str,
    *,
    simple: bool = False,
    retry_after_ms: int | None = None,
    retry: bool = False,
) -> ToClient:
    """An error reply, counted in ``stats`` (STATS ``errors``)."""
    stats.errors[code.name] += 1
    return _error(client, delimited, request_id, code, message, simple, retry_after_ms, retry)


def _error(
    client: ClientId,
    delimited: bool,
    request_id: int | None,
    code: ErrorCode,
    message: str,
    simple: bool,
    retry_after_ms: int | None,
    retry: bool,
) -> ToClient:
    logger.debug("error id=%s code=%s: %s", request_id, code.name, message)
    reply = ErrorReply(request_id, code, message, retry_after_ms, retry)
    return to_client(client, delimited, encode_error(reply, simple=simple))


def internal_error(
    stats: BrokerStats, client: ClientId, frames: Sequence[Frame]
) -> ToClient | None:
    """INTERNAL, in the form of the client message ``frames`` (framed or simple, after
    an empty delimiter or not), naming its id when it can be read: the answer to a
    message whose handling raised inside the core before it changed any state
    (``BrokerCore.on_fault``). None for a CANCEL, which is never answered (its id is the
    cancelled request's, whose own answer is still to come)."""
    delimited = simple = False
    rid: int | None = None
    # Each step may fail on the message that made the core fail (the decoder's own fault
    # too): what could be read is answered, from the header and the meta alone.
    with contextlib.suppress(Exception):
        delimited = len(frames) > 1 and len(frames[0]) == 0
        if delimited:
            frames = frames[1:]
        simple = len(frames) == 1 and is_simple_form(view(frames[0]))
        if simple:
            rid = request_id_of(decode_meta(view(frames[0])))
        elif len(frames) > 1:
            if parse_header(view(frames[0])) is Command.CANCEL:
                return None
            rid = request_id_of(decode_meta(view(frames[1])))
    message = (
        "the broker failed to handle the message (a bug of the broker's, logged); it "
        "changed nothing there, and may be sent again"
    )
    return error(stats, client, delimited, rid, ErrorCode.INTERNAL, message, simple=simple)


def refusal(
    stats: BrokerStats, client: ClientId, request: Request[Any], refused: Refused
) -> ToClient:
    """The error answer of a request the door refused, counted in ``stats``."""
    if refused.counted:
        stats.refused(request.model, refused.code.name, refused.shed)
    return error(
        stats,
        client,
        request.delimited,
        request.request_id,
        refused.code,
        refused.message,
        simple=request.simple,
        retry_after_ms=refused.retry_after_ms,
        retry=refused.retry,
    )


def request_error(
    notes: Notes,
    req: PendingRequest,
    code: ErrorCode,
    message: str,
    *,
    retry: bool = False,
    hint: int | None = None,
) -> ToClient:
    """The error answer of a request the broker held, noted in ``notes`` (the core
    counts it, per model, in the stats); ``hint``: its ``retry_after_ms``."""
    notes.failed.append((req.model, code.name))
    rid = req.request_id
    return _error(req.client, req.delimited, rid, code, message, req.simple, hint, retry)
