"""holding.py: HeldRequests — requests at the door for a model that is expected back.

Pure: ``now`` comes in. For ``register_grace_s`` after the broker starts, a request for a
model no worker has registered yet, whose name the broker expects (a ``[models.<name>]``
table of its configuration, or a model of the trace it records to), waits here instead
of being answered UNAVAILABLE: after a restart its workers are reconnecting. A held
request is not admitted (without a spec it cannot be validated) and is not in the
request book; this object alone owns it until it leaves, exactly once:

- released when a worker's READY registers its model, in arrival order, to go through
  the normal admission with what remains of its budget (``ClientIntake.release``);
- answered UNAVAILABLE at its deadline less :data:`HOLD_LEAD_S`, or when the grace
  window ends (``on_tick``);
- answered UNAVAILABLE when the broker stops (``stop``), with ``retry``;
- answered CANCELLED when its client cancels it (``cancel``).

A held request sent with a nonce is indexed by its origin, as the request book indexes
the requests it holds: a copy sent again (protocol.md §6.1) points its answer at the
copy's connection (``redirect``) instead of being held a second time.

Bounded: only expected names are held, so random names cannot fill it, and a request
is held only while the held and queued requests together stay within ``max_queued``
and ``max_queued_mib``, and its client's held and queued-or-running ones within
``max_client_requests`` and ``max_client_mib``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from carpool.broker.replies import Outgoing, error
from carpool.broker.requests import ClientId, Origin, count_in, count_out
from carpool.common.errors import ErrorCode
from carpool.common.protocol import Request

if TYPE_CHECKING:
    from carpool.broker.backlog import Backlog
    from carpool.broker.config import BrokerConfig
    from carpool.broker.stats import BrokerStats

#: A held request is answered this long before its deadline, so that its client still
#: has time to act on the UNAVAILABLE (retry elsewhere, or report); a request with less
#: budget than this is not held.
HOLD_LEAD_S = 0.05


@dataclass(slots=True)
class HeldRequest:
    """A request waiting for its model's first READY (decoded, not yet validated)."""

    seq: int  # arrival order
    client: ClientId  # where its answer goes (a copy sent again moves it)
    request: Request[Any]
    nbytes: int  # payload bytes, counted against the queue limits
    deadline_s: float  # receipt plus its budget, on the broker's clock
    expires_s: float  # when it is answered UNAVAILABLE unless released first
    origin: Origin | None = None  # sent with a nonce: how a copy or a CANCEL finds it
    gone: bool = False  # released or answered (its heap entry is dropped lazily)


class HeldRequests:
    """The requests held at the door; see the module docstring."""

    def __init__(self, config: BrokerConfig, backlog: Backlog, stats: BrokerStats) -> None:
        self._config = config
        self._backlog = backlog
        self._stats = stats
        #: The model names whose requests may be held.
        self.names: frozenset[str] = frozenset(config.models)
        #: The end of the grace window (the core sets it from when the broker started).
        self.until_s = -math.inf
        self.count = 0
        self.nbytes = 0
        self._seq = 0
        self._by_model: dict[str, dict[int, HeldRequest]] = {}
        self._expiries: list[tuple[float, int, HeldRequest]] = []
        self._per_client: dict[ClientId, list[int]] = {}  # client -> [requests, bytes]
        #: The held requests that carry an origin, by it.
        self.by_origin: dict[Origin, HeldRequest] = {}
        #: Requests held, redirected or gone so far: the core's ``changes`` reads it.
        self.changes = 0

    def expect(self, names: Iterable[str]) -> None:
        """Hold requests for ``names`` too, besides the configuration's models."""
        self.names = frozenset(self._config.models) | frozenset(names)

    def hold(
        self, now: float, client: ClientId, request: Request[Any], origin: Origin | None = None
    ) -> bool:
        """Hold a request for a model with no spec, if it is expected, the grace window
        and the request's budget leave time, and the limits allow. False: not held (the
        caller answers it). ``origin``: the request's, when it carries a nonce."""
        if request.model not in self.names or now >= self.until_s or self._backlog.stopping:
            return False
        config = self._config
        timeout_ms = request.timeout_ms
        budget_s = timeout_ms / 1000.0 if timeout_ms is not None else config.default_timeout_s
        deadline_s = now + budget_s
        expires_s = min(deadline_s - HOLD_LEAD_S, self.until_s)
        if expires_s <= now:
            return False
        nbytes = request.nbytes
        backlog = self._backlog
        if (
            self.count + backlog.queued >= config.max_queued
            or self.nbytes + backlog.queued_bytes + nbytes > config.max_queued_mib << 20
        ):
            return False
        mine = self._per_client.get(client)
        held, held_bytes = backlog.held(client)
        if mine is not None:
            held, held_bytes = held + mine[0], held_bytes + mine[1]
        if held >= config.max_client_requests or held_bytes + nbytes > config.max_client_mib << 20:
            return False
        self._seq += 1
        self.changes += 1
        entry = HeldRequest(self._seq, client, request, nbytes, deadline_s, expires_s, origin)
        self._by_model.setdefault(request.model, {})[entry.seq] = entry
        if origin is not None:
            self.by_origin[origin] = entry
        heapq.heappush(self._expiries, (expires_s, entry.seq, entry))
        self.count += 1
        self.nbytes += nbytes
        count_in(self._per_client, client, nbytes)
        return True

    def redirect(self, entry: HeldRequest, client: ClientId, delimited: bool) -> None:
        """A copy of a held request came by another connection (``client``): its answer
        goes there, and its share of the per-client limits moves there with it."""
        self.changes += 1
        old = entry.client
        if old != client:
            count_out(self._per_client, old, entry.nbytes)
            count_in(self._per_client, client, entry.nbytes)
        entry.client = client
        entry.request.delimited = delimited

    def cancel(self, origin: Origin, out: list[Outgoing]) -> bool:
        """Drop the held request of ``origin``, if there is one, and answer it CANCELLED
        (its one answer). False: none is held."""
        entry = self.by_origin.get(origin)
        if entry is None:
            return False
        model = entry.request.model
        entries = self._by_model[model]
        del entries[entry.seq]
        if not entries:
            del self._by_model[model]
        self._leave(entry)
        self._settle()
        r = entry.request
        message = "cancelled by its client before a worker registered the model"
        out.append(
            error(
                self._stats,
                entry.client,
                r.delimited,
                r.request_id,
                ErrorCode.CANCELLED,
                message,
                simple=r.simple,
            )
        )
        return True

    def release(self, model: str) -> list[HeldRequest]:
        """The requests held for ``model``, in arrival order; they leave this object (the
        caller admits or answers each). Call :meth:`on_tick` first, so that none is past
        its expiry."""
        entries = self._by_model.pop(model, None)
        if not entries:
            return []
        released = list(entries.values())
        for entry in released:
            self._leave(entry)
        self._settle()
        return released

    def next_expiry_s(self) -> float | None:
        """When the earliest held request is due to be answered (None: none held)."""
        return self._expiries[0][0] if self._expiries else None

    def on_tick(self, now: float, out: list[Outgoing]) -> None:
        """Answer UNAVAILABLE the held requests whose expiry has come."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            entry = heapq.heappop(expiries)[2]
            if entry.gone:
                continue
            model = entry.request.model
            del self._by_model[model][entry.seq]
            self._leave(entry)
            started_s = self.until_s - self._config.register_grace_s
            msg = (
                f"no worker has registered model {model!r} yet; the broker "
                f"started {now - started_s:.1f} s ago"
            )
            out.append(self._answer(entry, msg))
        self._settle()
        for model in [m for m, entries in self._by_model.items() if not entries]:
            del self._by_model[model]

    def stop(self, out: list[Outgoing], retry_after_ms: int | None = None) -> None:
        """The broker is stopping: answer every held request UNAVAILABLE with ``retry``
        (and ``retry_after_ms``), in arrival order."""
        held = sorted(
            (e for entries in self._by_model.values() for e in entries.values()),
            key=lambda e: e.seq,
        )
        self._by_model.clear()
        self._expiries.clear()
        msg = "the broker is stopping before a worker registered the model; retry"
        for entry in held:
            self._leave(entry)
            out.append(self._answer(entry, msg, retry=True, hint=retry_after_ms))

    def _answer(
        self, entry: HeldRequest, message: str, *, retry: bool = False, hint: int | None = None
    ) -> Outgoing:
        r = entry.request
        code = ErrorCode.UNAVAILABLE
        return error(
            self._stats,
            entry.client,
            r.delimited,
            r.request_id,
            code,
            message,
            simple=r.simple,
            retry_after_ms=hint,
            retry=retry,
        )

    def _leave(self, entry: HeldRequest) -> None:
        self.changes += 1
        entry.gone = True
        self.count -= 1
        self.nbytes -= entry.nbytes
        count_out(self._per_client, entry.client, entry.nbytes)
        if entry.origin is not None:
            del self.by_origin[entry.origin]

    def _settle(self) -> None:
        """Drop the heap's top entries that left already, so its top is a live one."""
        expiries = self._expiries
        while expiries and expiries[0][2].gone:
            heapq.heappop(expiries)
