"""resend.py: Resender — what a client keeps of each request until its answer, to send it
again, the CANCELs it still has to send, and which connection each request went by.

Pure: no sockets, threads or clock (``now`` is passed in). Each
:class:`~carpool.client.core.ClientCore` holds one; the twins only move the messages
that :meth:`Resender.outgoing` gives them, when the socket takes them, and open and close
sockets when it says so (:attr:`Resender.leaving`, :attr:`Resender.retiring`).

**Connections.** Each socket the client opens is a new connection, numbered
(:attr:`Resender.epoch`); each request sent remembers the connection it went by. A
broker told to stop answers a REQUEST ``UNAVAILABLE`` with ``retry`` (§6.3, §11). On the
first such answer on the current connection the client *leaves* it: it sends nothing
more on it (no new request, no resend, no CANCEL), opens a new socket to the endpoint at
once (the twins' ``Dealer.switch``, which queues only on a connection that is up; a
stopping broker holds new connections at the handshake until it closes, so the new one
reaches the broker that starts next, or another), and keeps the old one open for
reading only, as
the *retiring* connection: the stopping broker still answers each request sent on it
(a result of a batch that ends within its grace, or ``UNAVAILABLE`` with ``retry``, sent
again on the new connection), so none runs twice. The retiring connection is closed
once no request sent on it waits for an answer, or when it is lost (its requests then
go as a lost connection's do). At most one connection retires: leaving another drops
the retiring one, as if lost.

A connection opened by leaving one is *on trial* until it answers a request other than
with a ``retry`` refusal. A refusal on it does not make the client leave it (the request
waits, PARKED, for its close): a broker that admits new connections while it stops (one
that does not hold them at the handshake) would answer the new one as it did the old,
and leaving on each refusal would open a socket and send every request again each round
trip until it closed.

=============================  ================================================
connection event               what changes
a ``retry`` refusal on the     :attr:`~Resender.leaving`: the twin opens a new socket
current connection, not on     and retires this one (:meth:`~Resender.switched`),
trial                          before it sends anything more
switched                       the current connection retires (a retiring one is
                               dropped: LOST); the new one is current, on trial
an answer other than a         the current connection is no longer on trial
``retry`` refusal
the current connection lost    the socket is opened afresh: current, not on trial
the retiring one lost          its requests LOST; no connection retires
no request waits on the        no connection retires: the twin closes its socket
retiring one
=============================  ================================================

**Sending again** (protocol §6.1, §11). A client draws a 128-bit nonce once, and each of
its requests carries it, so a broker that still holds a request sent again (same nonce
and id) answers it once. A request is sent again on the current connection, with its id,
nonce and frames as first made and ``timeout_ms`` = what remains of its budget (its
timeout, counted from submit), after the connection it went by is lost (or dropped), or
after the broker refused it ``UNAVAILABLE`` with ``retry`` (once the connection on trial
that refused it is lost, or left), and only while what remains of its budget exceeds the
latency the client has seen for its model (:meth:`Resender.needed_s`). A request whose
budget is smaller than that is failed at once: ``UNAVAILABLE``, the lost connection's, or
the broker's own answer when it was refused. One waiting to be sent again is failed the
same way when its budget gets that small, so none is sent after its deadline.

**Cancelling** (§6.5). A request on the current connection gets a CANCEL, and keeps
waiting for its one answer (``CANCELLED``, or its result if it had reached a worker). One
on the retiring connection gets no CANCEL (nothing more is sent there), and waits for
the stopping broker's answer all the same. A cancelled request that a broker refuses with
``retry`` ran nowhere and is not sent again: it is answered ``CANCELLED`` here, as is one
whose connection is lost, and, at once, one waiting to be sent again (at no broker).

A kept request is in one of three stages (it leaves the table when answered or failed):

=======  =====================================  ========================================
stage    where it is                            next
SENT     sent on connection ``Kept.epoch``      QUEUED (refused with ``retry``; its
         (the current one, or the retiring      connection lost or dropped), PARKED
         one)                                   (refused on a connection on trial)
PARKED   refused on the connection on trial,    QUEUED (that connection lost, or left)
         not yet sent again
QUEUED   waiting for the current socket to      SENT (taken), QUEUED (lost again)
         take it
=======  =====================================  ========================================
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
    REFUSED = "refused"  # UNAVAILABLE with retry, on a connection the client leaves or left
    REFUSED_ON_TRIAL = "refused on trial"  # the same, on the connection on trial
    LOST = "lost"  # its connection closed, or was dropped
    LEFT = "left"  # the client left the connection that refused it
    TAKEN = "taken"  # the current socket took it


#: The stage table (module docstring): (stage, event) -> next stage.
NEXT_STAGE: dict[tuple[Stage, Event], Stage] = {
    (Stage.SENT, Event.REFUSED): Stage.QUEUED,
    (Stage.SENT, Event.REFUSED_ON_TRIAL): Stage.PARKED,
    (Stage.SENT, Event.LOST): Stage.QUEUED,
    (Stage.PARKED, Event.LOST): Stage.QUEUED,
    (Stage.PARKED, Event.LEFT): Stage.QUEUED,
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
    epoch: int  # SENT: the connection it went by
    stage: Stage = Stage.SENT
    give_up_s: float = math.inf  # PARKED or QUEUED: failed then if not sent
    refusal: RequestError | None = None  # the broker's UNAVAILABLE with retry
    cancelling: bool = False  # a CANCEL was asked for
    resent: bool = False  # sent more than once: its latency is not a sample

    def move(self, event: Event) -> None:
        self.stage = NEXT_STAGE[self.stage, event]  # (a KeyError: a transition the table lacks)


@dataclass(slots=True)
class Resender:
    """The kept requests of one client, its nonce, its latency per model, and its
    connections (module docstring)."""

    nonce: bytes = field(default_factory=lambda: os.urandom(CLIENT_NONCE_BYTES))
    kept: dict[int, Kept] = field(default_factory=dict)
    #: Seconds from submit to answer, per model: an exponentially weighted average.
    latency_s: dict[str, float] = field(default_factory=dict)
    #: Requests sent again, CANCELs sent, and connections left after a refusal.
    resends: int = 0
    cancels: int = 0
    switches: int = 0
    #: The current connection's number; the retiring one's (None: none retires).
    epoch: int = 0
    retiring: int | None = None
    #: The broker on the current connection refused a request with ``retry``: the twin
    #: opens a new socket and calls :meth:`switched` before it sends anything more.
    leaving: bool = False
    #: The current connection was opened by leaving one, and has answered no request
    #: yet other than with a ``retry`` refusal.
    on_trial: bool = False
    # Requests sent on the retiring connection and not answered yet (it closes at none).
    _on_retiring: set[int] = field(default_factory=set)
    # Messages for the socket, in order: (request id, True for its CANCEL, False for the
    # request itself). An entry whose request moved on meanwhile is skipped.
    _outbox: deque[tuple[int, bool]] = field(default_factory=deque)
    _give_ups: list[tuple[float, int]] = field(default_factory=list)

    def keep(
        self, rid: int, model: str, meta: dict[str, Any], payloads: list[Any], now: float
    ) -> None:
        """Keep request ``rid`` (just sent on the current connection) until :meth:`pop`;
        ``meta["timeout_ms"]`` is its budget."""
        budget_end_s = now + meta["timeout_ms"] / 1000.0
        self.kept[rid] = Kept(model, meta, payloads, now, budget_end_s, self.epoch)

    def pop(self, rid: int, now: float | None = None, *, answered: bool = False) -> None:
        """Let go of request ``rid`` (answered, failed or forgotten); ``answered``: the
        broker answered it (a result, or an error other than a ``retry`` refusal);
        ``now``: when it was answered with its outputs, a sample of its model's latency."""
        kept = self.kept.pop(rid, None)
        if kept is None:
            return
        if self._on_retiring:
            self._settled_on_retiring(rid)
        if answered and kept.epoch == self.epoch and kept.stage is Stage.SENT:
            self.on_trial = False
        if now is None or kept.resent:
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
        if kept is None:
            return None
        if kept.stage is Stage.SENT:
            if self._on_retiring:
                self._settled_on_retiring(rid)
            return None
        return self._answer(rid, kept)

    def needed_s(self, model: str) -> float:
        """The budget a request for ``model`` must have left to be sent again: the latency
        seen for the model (:data:`UNKNOWN_LATENCY_S` before any)."""
        return self.latency_s.get(model, UNKNOWN_LATENCY_S)

    def refused(self, rid: int, error: RequestError, now: float | None) -> RequestError | None:
        """The broker answered request ``rid`` UNAVAILABLE with ``retry``. Returns None
        when it is kept to be sent again, else its answer (``error``; ``Cancelled`` for a
        cancelled request, which ran nowhere). A refusal on the current connection, not
        on trial, makes the client leave it (:attr:`leaving`)."""
        kept = self.kept.get(rid)
        if kept is None or kept.stage is not Stage.SENT:
            return error
        current = kept.epoch == self.epoch
        if current and not self.on_trial:
            self.leaving = True  # (whatever becomes of this request: that broker stops)
        if kept.cancelling:
            return Cancelled("cancelled; the stopping broker had not run it", request_id=rid)
        give_up_s = kept.budget_end_s - self.needed_s(kept.model)
        if now is not None and now >= give_up_s:
            return error
        if self._on_retiring:
            self._settled_on_retiring(rid)
        kept.refusal = error
        self._wait(rid, kept, give_up_s)
        if current and self.on_trial:
            kept.move(Event.REFUSED_ON_TRIAL)
        else:
            kept.move(Event.REFUSED)
            self._outbox.append((rid, False))
        return None

    def switched(self, now: float) -> list[tuple[int, RequestError]]:
        """The twin left the current connection (:attr:`leaving`): it opened a new socket,
        now the current one (on trial), and kept the old one open for reading, now the
        retiring one, having closed the one that retired before, if any. The requests
        still on that one are sent again on the new connection (or, with too little budget
        or cancelled, returned with their answers), and those parked are queued."""
        failed: list[tuple[int, RequestError]] = []
        if self.retiring is not None:
            failed = self._requeue(self._on_retiring, now)
        left = self.epoch
        self._on_retiring = {
            rid for rid, k in self.kept.items() if k.stage is Stage.SENT and k.epoch == left
        }
        self.retiring = left if self._on_retiring else None
        for rid, kept in self.kept.items():
            if kept.stage is Stage.PARKED:
                kept.move(Event.LEFT)  # (its give-up stands)
                self._outbox.append((rid, False))
        self.epoch += 1
        self.leaving, self.on_trial = False, True
        self.switches += 1
        return failed

    def lost(self, now: float) -> list[tuple[int, RequestError]]:
        """The current connection closed and the socket was reopened (not on trial):
        each request not yet answered that went by it, or waits to be sent, is queued to
        be sent again, or, with too little budget (or cancelled), returned with its
        answer. Those on the retiring connection are left as they are."""
        failed: list[tuple[int, RequestError]] = []
        retiring = self._on_retiring
        for rid, kept in list(self.kept.items()):
            if kept.stage is Stage.QUEUED:
                kept.move(Event.LOST)  # (it waits for the socket still: its give-up stands)
            elif rid not in retiring:
                self._lose(rid, kept, now, failed)
        self.epoch += 1
        self.leaving = self.on_trial = False
        return failed

    def retiring_lost(self, now: float) -> list[tuple[int, RequestError]]:
        """The retiring connection closed before every request sent on it was answered:
        those are sent again on the current one (or returned with their answers, as
        :meth:`lost` does), and no connection retires."""
        return self._requeue(self._on_retiring, now)

    def cancel(self, rid: int) -> RequestError | None:
        """Cancel request ``rid``: its CANCEL is queued (on the current connection), or
        its answer waited for (on the retiring one, where nothing more is sent), or, not
        at any broker, its answer is returned now (``Cancelled``; None if unknown)."""
        kept = self.kept.get(rid)
        if kept is None or kept.cancelling:
            return None
        if kept.stage is not Stage.SENT:
            del self.kept[rid]
            return Cancelled("cancelled before it was sent again", request_id=rid)
        kept.cancelling = True
        if kept.epoch == self.epoch:
            self._outbox.append((rid, True))
        return None

    @property
    def has_outgoing(self) -> bool:
        return bool(self._outbox) and not self.leaving

    def outgoing(self, now: float) -> list[Any] | None:
        """The frames of the next message for the current socket (a request sent again,
        with ``timeout_ms`` what remains of its budget now, or a CANCEL); None: none waits,
        or the client is leaving the connection. Call :meth:`took` once the socket has
        taken them."""
        if self.leaving:
            return None
        outbox = self._outbox
        while outbox:
            rid, cancel = outbox[0]
            kept = self.kept.get(rid)
            if kept is not None:
                if cancel and kept.stage is Stage.SENT and kept.epoch == self.epoch:
                    return Cancel(rid, self.nonce).to_frames()
                if not cancel and kept.stage is Stage.QUEUED and now < kept.give_up_s:
                    left_ms = (kept.budget_end_s - now) * 1000
                    kept.meta["timeout_ms"] = max(1, math.floor(left_ms + 1e-6))
                    return request_frames(kept.meta, kept.payloads)
            # Answered, cancelled, past its give-up (expire fails it), or a CANCEL for a
            # request on a connection the client left.
            outbox.popleft()
        return None

    def took(self) -> None:
        """The socket took the message :meth:`outgoing` returned last."""
        rid, cancel = self._outbox.popleft()
        if cancel:
            self.cancels += 1
            return
        kept = self.kept[rid]
        kept.move(Event.TAKEN)
        kept.epoch = self.epoch
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

    def _settled_on_retiring(self, rid: int) -> None:
        """Request ``rid`` no longer waits on the retiring connection; with none left,
        no connection retires (the twin closes its socket)."""
        on_retiring = self._on_retiring
        on_retiring.discard(rid)
        if not on_retiring:
            self.retiring = None

    def _requeue(self, rids: set[int], now: float) -> list[tuple[int, RequestError]]:
        """The retiring connection is gone (lost, or dropped): its requests ``rids``, as
        a lost connection's."""
        failed: list[tuple[int, RequestError]] = []
        for rid in sorted(rids):  # (in the order they were made)
            kept = self.kept.get(rid)
            if kept is not None:
                self._lose(rid, kept, now, failed)
        self._on_retiring = set()
        self.retiring = None
        return failed

    def _lose(
        self, rid: int, kept: Kept, now: float, failed: list[tuple[int, RequestError]]
    ) -> None:
        """Request ``rid``'s connection is gone: queue it to be sent again, or, with too
        little budget (or cancelled), let go of it and add its answer to ``failed``."""
        give_up_s = kept.budget_end_s - self.needed_s(kept.model)
        if kept.cancelling or now >= give_up_s:
            del self.kept[rid]
            failed.append((rid, self._answer(rid, kept)))
            return
        kept.move(Event.LOST)
        self._wait(rid, kept, give_up_s)
        self._outbox.append((rid, False))

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
