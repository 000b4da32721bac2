"""resends.py: Resends — a request sent again, and a client's CANCEL (protocol.md §6.1,
§6.5).

Pure. A request that carries its client's nonce (REQUEST ``client``, 16 random bytes the
client draws once) has an origin: the nonce, after the client's authenticated key under
CURVE (the server sets :attr:`Resends.key_of`; without it the nonce alone). The request
book indexes the requests it holds by (origin, id), and the holding area its held ones;
both entries leave when the request has had its answer, so the index is bounded by the
queue and in-flight limits.

- A REQUEST whose (origin, id) is a request still held (at the door, queued or at a
  worker) is a copy sent again after the client lost its connection: it is not run
  again and gets no answer of its own. The held request's one answer goes to the
  connection the copy came by, and the request's share of the per-client limits moves
  there with it (:meth:`Resends.claim`). A copy that names another model than the
  request it matches is answered INVALID_ARGUMENT, and the request goes on as it was.
- A CANCEL of a request held at the door or queued drops it and answers it CANCELLED on
  the connection its latest copy came by; of one at a worker, or one the broker does not
  hold, it does nothing (:meth:`Resends.cancel`). A CANCEL is never answered itself.

Only the holder of a nonce can claim its requests' answers: the broker never sends a
nonce back. Under CURVE the key is part of the origin, so a nonce seen by another key
matches nothing (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from carpool.broker.holding import HeldRequests
from carpool.broker.replies import Outgoing, error
from carpool.broker.requests import ClientId, Origin, PendingRequest, RequestBook, RequestState
from carpool.broker.stats import BrokerStats
from carpool.common.errors import ErrorCode
from carpool.common.protocol import Cancel, Request

_QUEUED = RequestState.QUEUED


class Resends:
    """Copies of requests and CANCELs; see the module docstring."""

    def __init__(self, book: RequestBook, holding: HeldRequests, stats: BrokerStats) -> None:
        self._by_origin = book.by_origin
        self._book = book
        self._holding = holding
        self._stats = stats
        #: Claims and CANCELs that went past their checks (the core's ``changes``).
        self.changes = 0
        #: The authenticated key a client id starts with (the server sets it under
        #: CURVE); None: no keys, a request's origin is its nonce alone.
        self.key_of: Callable[[bytes], bytes] | None = None

    def origin(self, client: ClientId, nonce: bytes, request_id: int) -> Origin:
        """The (origin, id) a request of ``client`` with ``nonce`` is known by."""
        key_of = self.key_of
        return (nonce if key_of is None else key_of(client) + nonce, request_id)

    def claim(self, client: ClientId, request: Request[Any]) -> Origin | list[Outgoing]:
        """``request``, sent with its client's nonce, came from ``client``: its (origin,
        id) when it is no copy of a request held (the caller admits it with that origin),
        else what to send: nothing (the held request answers on ``client``'s connection)
        or, for a copy that names another model, its INVALID_ARGUMENT. (One call: it runs
        for every request sent with a nonce.)"""
        self.changes += 1  # (from here on the message may change state)
        key_of, nonce, delimited = self.key_of, request.nonce, request.delimited
        assert nonce is not None
        origin = (nonce if key_of is None else key_of(client) + nonce, request.request_id)
        req = self._by_origin.get(origin)
        holding = self._holding
        entry = None
        if req is None:
            if not holding.count:
                return origin
            entry = holding.by_origin.get(origin)
            if entry is None:
                return origin
            held_model = entry.request.model
        else:
            held_model = req.model
        if held_model != request.model:
            msg = (
                f"request {origin[1]} of this client is at the broker for model "
                f"{held_model!r}; a request sent again must name the same model"
            )
            code = ErrorCode.INVALID_ARGUMENT
            return [error(self._stats, client, delimited, origin[1], code, msg)]
        if req is not None:
            self._book.redirect(req, client, delimited)
        else:
            assert entry is not None
            holding.redirect(entry, client, delimited)
        self._stats.resent += 1
        return []

    def cancel(
        self, client: ClientId, cancel: Cancel, out: list[Outgoing]
    ) -> PendingRequest | None:
        """A valid CANCEL from ``client``: a request it names that is held at the door is
        dropped and answered CANCELLED (into ``out``); one that is queued is returned,
        for the caller to take out of its queue and answer CANCELLED; nothing else
        changes."""
        self.changes += 1
        origin = self.origin(client, cancel.client, cancel.request_id)
        req = self._by_origin.get(origin)
        if req is not None:
            if req.state is _QUEUED:
                self._stats.cancelled += 1
                return req
        elif self._holding.cancel(origin, out):
            self._stats.cancelled += 1
        return None
