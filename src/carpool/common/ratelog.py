"""ratelog.py: RateLimitedLog — log lines that a peer can cause, at most so many a minute.

A peer that sends garbage, is refused, or connects and leaves in a loop must not be able
to fill the disk or drown every other line. Each such kind of line gets a
:class:`RateLimitedLog` of its own (a flood of one kind then hides no other): within each
minute it writes the first ``per_min`` lines, counts the rest, and says how many it left
out on the next line it writes.
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass, field

from carpool.common.clock import Clock, MonotonicClock

__all__ = ["PEER_LINES_PER_MIN", "RateLimitedLog"]

_WINDOW_S = 60.0
#: Lines a minute of each kind that peers can cause (protocol errors, refusals, joins).
PEER_LINES_PER_MIN = 30


@dataclass(slots=True, eq=False, repr=False)
class RateLimitedLog:
    """Lines to ``logger`` at ``level``, at most ``per_min`` a minute (``now``: the
    caller's clock reading, for a pure caller; else ``clock``'s)."""

    logger: logging.Logger
    per_min: int
    _: KW_ONLY
    level: int = logging.WARNING
    clock: Clock = field(default_factory=MonotonicClock)
    #: Lines left out since the last one written.
    suppressed: int = field(init=False, default=0)
    #: Every line asked for, written or not.
    total: int = field(init=False, default=0)
    _window_s: float = field(init=False, default=-_WINDOW_S)
    _written: int = field(init=False, default=0)

    def __call__(
        self,
        fmt: str,
        *args: object,
        now: float | None = None,
        exc_info: BaseException | None = None,
    ) -> None:
        """Log ``fmt % args`` (with ``exc_info``'s traceback, if given) unless this
        minute's lines are spent."""
        self.total += 1
        if now is None:
            now = self.clock.now()
        if now - self._window_s >= _WINDOW_S:
            self._window_s, self._written = now, 0
        if self._written >= self.per_min:
            self.suppressed += 1
            return
        self._written += 1
        if self.suppressed:
            fmt += " (%d more like it not logged)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self.logger.log(self.level, fmt, *args, exc_info=exc_info)
