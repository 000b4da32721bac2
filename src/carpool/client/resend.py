"""resend.py: Resender — what a client keeps of each request until its answer, to send it
again, and the CANCELs it still has to send.

Pure: no sockets, threads or clock (``now`` is passed in). Each
:class:`~carpool.client.core.ClientCore` holds one; the twins only move the messages
that :meth:`Resender.outgoing` gives them, when the socket takes them.

**Sending again** (protocol §6.1, §11). A client draws a 128-bit nonce once, and each of
its requests carries it, so a broker that still holds a request sent again (same nonce
and id) answers it once. A request is sent again, with its id, nonce and frames as first
made and ``timeout_ms`` = what remains of its budget (its timeout, counted from submit),

* after the connection it went by is lost and the socket opened afresh, or
* after the broker refused it ``UNAVAILABLE`` with ``retry`` (it is stopping, §6.3): not
  on that connection, which the stopping broker would refuse again, but once that
  connection is lost and the socket reopened,

and only while what remains of its budget exceeds the latency the client has seen for
its model (:meth:`Resender.needed_s`). A request whose budget is smaller than that is
failed at once: ``UNAVAILABLE``, the lost connection's, or the broker's own answer when it
was refused. One waiting to be sent again is failed the same way when its budget gets
that small, so none is sent after its deadline.

**Cancelling** (§6.5). A request on the current connection gets a CANCEL, and keeps
waiting for its one answer (``CANCELLED``, or its result if it had reached a worker); one
waiting to be sent again is not at any broker, and is answered ``CANCELLED`` here at once,
as is a cancelled request whose connection is lost before the answer.

A kept request is in one of three stages (it leaves the table when answered or failed):

=======  ====================================  =========================================
stage    where it is                           next
SENT     sent on the current connection        PARKED (refused with ``retry``), QUEUED
                                               (the connection is lost)
PARKED   refused with ``retry``, not yet sent  QUEUED (the connection is lost)
QUEUED   waiting for the socket to take it     SENT (taken), QUEUED (lost again)
=======  ====================================  =========================================
"""

from __future__ import annotations

import heapq
import math
import os
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from carpool.common.errors import Cancelled, RequestError, Unavailable
from carpool.common.protocol import CLIENT_NONCE_BYTES, Cancel, request_frames

#: The latency assumed for a model before any of its requests was answered: a request
#: with less budget than this is not sent again (a broker that has just started answers
#: a request it holds 50 ms before its deadline, protocol §11.1).
UNKNOWN_LATENCY_S = 0.05
#: Weight of the newest sample in a model's latency average.
LATENCY_WEIGHT = 0.2
#: Models whose latency a client remembers (others count as unknown).
_MAX_MODELS = 256
LOST = "the connection to the broker closed before the reply; the request may have run"


class Stage(Enum):
    SENT = "sent"
    PARKED = "parked"
    QUEUED = "queued"


class Event(Enum):
    REFUSED = "refused"  # UNAVAILABLE with retry
    LOST = "lost"  # the connection closed (and the socket was reopened)
    TAKEN = "taken"  # the socket took it


#: The stage table (module docstring): (stage, event) -> next stage.
NEXT_STAGE: dict[tuple[Stage, Event], Stage] = {
    (Stage.SENT, Event.REFUSED): Stage.PARKED,
    (Stage.SENT, Event.LOST): Stage.QUEUED,
    (Stage.PARKED, Event.LOST): Stage.QUEUED,
    (Stage.QUEUED, Event.LOST): Stage.QUEUED,
    (Stage.QUEUED, Event.TAKEN): Stage.SENT,
}


@dataclass(slots=True)
class Kept:
    """What a request needs to be sent again, and where it stands."""

    model: str
    meta: dict[str, Any]  # its REQUEST meta (``timeout_ms`` rewritten when sent again)
    payloads: list[Any]  # its payload frames: never the caller's memory
    submit_s: float
    budget_end_s: float  # submit + timeout: never sent again from then on
    stage: Stage = Stage.SENT
    give_up_s: float = math.inf  # PARKED or QUEUED: failed then if not sent
    refusal: RequestError | None = None  # the broker's UNAVAILABLE with retry
    cancelling: bool = False  # a CANCEL was asked for
    resent: bool = False  # sent more than once: its latency is not a sample

    def move(self, event: Event) -> None:
        self.stage = NEXT_STAGE[self.stage, event]  # (a KeyError: a transition the table lacks)


@dataclass(slots=True)
class Resender:
    """The kept requests of one client, its nonce, and its latency per model."""

    nonce: bytes = field(default_factory=lambda: os.urandom(CLIENT_NONCE_BYTES))
    kept: dict[int, Kept] = field(default_factory=dict)
    #: Seconds from submit to answer, per model: an exponentially weighted average.
    latency_s: dict[str, float] = field(default_factory=dict)
    #: Requests sent again, and CANCELs sent.
    resends: int = 0
    cancels: int = 0
    # Messages for the socket, in order: (request id, True for its CANCEL, False for the
    # request itself). An entry whose request moved on meanwhile is skipped.
    _outbox: deque[tuple[int, bool]] = field(default_factory=deque)
    _give_ups: list[tuple[float, int]] = field(default_factory=list)

    def keep(
        self, rid: int, model: str, meta: dict[str, Any], payloads: list[Any], now: float
    ) -> None:
        """Keep request ``rid`` (just sent) until :meth:`pop`; ``meta["timeout_ms"]`` is
        its budget."""
        budget_end_s = now + meta["timeout_ms"] / 1000.0
        self.kept[rid] = Kept(model, meta, payloads, now, budget_end_s)

    def pop(self, rid: int, now: float | None = None) -> None:
        """Let go of request ``rid`` (answered, failed or forgotten); ``now``: when it was
        answered with its outputs, a sample of its model's latency."""
        kept = self.kept.pop(rid, None)
        if kept is None or now is None or kept.resent:
            return
        sample_s = now - kept.submit_s
        average_s = self.latency_s.get(kept.model)
        if average_s is not None:
            self.latency_s[kept.model] = average_s + LATENCY_WEIGHT * (sample_s - average_s)
        elif len(self.latency_s) < _MAX_MODELS:
            self.latency_s[kept.model] = sample_s

    def expired(self, rid: int) -> RequestError | None:
        """Request ``rid`` reached its local deadline (the client was busy past its
        give-up): let go of it; its answer if it was waiting to be sent again (None:
        it was at a broker, which did not answer)."""
        kept = self.kept.pop(rid, None)
        if kept is None or kept.stage is Stage.SENT:
            return None
        return self._answer(rid, kept)

    def needed_s(self, model: str) -> float:
        """The budget a request for ``model`` must have left to be sent again: the latency
        seen for the model (:data:`UNKNOWN_LATENCY_S` before any)."""
        return self.latency_s.get(model, UNKNOWN_LATENCY_S)

    def refused(self, rid: int, error: RequestError, now: float | None) -> bool:
        """The broker answered request ``rid`` UNAVAILABLE with ``retry``: True when it is
        kept to be sent on the next connection (False: ``error`` is its answer)."""
        kept = self.kept.get(rid)
        if kept is None or kept.stage is not Stage.SENT or kept.cancelling:
            return False
        give_up_s = kept.budget_end_s - self.needed_s(kept.model)
        if now is not None and now >= give_up_s:
            return False
        kept.move(Event.REFUSED)
        kept.refusal = error
        self._wait(rid, kept, give_up_s)
        return True

    def lost(self, now: float) -> list[tuple[int, RequestError]]:
        """The connection closed and the socket was reopened: each request not yet
        answered is queued to be sent again, or, with too little budget (or cancelled),
        returned with its answer."""
        failed: list[tuple[int, RequestError]] = []
        for rid, kept in list(self.kept.items()):
            if kept.stage is Stage.QUEUED:
                kept.move(Event.LOST)  # (it waits for the socket still: its give-up stands)
                continue
            give_up_s = kept.budget_end_s - self.needed_s(kept.model)
            if kept.cancelling or now >= give_up_s:
                del self.kept[rid]
                failed.append((rid, self._answer(rid, kept)))
                continue
            kept.move(Event.LOST)
            self._wait(rid, kept, give_up_s)
            self._outbox.append((rid, False))
        return failed

    def cancel(self, rid: int) -> RequestError | None:
        """Cancel request ``rid``: its CANCEL is queued (None), or, not at any broker (or
        unknown here), its answer is returned now (``Cancelled``; None if unknown)."""
        kept = self.kept.get(rid)
        if kept is None or kept.cancelling:
            return None
        if kept.stage is not Stage.SENT:
            del self.kept[rid]
            return Cancelled("cancelled before it was sent again", request_id=rid)
        kept.cancelling = True
        self._outbox.append((rid, True))
        return None

    @property
    def has_outgoing(self) -> bool:
        return bool(self._outbox)

    def outgoing(self, now: float) -> list[Any] | None:
        """The frames of the next message for the socket (a request sent again, with
        ``timeout_ms`` what remains of its budget now, or a CANCEL); None: none waits.
        Call :meth:`took` once the socket has taken them."""
        outbox = self._outbox
        while outbox:
            rid, cancel = outbox[0]
            kept = self.kept.get(rid)
            if kept is not None:
                if cancel and kept.stage is Stage.SENT:
                    return Cancel(rid, self.nonce).to_frames()
                if not cancel and kept.stage is Stage.QUEUED and now < kept.give_up_s:
                    left_ms = (kept.budget_end_s - now) * 1000
                    kept.meta["timeout_ms"] = max(1, math.floor(left_ms + 1e-6))
                    return request_frames(kept.meta, kept.payloads)
            outbox.popleft()  # answered, cancelled, or past its give-up (expire fails it)
        return None

    def took(self) -> None:
        """The socket took the message :meth:`outgoing` returned last."""
        rid, cancel = self._outbox.popleft()
        if cancel:
            self.cancels += 1
            return
        kept = self.kept[rid]
        kept.move(Event.TAKEN)
        kept.give_up_s = math.inf
        kept.resent = True
        self.resends += 1

    def expire(self, now: float) -> list[tuple[int, RequestError]]:
        """Requests waiting to be sent again whose budget got too small: their answers."""
        out: list[tuple[int, RequestError]] = []
        heap = self._give_ups
        while heap and heap[0][0] <= now:
            give_up_s, rid = heapq.heappop(heap)
            kept = self.kept.get(rid)
            if kept is not None and kept.stage is not Stage.SENT and kept.give_up_s == give_up_s:
                del self.kept[rid]
                out.append((rid, self._answer(rid, kept)))
        return out

    def next_give_up(self) -> float | None:
        """When :meth:`expire` next has something to do (None: nothing waits)."""
        heap = self._give_ups
        while heap:
            give_up_s, rid = heap[0]
            kept = self.kept.get(rid)
            if kept is not None and kept.stage is not Stage.SENT and kept.give_up_s == give_up_s:
                return give_up_s
            heapq.heappop(heap)
        return None

    def _wait(self, rid: int, kept: Kept, give_up_s: float) -> None:
        if kept.give_up_s != give_up_s:
            kept.give_up_s = give_up_s
            heapq.heappush(self._give_ups, (give_up_s, rid))

    @staticmethod
    def _answer(rid: int, kept: Kept) -> RequestError:
        """The answer of a kept request that will not be sent again."""
        if kept.cancelling:
            return Cancelled("cancelled; the connection closed before its answer", request_id=rid)
        return kept.refusal if kept.refusal is not None else Unavailable(LOST, request_id=rid)
