"""trt_engine.py: TensorRTEngine — a serialized TensorRT plan run on a CUDA device.

It never imports tensorrt: it calls TensorRT through the adapter protocols of
:mod:`~carpool.worker.engines.trt_slots` (name based I/O, ``execute_async_v3``), which
:mod:`carpool.worker.engines.trt` implements on tensorrt and the tests on a recording
fake; CUDA goes through :mod:`carpool.worker.cuda`. Its logic:

- the profiles are read back from the plan; each batch runs in the tightest that admits
  its shapes (:func:`~carpool.worker.tensorrt.profiles.select_profile`), and a shape in no
  profile is refused as bad input; the shape rules, ``preferred_batch`` and
  ``max_batch`` it announces are the profiles' (min/max, opt, max batch);
- every buffer is allocated when the engine is made: per execution context, a pinned
  host and a device buffer per tensor, at the largest any profile needs; none per batch
  (what was made is freed again where making the rest fails);
- a plan with shape tensors (values TensorRT reads on the host) is refused;
- two (or more) execution contexts take batches in turn, each on its own stream, so one
  batch's copies run while the batch before it computes (:meth:`TensorRTEngine.enqueue`
  returns before the device is done; :meth:`TensorRTEngine.run` is enqueue then wait);
- outputs whose shape depends on the data go through TensorRT's ``IOutputAllocator``;
- the GPU busy time (:meth:`TensorRTEngine.busy_s`) is measured with CUDA events;
- a batch is collected with :meth:`Cuda.wait <carpool.worker.cuda.base.Cuda.wait>` on its
  completion event and stream, which frees the GIL while the device works;
- :meth:`TensorRTEngine.close` releases the CUDA context whatever fails before it.

The engine belongs to the thread that made it (the CUDA context's owner): the worker's
inference thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Mapping

import numpy as np

from carpool.common.errors import ConfigError
from carpool.common.protocol import TensorMeta
from carpool.common.shape_rules import ShapeRule
from carpool.worker.cuda.base import Cuda, Event, HostBuffer
from carpool.worker.engines.base import Array, BadInput, EngineInfo
from carpool.worker.engines.trt_plan import (
    BufferPlan,
    BusyClock,
    Shape,
    TensorIO,
    largest,
    plan_buffers,
)
from carpool.worker.engines.trt_slots import ContextAdapter, PlanAdapter, Slot
from carpool.worker.shapes import ModelShapes, declare
from carpool.worker.tensorrt.profiles import InputRange, Profile, engine_info, select_profile

#: Execution contexts by default: two let one batch's copies overlap the other's compute.
CONTEXTS = 2


def refuse_shape_tensors(io: list[TensorIO], what: str) -> None:
    """Refuse a plan with shape tensors: TensorRT reads or writes their values in host
    memory, and carpool gives every tensor device memory (a wrong result or a failed run).

    Raises:
        ConfigError: naming the tensors, and what to do.
    """
    host = [t.name for t in io if t.on_host]
    if host:
        raise ConfigError(
            f"{what}: the plan has shape tensors {host} (TensorRT reads their values on "
            "the host), which carpool cannot feed; make them constants of the ONNX model "
            "(or compute them inside it) and rebuild the plan, or serve the model with "
            "ONNX Runtime"
        )


def narrowed(rule: ShapeRule | None, declared: ShapeRule | None) -> ShapeRule | None:
    """``rule`` (the profiles') within ``declared`` (a model config's): the greater min and
    the smaller max of each dim (``-1``: no max), and the declared ``multiple_of``."""
    if rule is None or not declared:
        return rule if rule is not None else declared
    low = declared.min_shape or rule.min_shape
    high = declared.max_shape or rule.max_shape
    return ShapeRule(
        tuple(max(a, b) for a, b in zip(rule.min_shape, low, strict=True)),
        tuple(a if b == -1 else min(a, b) for a, b in zip(rule.max_shape, high, strict=True)),
        declared.multiple_of,
    )


class PendingBatch:
    """A batch queued on the device; :meth:`result` waits for it."""

    def __init__(
        self,
        engine: TensorRTEngine,
        slot: Slot,
        end: Event,
        shapes: dict[str, Shape],
        hosts: dict[str, HostBuffer],
    ):
        self._engine = engine
        self.slot = slot
        self.end = end
        self.shapes = shapes  # output name -> shape (a data-dependent one: once known)
        self.hosts = hosts  # output name -> the pinned buffer its copy back went to
        self.outputs: dict[str, Array] | None = None

    def result(self) -> dict[str, Array]:
        """The batch's outputs (copied out of the pinned buffers, which the next batch on
        this context reuses); every batch queued before it is collected first."""
        while self.outputs is None:
            self._engine._collect_oldest()
        return self.outputs


class TensorRTEngine:
    """Runs a deserialized TensorRT plan (see the module docstring).

    Args:
        plan: the deserialized engine, through its adapter.
        cuda: the CUDA layer, opened on this thread.
        what: how messages name the model.
        contexts: execution contexts (and streams) that take batches in turn.
        shapes: a model config's shape declarations (pads, crops, warm-up shapes); the
            shape rules and warm-up come from the profiles where it declares none.
        owns_cuda: :meth:`close` closes ``cuda`` too.

    Raises:
        ConfigError: the plan has shape tensors, no profile, or no dynamic batch dim.
        CudaError: an allocation failed (what was made is freed and the plan closed;
            ``cuda`` is the caller's to close).
    """

    def __init__(
        self,
        plan: PlanAdapter,
        cuda: Cuda,
        *,
        what: str = "TensorRT engine",
        contexts: int = CONTEXTS,
        shapes: ModelShapes | None = None,
        owns_cuda: bool = True,
    ) -> None:
        if contexts < 1:
            raise ValueError("a TensorRT engine needs at least one execution context")
        self._plan, self._cuda, self._owns_cuda = plan, cuda, owns_cuda
        self._slots: list[Slot] = []
        self._ends: list[Event] = []
        self._queued = 0
        self._in_flight: deque[PendingBatch] = deque()
        self._last_end: Event | None = None
        self._busy = BusyClock()
        try:
            self._make(plan, cuda, what, contexts, shapes)
        except BaseException:
            self._release()
            raise

    def _make(
        self, plan: PlanAdapter, cuda: Cuda, what: str, contexts: int, shapes: ModelShapes | None
    ) -> None:
        """What the constructor makes: its info, contexts, buffers and events."""
        self._io = plan.tensors()
        refuse_shape_tensors(self._io, what)
        self._inputs = [t for t in self._io if t.is_input]
        self._outputs = [t for t in self._io if not t.is_input]
        self.profiles = [
            Profile(
                tuple(
                    InputRange(t.name, *plan.get_tensor_profile_shape(t.name, i))
                    for t in self._inputs
                )
            )
            for i in range(plan.num_optimization_profiles())
        ]
        self._info = engine_info(
            [TensorMeta(t.name, t.dtype, t.shape) for t in self._inputs],
            [TensorMeta(t.name, t.dtype, t.shape) for t in self._outputs],
            self.profiles,
            what,
        )
        if shapes is not None:
            self._info = self._declared(shapes, what)
        first = plan.create_execution_context()
        #: Each profile's buffers at its max (the slots' are the largest of them).
        self.plans = self._plan_buffers(first)
        sizes = largest(self.plans)
        for k in range(contexts):
            context = first if k == 0 else plan.create_execution_context()
            self._slots.append(Slot.make(cuda, context, sizes, self._io))
        # End events in a ring one longer than the contexts: the previous batch's stays
        # unrecorded until the next batch is collected (its gap is timed from it).
        for _ in range(contexts + 1):
            self._ends.append(cuda.event())

    def _declared(self, shapes: ModelShapes, what: str) -> EngineInfo:
        """The profiles' info with a model config's pad rules and crops; its shape rules
        may only narrow the profiles' (a shape no profile admits is refused at the
        broker's door), and its warm-up shapes that some profile admits run after each
        profile's opt shapes."""
        own = self._info
        declared = declare(own, shapes, what)
        own_rules = own.io.rules
        rules = tuple(
            narrowed(rule, mine)
            for rule, mine in zip(
                own_rules, declared.io.rules or (None,) * len(own_rules), strict=True
            )
        )
        names = [t.name for t in own.io.inputs]
        extra = tuple(
            run
            for run in declared.warmup
            if run not in own.warmup
            and any(p.admits(dict(zip(names, run, strict=True))) for p in self.profiles)
        )
        io = dataclasses.replace(declared.io, rules=rules)
        return EngineInfo(io, own.warmup + extra)

    def _plan_buffers(self, context: ContextAdapter) -> list[BufferPlan]:
        """Each profile's buffers, from the output shapes the context gives its max."""
        stream = self._cuda.stream()
        plans = []
        try:
            for index, profile in enumerate(self.profiles):
                context.set_optimization_profile_async(index, stream.handle)
                for t in self._inputs:
                    context.set_input_shape(t.name, profile.range_of(t.name).max)
                shapes = {t.name: context.get_tensor_shape(t.name) for t in self._outputs}
                bounds = {n: context.get_max_output_size(n) for n, s in shapes.items() if -1 in s}
                plans.append(plan_buffers(self._io, profile, shapes, bounds))
            self._cuda.synchronize(stream)
        finally:
            self._cuda.destroy(stream)
        return plans

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def contexts(self) -> int:
        """Batches that may be queued at once (one per execution context): the worker's
        inference thread queues up to this many before it collects the oldest."""
        return len(self._slots)

    def busy_s(self) -> float:
        """GPU seconds spent computing batches collected so far (CUDA events)."""
        return self._busy.total_s

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        return self.enqueue(inputs).result()

    def enqueue(self, inputs: Mapping[str, Array]) -> PendingBatch:
        """Queue one batch on the next execution context and return without waiting for
        the device (only for that context's previous batch, if it is still queued).

        Raises:
            BadInput: an input is missing, or the shapes lie outside every profile.
        """
        missing = [t.name for t in self._inputs if t.name not in inputs]
        if missing:
            raise BadInput(f"missing inputs {missing}")
        shapes = {t.name: tuple(int(d) for d in np.shape(inputs[t.name])) for t in self._inputs}
        profile = select_profile(self.profiles, shapes)
        slot = self._slots[self._queued % len(self._slots)]
        while any(p.slot is slot for p in self._in_flight):
            self._collect_oldest()
        cuda, stream, context = self._cuda, slot.stream, slot.context
        if slot.profile != profile:
            context.set_optimization_profile_async(profile, stream.handle)
            slot.profile = profile
        buffers = slot.buffers
        for t in self._inputs:
            host, device = buffers[t.name]
            view = host.view(np.dtype(t.dtype), shapes[t.name])
            np.copyto(view, inputs[t.name], casting="same_kind")
            cuda.to_device(device, host, view.nbytes, stream)
            context.set_input_shape(t.name, shapes[t.name])
            context.set_tensor_address(t.name, device.ptr)
        out_shapes: dict[str, Shape] = {}
        for t in self._outputs:
            if t.name in buffers:  # (a data-dependent output's address: its allocator's)
                out_shapes[t.name] = context.get_tensor_shape(t.name)
                context.set_tensor_address(t.name, buffers[t.name][1].ptr)
        if slot.store is not None:
            slot.store.forget_shapes()
        cuda.record(slot.start, stream)
        if not context.execute_async_v3(stream.handle):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        end = self._ends[self._queued % len(self._ends)]
        cuda.record(end, stream)
        hosts = self._copy_back(slot, out_shapes)
        cuda.record(slot.done, stream)
        self._queued += 1
        pending = PendingBatch(self, slot, end, out_shapes, hosts)
        self._in_flight.append(pending)
        return pending

    def _copy_back(self, slot: Slot, out_shapes: dict[str, Shape]) -> dict[str, HostBuffer]:
        """Queue every output's copy to its pinned buffer; the buffers, by output (a
        data-dependent output's are its allocator's, as large as TensorRT last asked for;
        its shape is known once TensorRT has told the allocator: after the run, if not
        during it)."""
        hosts = {}
        for t in self._outputs:
            if t.name in slot.buffers:
                host, device = slot.buffers[t.name]
            else:
                store = slot.store
                assert store is not None  # (a data-dependent output has one)
                if store.shapes[t.name] is None:
                    self._cuda.synchronize(slot.stream)
                shape = store.shapes[t.name]
                if shape is None:
                    raise RuntimeError(f"TensorRT gave no shape for output {t.name!r}")
                out_shapes[t.name] = shape
                host, device = store.buffers[t.name]
            nbytes = int(np.prod(out_shapes[t.name], dtype=np.int64)) * np.dtype(t.dtype).itemsize
            if nbytes > min(host.nbytes, device.nbytes):  # (a copy past a buffer corrupts)
                raise RuntimeError(
                    f"TensorRT gave output {t.name!r} shape {list(out_shapes[t.name])}: "
                    f"{nbytes} bytes, more than its buffer's {min(host.nbytes, device.nbytes)}"
                )
            self._cuda.to_host(host, device, nbytes, slot.stream)
            hosts[t.name] = host
        return hosts

    def _collect_oldest(self) -> None:
        """Wait for the oldest queued batch, time it, and copy its outputs out."""
        pending = self._in_flight.popleft()
        slot, cuda = pending.slot, self._cuda
        cuda.wait(slot.done, slot.stream)
        compute_s = cuda.elapsed_s(slot.start, pending.end)
        gap_s = None if self._last_end is None else cuda.elapsed_s(self._last_end, slot.start)
        self._busy.add(compute_s, gap_s)
        self._last_end = pending.end
        pending.outputs = {
            t.name: pending.hosts[t.name].view(np.dtype(t.dtype), pending.shapes[t.name]).copy()
            for t in self._outputs
        }

    def close(self) -> None:
        """Collect the batches still queued, free what the engine made, close the plan
        and (``owns_cuda``) release the CUDA context: each step runs even where one before
        it fails (a sticky CUDA error after a kernel fault fails every call), and the
        context is released last, with no stream or event of the engine's left behind;
        the error then goes on."""
        with contextlib.ExitStack() as steps:  # (its callbacks run last first)
            if self._owns_cuda:
                steps.callback(self._cuda.close)
            steps.callback(self._release)
            while self._in_flight:
                self._collect_oldest()

    def _release(self) -> None:
        """Free the slots and end events, forget the batches in flight, close the plan;
        each step even where one before it fails."""
        self._in_flight.clear()
        self._last_end = None
        slots, self._slots = self._slots, []
        ends, self._ends = self._ends, []
        with contextlib.ExitStack() as steps:
            steps.callback(self._plan.close)
            for event in ends:
                steps.callback(self._cuda.destroy, event)
            for slot in slots:
                steps.callback(slot.close, self._cuda)
