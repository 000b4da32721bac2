"""Clock: the one seam for time. Only this module reads ``time.monotonic`` (and the wall
clock, for :func:`wall_offset_s`, and a thread's CPU time).

Pure cores never hold a clock: they take ``now`` (monotonic seconds) as an argument.
Shells hold a :class:`Clock`; tests give them :class:`carpool.common.testing.FakeClock`.
"""

from __future__ import annotations

import math
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds, the calling thread's CPU seconds, and a way to let time pass."""

    def now(self) -> float: ...

    def cpu(self) -> float:
        """CPU seconds the calling thread has used (differences are what count)."""
        ...

    def sleep(self, duration_s: float) -> None: ...


class MonotonicClock:
    """The real clock. ``now`` is ``time.monotonic`` itself, with no Python call around it:
    shells read it several times per request."""

    now = staticmethod(time.monotonic)
    cpu = staticmethod(time.thread_time)

    def sleep(self, duration_s: float) -> None:
        if duration_s > 0:
            time.sleep(duration_s)


def poll_timeout_ms(wait_s: float | None) -> int | None:
    """A wait as a poll timeout: whole milliseconds, rounded up, so that a loop never wakes
    before what it waits for falls due (None: no limit). The broker's and the worker's
    loops poll with it; the simulator wakes its broker when the broker's loop would."""
    return None if wait_s is None else max(0, math.ceil(wait_s * 1000))


def wall_offset_s() -> float:
    """What to add to a :class:`MonotonicClock` reading for the Unix time it was taken at
    (read once: intervals keep the monotonic clock's steadiness). For records that must
    line up across restarts and reboots, where the monotonic clock starts afresh."""
    return time.time() - time.monotonic()
