"""progress.py: Progress — how far long work has come (bench, replay, simulate, tune).

On a terminal, a rich progress bar, redrawn in place. Anywhere else (a pipe, a file, a
CI log), one plain line every ``every_s`` seconds and one at the end: never a carriage
return, so piped output reads as lines. Updates are cheap to call in a hot loop (the
load generator's): one integer compare until a 1/200th step of the total is reached.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from carpool.common.clock import Clock, MonotonicClock

#: Seconds between two plain lines.
EVERY_S = 5.0
_STEPS = 200  # updates passed on per run, at most (plus the last)


class Progress:
    """One task's progress on ``stream`` (default stderr); a context manager.

    Args:
        what: the task, first on every line ("sent", "grid search").
        total: the count at which it is done.
        stream: where to write; a terminal gets a bar, anything else lines.
        every_s: seconds between plain lines.
        clock: the time source of the plain lines' pace (a FakeClock in tests).
    """

    def __init__(
        self,
        what: str,
        total: int,
        *,
        stream: TextIO | None = None,
        every_s: float = EVERY_S,
        clock: Clock | None = None,
    ) -> None:
        self.what = what
        self.total = max(0, total)
        self._stream = stream if stream is not None else sys.stderr
        self._every_s = every_s
        self._clock = clock or MonotonicClock()
        self._step = max(1, self.total // _STEPS)
        self._next = 0  # the count the next update is passed on at
        self._last_line_s = self._clock.now()
        self._done = -1
        self._bar: RichProgress | None = None
        console = Console(file=self._stream)
        if console.is_terminal:
            self._bar = RichProgress(
                TextColumn("  {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[note]}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task(what, total=self.total, note="")
            self._bar.start()

    def update(self, done: int, note: str = "") -> None:
        """``done`` of the total so far; ``note`` is shown beside it ("12 in flight")."""
        if (done < self._next and done < self.total) or self._done >= self.total:
            return  # (not a step further; or the end, shown already)
        self._next = done + self._step
        self._done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done, note=note)
            return
        now = self._clock.now()
        if done >= self.total or now - self._last_line_s >= self._every_s:
            self._last_line_s = now
            self._line(done, note)

    def _line(self, done: int, note: str) -> None:
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        extra = f", {note}" if note else ""
        self._stream.write(f"  {self.what}: {done}/{self.total}{share}{extra}\n")
        self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class CountProgress:
    """A ``progress(done, total)`` callback (``grid_search``'s) drawn by :class:`Progress`,
    made when the total is first known; :meth:`close` ends it."""

    def __init__(self, what: str, stream: TextIO | None = None) -> None:
        self.what = what
        self._stream = stream
        self._progress: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._progress is None:
            self._progress = Progress(self.what, total, stream=self._stream)
        self._progress.update(done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
