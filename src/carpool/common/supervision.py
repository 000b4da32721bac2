"""supervision.py: LoopWatch — what a server's main loop tells systemd, and when.

The loop calls :meth:`LoopWatch.turn` once a turn, and bounds its poll by what it returns:
READY=1 the first turn ``ready()`` holds (the broker: sockets bound; a worker: engines warm
and registered with its broker), then every half watchdog interval WATCHDOG=1 with a
STATUS= line of live figures, but only while ``trouble()`` finds nothing wrong (a worker's
inference thread alive and not stuck in one batch): a wedged loop sends nothing because it
never gets here, an unhealthy process sends nothing because it is not well, and either way
systemd restarts it. STOPPING=1 when the loop starts winding down. Not under systemd (no
``NOTIFY_SOCKET``), ``turn`` does nothing and never bounds the poll.

``CARPOOL_WEDGE_FILE`` names a file that, while it exists, blocks the loop where it would
send its next WATCHDOG=1: the drill of the unit's ``WatchdogSec=`` (and its test's hook).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping

from carpool.common.sdnotify import SdNotifier

logger = logging.getLogger(__name__)

#: How often STATUS= is refreshed when there is no watchdog to ping.
STATUS_EVERY_S = 5.0
#: How often a wedged loop looks for its wedge file to be gone.
_WEDGE_POLL_S = 0.05


def _always() -> bool:
    return True


def _nothing() -> str | None:
    return None


class LoopWatch:
    """The notify messages of one main loop.

    Args:
        notifier: the process's notify socket.
        status: the live figures for STATUS= (called when a message is due).
        ready: True once the process is ready to serve (polled every turn until it is).
        trouble: why the process is not well, or None; while it says something, no
            WATCHDOG=1 is sent and STATUS= says why.
        environ: where ``CARPOOL_WEDGE_FILE`` is read (default: the process's).
    """

    def __init__(
        self,
        notifier: SdNotifier,
        status: Callable[[], str],
        *,
        ready: Callable[[], bool] = _always,
        trouble: Callable[[], str | None] = _nothing,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.notifier = notifier
        self._status = status
        self._ready = ready
        self._trouble = trouble
        env = os.environ if environ is None else environ
        self._wedge_file = env.get("CARPOOL_WEDGE_FILE", "")
        watchdog_s = notifier.watchdog_s
        self.interval_s = STATUS_EVERY_S if watchdog_s is None else watchdog_s / 2
        self.is_ready = False
        self._due_s = 0.0
        self._troubled = False  # the last check found trouble (logged once a spell)

    def turn(self, now: float) -> float | None:
        """Send what is due at ``now``; returns the seconds until the next call is due
        (None: never, not under systemd)."""
        if not self.notifier.enabled:
            return None
        if not self.is_ready:
            if not self._ready():
                return self.interval_s  # (READY comes with the message that makes it so)
            self.is_ready = True
            self.notifier.send(READY=1, STATUS=self._status())
            self._due_s = now + self.interval_s
        if now < self._due_s:
            return self._due_s - now
        self._wedged()
        self._due_s = now + self.interval_s
        trouble = self._trouble()
        if trouble is None:
            if self._troubled:
                logger.warning("healthy again: watchdog pings resume")
            self._troubled = False
            ping = {"WATCHDOG": 1} if self.notifier.watchdog_s is not None else {}
            self.notifier.send(**ping, STATUS=self._status())
        else:
            if not self._troubled:
                logger.error("unhealthy (%s): watchdog pings stop", trouble)
            self._troubled = True
            self.notifier.send(STATUS=f"unhealthy: {trouble}")
        return self.interval_s

    def stopping(self) -> None:
        """The loop is winding down (SIGTERM)."""
        self.notifier.send(STOPPING=1, STATUS="stopping")

    def _wedged(self) -> None:
        """Block while the wedge file exists (the watchdog drill)."""
        if not self._wedge_file or not os.path.exists(self._wedge_file):
            return
        logger.warning("%s exists: the loop blocks until it is removed", self._wedge_file)
        pause = threading.Event()
        while os.path.exists(self._wedge_file):
            pause.wait(_WEDGE_POLL_S)
