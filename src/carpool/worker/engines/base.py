"""base.py: the Engine seam — what a worker needs from an inference backend.

An engine takes a batch (dim 0 of every input) and returns outputs with the same dim 0.
It is used from exactly one thread (the worker's inference thread), which also creates it
when the backend needs thread affinity (TensorRT's CUDA context).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from numpy.typing import NDArray

from carpool.common import shape_rules
from carpool.common.padding import CropAxis, PadRule
from carpool.common.protocol import ModelSpec, TensorMeta
from carpool.common.shape_rules import ShapeRule

Array = NDArray[Any]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """I/O of an engine; dim 0 of every tensor is the batch (``-1``); other ``-1`` dims
    are dynamic. Every field but ``warmup`` is the :class:`ModelSpec` field of that name
    (its shape rules: see :func:`with_rules`), which :meth:`spec` announces."""

    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    max_batch: int
    preferred_batch: tuple[int, ...] = ()
    rules: tuple[ShapeRule | None, ...] = ()
    pads: tuple[PadRule | None, ...] = ()
    crops: tuple[tuple[CropAxis, ...], ...] = ()
    # The shapes the worker's warm-up runs on (a model config's ``warmup``): per run, one
    # full shape per input in input order; () when none is declared (the warm-up guesses
    # one). Not announced.
    warmup: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def spec(self, name: str) -> ModelSpec:
        return ModelSpec(
            name,
            self.inputs,
            self.outputs,
            self.max_batch,
            self.preferred_batch,
            self.rules,
            self.pads,
            self.crops,
        )


def with_rules(info: EngineInfo, rules: Mapping[str, ShapeRule], what: str) -> EngineInfo:
    """``info`` with ``rules`` (by input name) for its inputs.

    Raises:
        ConfigError: a rule names an input the engine lacks or does not fit its rank.
    """
    names = [t.name for t in info.inputs]
    ranks = [len(t.shape) for t in info.inputs]
    return dataclasses.replace(info, rules=shape_rules.align(names, ranks, rules, what))


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
