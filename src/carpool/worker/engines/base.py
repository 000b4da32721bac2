"""base.py: the Engine seam — what a worker needs from an inference backend.

An engine takes a batch (dim 0 of every input) and returns outputs with the same dim 0.
It is used from exactly one thread (the worker's inference thread), which also creates it
when the backend needs thread affinity (TensorRT's CUDA context).

An engine that measures its own device time (the TensorRT engine, with CUDA events around
each batch) may expose it as ``busy_s()``: seconds busy since it was built, never
decreasing, safe to call from the worker's loop thread. Where every engine of a worker
does (:func:`engines_busy_s`), :class:`ReportedBusy` gives the worker's ρ from those
seconds instead of from wall-clock batch spans: host-side time between launches, copies
the device overlaps and the Python around a batch then count for nothing.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from numpy.typing import NDArray

from carpool.common import shape_rules
from carpool.common.protocol import ModelSpec, TensorMeta
from carpool.common.shape_rules import ShapeRule

Array = NDArray[Any]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine runs: ``io``, the :class:`ModelSpec` a worker announces for it
    (inputs and outputs, dim 0 of each the batch, ``-1``, other ``-1`` dims dynamic;
    batch limits, shape rules, pad rules and crops; its name is the worker's to give:
    :meth:`spec`), and the shapes its warm-up runs on, which are not announced."""

    io: ModelSpec
    # Per warm-up run (a model config's ``warmup``, or a TensorRT plan's profiles), one
    # full shape per input in input order; () when none is declared (the warm-up guesses
    # one).
    warmup: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def spec(self, name: str) -> ModelSpec:
        return dataclasses.replace(self.io, name=name)


def engine_io(
    inputs: Sequence[TensorMeta],
    outputs: Sequence[TensorMeta],
    max_batch: int,
    preferred_batch: Sequence[int] = (),
) -> ModelSpec:
    """An engine's :attr:`EngineInfo.io` before a worker names it: these tensors and batch
    limits, no shape rules, pad rules or crops yet."""
    return ModelSpec("", tuple(inputs), tuple(outputs), max_batch, tuple(preferred_batch))


def with_rules(info: EngineInfo, rules: Mapping[str, ShapeRule], what: str) -> EngineInfo:
    """``info`` with ``rules`` (by input name) for its inputs.

    Raises:
        ConfigError: a rule names an input the engine lacks or does not fit its rank.
    """
    io = info.io
    names = [t.name for t in io.inputs]
    ranks = [len(t.shape) for t in io.inputs]
    aligned = shape_rules.align(names, ranks, rules, what)
    return dataclasses.replace(info, io=dataclasses.replace(io, rules=aligned))


class BadInput(Exception):
    """An engine refused a batch's inputs, not for a fault of its own (an index out of
    range, a value the model rejects): the requests are answered INVALID_ARGUMENT."""


class Engine(Protocol):
    """An inference backend for one model.

    An engine may set ``thread_bound = False`` (ONNX Runtime and the synthetic engine do) to
    let the worker run very short batches on its loop thread; engines without it (TensorRT,
    whose CUDA context belongs to the inference thread) always run on the inference thread.
    An engine may also offer ``enqueue(inputs) -> Pending`` and ``contexts`` (the batches
    it may have queued at once): the inference thread then queues the next batch before
    collecting the one before (:func:`queue_depth`).
    """

    @property
    def info(self) -> EngineInfo: ...

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """Run one batch; every output's dim 0 equals the inputs' dim 0."""
        ...

    def close(self) -> None: ...


class Pending(Protocol):
    """A batch an engine has queued; :meth:`result` waits for its outputs."""

    def result(self) -> dict[str, Array]: ...


def queue_depth(engine: Engine | None) -> int:
    """How many batches ``engine`` may have queued at once: its ``contexts`` where it has
    ``enqueue(inputs) -> Pending`` (TensorRT's: one batch's copies overlap another's
    compute), else 1 (each batch runs to its end before the next)."""
    if engine is None or not callable(getattr(engine, "enqueue", None)):
        return 1
    return max(1, int(getattr(engine, "contexts", 1)))


def as_batch_dim(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A spec shape with dim 0 marked as the (dynamic) batch dim."""
    return (-1, *shape[1:]) if shape else shape


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
