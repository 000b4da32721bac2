"""synthetic.py: SyntheticEngine — a batch costs ``fixed_cost_s + per_sample_s * B``.

For benchmarks and tests of batching without real compute. Its output is a checkable
function of its input: ``y = 2 * x + 1`` (same dtype and shape), so a test can tell that
every request got its own answer. It waits through a :class:`Clock` (no CPU spent), as a
GPU would while the host thread waits for the device.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping

import numpy as np

from carpool.common.clock import Clock, MonotonicClock
from carpool.common.protocol import TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.base import Array, EngineInfo, engine_io, with_rules
from carpool.worker.shapes import ModelShapes, declare

#: How many of its latest batches a SyntheticEngine remembers (``batches``).
RECENT_BATCHES = 1024


def synthetic_output(x: Array, output_items: int = 0) -> Array:
    """What SyntheticEngine computes; tests use it as the oracle. With ``output_items``,
    only the first that many values of each sample (a classifier's shape: a large input,
    a small output)."""
    y = (x * 2 + 1).astype(x.dtype, copy=False)
    if output_items:
        y = np.ascontiguousarray(y.reshape(y.shape[0], -1)[:, :output_items])
    return y


class SyntheticEngine:
    """An engine with a known cost model and a known answer.

    Args:
        fixed_cost_s: cost of launching a batch at all (α in the seeds).
        per_sample_s: extra cost per sample (β).
        item_shape: shape of one sample of input ``x`` (``-1`` = dynamic dim).
        dtype: wire dtype of ``x`` and ``y``.
        max_batch: largest batch accepted.
        preferred_batch: sizes to advertise (like TensorRT profile sizes).
        clock: how to wait; the real clock by default.
        output_items: 0: ``y`` has the shape of ``x``; n: ``y`` is ``[B, n]``, the first n
            values of each sample (at most the sample's size).
        shape_rules: limits on ``x``'s dynamic dims announced to the broker (§8.1).
        shapes: a model config's shape declarations (:mod:`carpool.worker.shapes`).
    """

    #: May be called from any one thread at a time (not bound to the thread that built it).
    thread_bound = False

    def __init__(
        self,
        *,
        fixed_cost_s: float = 0.0,
        per_sample_s: float = 0.0,
        item_shape: tuple[int, ...] = (16,),
        dtype: str = "float32",
        max_batch: int = 32,
        preferred_batch: tuple[int, ...] = (),
        clock: Clock | None = None,
        output_items: int = 0,
        shape_rules: Mapping[str, ShapeRule] | None = None,
        shapes: ModelShapes | None = None,
    ) -> None:
        if output_items < 0 or (output_items and -1 in item_shape):
            raise ValueError("output_items needs a non-negative count and a fixed item shape")
        if output_items and output_items > math.prod(item_shape):
            raise ValueError(f"output_items {output_items} exceeds the sample's size")
        self.fixed_cost_s = fixed_cost_s
        self.per_sample_s = per_sample_s
        self.output_items = output_items
        self.clock: Clock = clock or MonotonicClock()
        shape = (-1, *item_shape)
        out_shape = (-1, output_items) if output_items else shape
        self._info = with_rules(
            EngineInfo(
                engine_io(
                    (TensorMeta("x", dtype, shape),),
                    (TensorMeta("y", dtype, out_shape),),
                    max_batch,
                    preferred_batch,
                )
            ),
            shape_rules or {},
            "synthetic model",
        )
        if shapes is not None:
            self._info = declare(self._info, shapes, "synthetic model")
        self._lock = threading.Lock()
        # (batch size, item shape) of the most recent batches run, for tests; few, so that
        # a worker serving for months holds no more than it did after its first minute.
        self.batches: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=RECENT_BATCHES)

    @property
    def info(self) -> EngineInfo:
        return self._info

    def cost_s(self, batch: int) -> float:
        return self.fixed_cost_s + self.per_sample_s * batch

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        x = inputs["x"]
        batch = int(x.shape[0])
        if batch > self._info.io.max_batch:
            raise ValueError(f"batch {batch} exceeds max_batch {self._info.io.max_batch}")
        self.clock.sleep(self.cost_s(batch))
        with self._lock:
            self.batches.append((batch, tuple(x.shape[1:])))
        return {"y": synthetic_output(np.asarray(x), self.output_items)}

    def close(self) -> None:
        pass
