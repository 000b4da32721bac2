"""faults.py: what the broker does when a message cannot be read, or its core fails.

- *Reading.* A fault while a message is read (receiving it, the properties of its
  frames, the connection table, decoding a worker's) drops that message: it is counted
  by endpoint and kind (STATS ``dropped_unreadable``, /metrics
  ``carpool_broker_unreadable_total``) and logged, with its traceback the first time of
  each kind and rate-limited after (:meth:`FaultPolicy.unreadable`). The loop goes on.
- *Inside the core.* An exception from :class:`~carpool.broker.core.BrokerCore` is a bug
  of ours. When the core's count of writes (:meth:`BrokerCore.changes
  <carpool.broker.core.BrokerCore.changes>`), read before the message, shows that the
  message changed no state, the message is answered (a client's INTERNAL, a worker's
  DISCONNECT with its batches requeued), logged with its traceback, and the loop goes on
  (:meth:`FaultPolicy.after_fault`). Otherwise it raises :class:`Fault`: the server logs
  it and stops through its wind-down, answering what it holds, and ``serve`` raises
  :class:`BrokerFault` (the process exits 1, so systemd restarts it). Any other
  exception out of a loop turn (a tick's, the server's own, the wind-down's) stops it
  the same way. A fault half-way through a state change is never swallowed: that could
  leak a request or answer it twice. What such a fault leaves: the replies the core had
  built for that message so far are lost with it (the handler never returned them), so
  a request that reached its final state there is answered by its client's deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from carpool.common.protocol import Frame
from carpool.common.ratelog import PEER_LINES_PER_MIN, RateLimitedLog

if TYPE_CHECKING:
    from carpool.broker.core import BrokerCore, Outgoing
    from carpool.broker.replies import Side

__all__ = ["BrokerFault", "Fault", "FaultPolicy"]

logger = logging.getLogger(__name__)

#: Lines a minute about faults inside the core that changed nothing (each has its
#: traceback; a peer that finds such a bug could otherwise fill the journal).
_FAULT_LINES_PER_MIN = 10


class BrokerFault(RuntimeError):
    """The broker stopped after a fault inside its core that may have changed its state
    (a bug of ours, logged with its traceback when it happened)."""


class Fault(Exception):
    """Raised out of a loop turn by a fault that may have changed the core's state."""


class FaultPolicy:
    """The counts and log lines of faults, and the decision after one in the core."""

    def __init__(self, core: BrokerCore) -> None:
        self._core = core
        # Unreadable messages, by (endpoint, kind): a line each, rate-limited per kind.
        self._unreadable: dict[tuple[str, str], RateLimitedLog] = {}
        self._log_fault = RateLimitedLog(logger, _FAULT_LINES_PER_MIN, level=logging.ERROR)
        #: The fault that stops the broker (None: none yet).
        self.fatal: BaseException | None = None

    def stop_for(self, exc: BaseException) -> None:
        """A fault that may have left the broker's state half-changed (inside the core,
        or anywhere else in a loop turn): logged with its traceback; the server stops,
        answering what it holds, and ``serve`` raises :class:`BrokerFault`."""
        if self.fatal is None:
            self.fatal = exc
        logger.critical(
            "a fault in the broker's loop may have left its state half-changed (a bug); "
            "stopping, answering what it holds, so that it is restarted",
            exc_info=exc,
        )

    def unreadable(self, endpoint: str, kind: str, exc: BaseException) -> None:
        """A message on ``endpoint`` that could not be read (``kind``): dropped, counted,
        logged (with its traceback the first time of each kind; rate-limited)."""
        self._core.stats.unreadable[(endpoint, kind)] += 1
        log = self._unreadable.get((endpoint, kind))
        first = log is None
        if log is None:
            log = self._unreadable[(endpoint, kind)] = RateLimitedLog(logger, PEER_LINES_PER_MIN)
        log(
            "a message on the %s could not be read (%s): %r; dropped",
            endpoint,
            kind,
            exc,
            exc_info=exc if first else None,
        )

    def after_fault(
        self,
        now: float,
        exc: Exception,
        mark: int,
        side: Side,
        identity: bytes,
        frames: Sequence[Frame] | None,
    ) -> list[Outgoing]:
        """The core raised ``exc`` on a message (``frames``, a client's) from ``identity``:
        its answer when the core's writes still number ``mark`` (the message changed
        nothing); else raise :class:`Fault`."""
        core = self._core
        if core.changes() != mark:
            self.stop_for(exc)
            raise Fault from exc
        core.stats.core_faults += 1
        self._log_fault(
            "a fault inside the broker's core on a message from the %s (a bug); the "
            "message changed nothing and is answered: %r",
            side.value,
            exc,
            exc_info=exc,
        )
        return core.on_fault(now, side, identity, frames)
