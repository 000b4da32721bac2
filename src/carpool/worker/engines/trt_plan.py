"""trt_plan.py: what a TensorRT engine's profiles mean for serving it — pure.

A serialized plan has one or more optimization profiles, each a min/opt/max shape per
input. From them: the profile a batch runs in (:func:`select_profile`, the tightest that
admits every input's shape, or a refusal naming the dim), what the worker announces
(:func:`engine_info`: ``preferred_batch`` from the opt batch sizes, ``max_batch`` and the
shape rules from the min/max, a warm-up run at every profile's opt shapes), the bytes of
every buffer a profile needs at its max (:func:`plan_buffers`) and the GPU busy time of
batches timed with CUDA events (:class:`BusyClock`). No tensorrt, no CUDA: the engine in
:mod:`carpool.worker.engines.trt` feeds these from its adapter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from carpool.common.errors import ConfigError
from carpool.common.protocol import TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.base import BadInput, EngineInfo

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


@dataclass(frozen=True, slots=True)
class Profile:
    """One optimization profile: per input name, its (min, opt, max) shapes."""

    index: int
    shapes: Mapping[str, tuple[Shape, Shape, Shape]]

    def refusal(self, shapes: Mapping[str, Shape]) -> str | None:
        """Why ``shapes`` (per input) lie outside this profile, or None when inside."""
        for name, (low, _, high) in self.shapes.items():
            shape = shapes[name]
            if len(shape) != len(low):
                return f"input {name!r} has {len(shape)} dims, the engine takes {len(low)}"
            for d, (n, lo, hi) in enumerate(zip(shape, low, high, strict=True)):
                if not lo <= n <= hi:
                    what = "the batch (dim 0)" if d == 0 else f"dim {d}"
                    return f"input {name!r}: {what} is {n}, profile {self.index} takes {lo}..{hi}"
        return None

    def max_volume(self) -> int:
        return sum(math.prod(high) for _, _, high in self.shapes.values())

    def opt(self, name: str) -> Shape:
        return self.shapes[name][1]

    def max(self, name: str) -> Shape:
        return self.shapes[name][2]


def select_profile(profiles: Sequence[Profile], shapes: Mapping[str, Shape]) -> Profile:
    """The profile a batch of these input shapes runs in: of those that admit it, the one
    whose max shapes are smallest (kernels tuned for the nearest sizes), the first on a tie.

    Raises:
        BadInput: no profile admits the shapes (the message gives each one's reason).
    """
    admitting = [p for p in profiles if p.refusal(shapes) is None]
    if not admitting:
        reasons = "; ".join(str(p.refusal(shapes)) for p in profiles)
        raise BadInput(f"the shapes lie outside every optimization profile: {reasons}")
    return min(admitting, key=lambda p: (p.max_volume(), p.index))


def engine_info(io: Sequence[TensorIO], profiles: Sequence[Profile], what: str) -> EngineInfo:
    """What a worker announces for a plan with these tensors and profiles.

    ``max_batch`` is the largest max batch of any profile, ``preferred_batch`` the profiles'
    opt batch sizes, each input's shape rule the span of its profiles' min..max, and the
    warm-up one run per profile at its opt shapes. Between profiles that do not touch, a
    shape inside the span but in no profile passes the broker and is refused by the engine.

    Raises:
        ConfigError: no profiles, or a tensor without a dynamic batch dim.
    """
    if not profiles:
        raise ConfigError(f"{what}: the plan has no optimization profile")
    inputs = [t for t in io if t.is_input]
    for t in io:
        if not t.shape or t.shape[0] != -1:
            kind = "input" if t.is_input else "output"
            raise ConfigError(
                f"{what}: {kind} {t.name!r} has shape {list(t.shape)}; carpool needs a "
                "dynamic batch dim 0 (build the engine from an ONNX model whose dim 0 is "
                "symbolic)"
            )
    batch_max = [min(p.max(t.name)[0] for t in inputs) for p in profiles]
    preferred = sorted({min(p.opt(t.name)[0] for t in inputs) for p in profiles})
    rules = tuple(
        ShapeRule(
            min_shape=tuple(
                min(d) for d in zip(*(p.shapes[t.name][0] for p in profiles), strict=True)
            ),
            max_shape=tuple(max(d) for d in zip(*(p.max(t.name) for p in profiles), strict=True)),
        )
        for t in inputs
    )
    return EngineInfo(
        inputs=tuple(TensorMeta(t.name, t.dtype, t.shape) for t in inputs),
        outputs=tuple(TensorMeta(t.name, t.dtype, t.shape) for t in io if not t.is_input),
        max_batch=max(batch_max),
        preferred_batch=tuple(preferred),
        rules=rules,
        warmup=tuple(tuple(p.opt(t.name) for t in inputs) for p in profiles),
    )


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """The bytes of every tensor's buffers in one profile, at its max shapes. Outputs in
    ``data_dependent`` have shapes only a run knows (their size is TensorRT's bound)."""

    profile: int
    nbytes: Mapping[str, int]
    data_dependent: frozenset[str] = frozenset()


def plan_buffers(
    io: Sequence[TensorIO],
    profile: Profile,
    output_shapes: Mapping[str, Shape],
    output_bounds: Mapping[str, int],
) -> BufferPlan:
    """The buffers ``profile`` needs: each input at its max shape, each output at the shape
    the engine gives it for those inputs (``output_shapes``), or, where that shape still
    has a ``-1`` (it depends on the data), the byte bound in ``output_bounds``."""
    nbytes: dict[str, int] = {}
    dynamic = set()
    for t in io:
        itemsize = np.dtype(t.dtype).itemsize
        shape = profile.max(t.name) if t.is_input else output_shapes[t.name]
        if -1 in shape:
            dynamic.add(t.name)
            nbytes[t.name] = output_bounds[t.name]
        else:
            nbytes[t.name] = math.prod(shape) * itemsize
    return BufferPlan(profile.index, nbytes, frozenset(dynamic))


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
