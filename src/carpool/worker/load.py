"""load.py: ρ, how busy a worker's engines have been over the last window — pure.

:class:`BusyMeter` measures it from the wall-clock spans of the batches the worker ran
(the inference thread reports each batch's start and end). An engine that measures its
own device time (the TensorRT engine, with CUDA events around each batch) may expose it
as ``busy_s()``: seconds busy since it was built, never decreasing, safe to call from
the worker's loop thread. Where every engine of a worker does, :class:`ReportedBusy`
gives ρ from those seconds instead: host-side time between launches, copies the device
overlaps and the Python around a batch then count for nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any


class BusyMeter:
    """ρ: the fraction of the last ``window_s`` the engine spent running batches.

    Finished batches are exact spans reported by the inference thread; a batch still
    running counts from ``running_since`` (when the idle thread was handed work). A running
    total of the spans in the window keeps ``rho`` cheap however many batches there are.
    """

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()
        self._total_s = 0.0  # summed length of the spans in _spans
        self.running_since: float | None = None

    def add(self, start: float, end: float) -> None:
        if end > start:
            self._spans.append((start, end))
            self._total_s += end - start

    def rho(self, now: float) -> float:
        begin = now - self.window_s
        spans = self._spans
        while spans and spans[0][1] <= begin:
            start, end = spans.popleft()
            self._total_s -= end - start
        busy = self._total_s
        if spans and spans[0][0] < begin:  # the oldest span straddles the window's start
            busy -= begin - spans[0][0]
        if spans and spans[-1][1] > now:  # reported with a later clock than ours
            busy -= spans[-1][1] - max(now, spans[-1][0])
        if self.running_since is not None:
            busy += max(0.0, now - max(self.running_since, begin))
        return min(1.0, max(0.0, busy / self.window_s))


class ReportedBusy:
    """ρ from an engine-reported busy-seconds counter: the seconds it grew by over about
    the last ``window_s``, as a share of that time.

    Args:
        busy_s: the counter (summed over the engines), read on every :meth:`rho`.
        window_s: how far back ρ looks.
    """

    def __init__(self, busy_s: Callable[[], float], window_s: float = 1.0) -> None:
        self.busy_s = busy_s
        self.window_s = window_s
        self._marks: deque[tuple[float, float]] = deque()  # (when, counter), oldest first

    def rho(self, now: float) -> float:
        total = self.busy_s()
        marks = self._marks
        # Keep a mark a tenth of a window apart at most, and one at or before the window's
        # start once there is one: a few marks, however often ρ is asked.
        if not marks or now - marks[-1][0] >= self.window_s / 10:
            marks.append((now, total))
        while len(marks) > 1 and marks[1][0] <= now - self.window_s:
            marks.popleft()
        since, base = marks[0]
        if now <= since:
            return 0.0
        return min(1.0, max(0.0, (total - base) / (now - since)))


def engines_busy_s(engines: Mapping[str, Any]) -> Callable[[], float] | None:
    """The summed ``busy_s()`` of ``engines`` when every one of them has it (seconds
    their device spent computing, from CUDA events: the TensorRT engine), else None (ρ
    from wall-clock batch time: ONNX Runtime, synthetic)."""
    counters = [getattr(e, "busy_s", None) for e in engines.values()]
    if not counters or not all(callable(c) for c in counters):
        return None
    ready = [c for c in counters if c is not None]
    return lambda: float(sum(c() for c in ready))
