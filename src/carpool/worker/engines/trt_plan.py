"""trt_plan.py: a TensorRT plan's tensors and buffers, and its busy time — pure.

A plan's I/O tensors (:class:`TensorIO`, their TensorRT types as numpy's:
:func:`numpy_dtype`), the bytes of every buffer one optimization profile needs at its max
(:func:`plan_buffers`), the one buffer set that serves every profile (:func:`largest`)
and the GPU busy time of batches timed with CUDA events (:class:`BusyClock`). The
profiles themselves, the choice of one per batch and what the worker announces are
:mod:`carpool.worker.tensorrt.profiles`'. No tensorrt, no CUDA: the engine
(:mod:`carpool.worker.engines.trt_engine`) feeds these from its adapter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from carpool.common.errors import ConfigError
from carpool.worker.tensorrt.profiles import Profile

Shape = tuple[int, ...]

#: TensorRT ``DataType`` member names → numpy dtype names (the ones carpool serves).
DTYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "INT8": "int8",
    "UINT8": "uint8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
}


def numpy_dtype(trt_name: str, tensor: str) -> str:
    """The numpy dtype of a TensorRT ``DataType`` name.

    Raises:
        ConfigError: carpool cannot carry that type (BF16, FP8, ...).
    """
    dtype = DTYPES.get(trt_name)
    if dtype is None:
        raise ConfigError(
            f"tensor {tensor!r} has TensorRT type {trt_name}, which carpool cannot carry "
            f"(it carries {', '.join(DTYPES)}); cast it in the ONNX model"
        )
    return dtype


@dataclass(frozen=True, slots=True)
class TensorIO:
    """One I/O tensor of a plan: ``-1`` marks a dynamic dim (dim 0 is the batch)."""

    name: str
    is_input: bool
    dtype: str  # numpy dtype name
    shape: Shape
    # A shape tensor: TensorRT reads or writes its values in host memory (shape-inference
    # I/O, or a tensor it places on the host), where carpool hands it device memory.
    on_host: bool = False


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """The bytes of every tensor's buffers in one profile, at its max shapes (or in every
    profile: :func:`largest`). Outputs in ``data_dependent`` have shapes only a run knows
    (their size is TensorRT's bound)."""

    nbytes: Mapping[str, int]
    data_dependent: frozenset[str] = frozenset()


def plan_buffers(
    io: Sequence[TensorIO],
    profile: Profile,
    output_shapes: Mapping[str, Shape],
    output_bounds: Mapping[str, int],
) -> BufferPlan:
    """The buffers ``profile`` needs: each input at its max shape, each
    output at the shape the engine gives it for those inputs (``output_shapes``), or,
    where that shape still has a ``-1`` (it depends on the data), the byte bound in
    ``output_bounds``."""
    nbytes: dict[str, int] = {}
    dynamic = set()
    for t in io:
        itemsize = np.dtype(t.dtype).itemsize
        shape = profile.range_of(t.name).max if t.is_input else output_shapes[t.name]
        if -1 in shape:
            dynamic.add(t.name)
            nbytes[t.name] = output_bounds[t.name]
        else:
            nbytes[t.name] = math.prod(shape) * itemsize
    return BufferPlan(nbytes, frozenset(dynamic))


def largest(plans: Sequence[BufferPlan]) -> BufferPlan:
    """One buffer set that serves every profile of ``plans``: each tensor at the most any
    profile needs (an execution context runs one profile at a time, so it needs one set);
    an output whose shape depends on the data in any profile is data dependent."""
    nbytes: dict[str, int] = {}
    for plan in plans:
        for name, size in plan.nbytes.items():
            nbytes[name] = max(nbytes.get(name, 0), size)
    return BufferPlan(nbytes, frozenset().union(*(p.data_dependent for p in plans)))


@dataclass(slots=True)
class BusyClock:
    """GPU busy seconds of batches timed with CUDA events, counting time that two batches'
    kernels overlap (on two contexts) once.

    Each batch is added, in the order it was queued, as its compute time (from an event
    before its ``execute_async_v3`` to one after) and its gap: device time from the
    previous batch's end event to its start event, negative where it started before that
    one ended.
    """

    total_s: float = 0.0
    # How far the busy span's end lies beyond the last batch's end event.
    _ahead_s: float = 0.0

    def add(self, compute_s: float, gap_s: float | None) -> float:
        """Count one batch; returns the busy time it added (``gap_s`` None: the first)."""
        gap = math.inf if gap_s is None else gap_s - self._ahead_s
        added = compute_s if gap >= 0 else compute_s - min(compute_s, -gap)
        self._ahead_s = max(0.0, -(gap + compute_s))
        self.total_s += added
        return added
