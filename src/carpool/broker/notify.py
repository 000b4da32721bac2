"""notify.py: the broker's systemd notifications — when it is ready, and its STATUS= line.

READY=1 once both ROUTERs are bound (the server binds them in its constructor, so the
first turn of its loop). STATUS= gives the live figures an operator sees in
``systemctl status``: workers registered, models served, requests queued and the request
rate since the last line. Health is the loop itself: a loop that turns is a broker that
answers, and one that does not sends no WATCHDOG=1 (``carpool.common.supervision``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from carpool.common.clock import Clock
from carpool.common.sdnotify import SdNotifier
from carpool.common.supervision import LoopWatch

if TYPE_CHECKING:
    from carpool.broker.core import BrokerCore


class BrokerStatus:
    """The STATUS= line of the broker ``core`` (on the server's ``clock``); each call's
    rate covers the time since the last."""

    def __init__(self, core: BrokerCore, clock: Clock) -> None:
        self._core = core
        self._clock = clock
        self._last = (clock.now(), core.stats.requests)

    def __call__(self) -> str:
        core = self._core
        now, requests = self._clock.now(), core.stats.requests
        then, before = self._last
        self._last = (now, requests)
        rate = (requests - before) / (now - then) if now > then else 0.0
        models = sum(1 for name in core.registry.specs if core.registry.serving(name))
        return (
            f"workers={len(core.registry)} models={models} queued={core.queued} "
            f"req/s={rate:.1f} requests={requests}"
        )


def broker_watch(core: BrokerCore, clock: Clock, notifier: SdNotifier) -> LoopWatch:
    """The LoopWatch for the loop of the server of ``core`` (``BrokerServer.serve(watch)``)."""
    return LoopWatch(notifier, BrokerStatus(core, clock))
