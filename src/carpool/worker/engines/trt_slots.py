"""trt_slots.py: what one TensorRT execution context of the engine owns — its stream,
events and buffers — and the seam it talks to TensorRT through.

A :class:`Slot` is one execution context with its own non-default stream, one pinned host
buffer and one device buffer per tensor, sized once to the largest any profile needs (the
context runs one profile at a time; :func:`~carpool.worker.engines.trt_plan.largest`),
and the events that time its batches. :class:`OutputStore` holds, for outputs whose shape
depends on the data, the pinned and device buffers TensorRT's output allocator hands out:
sized to TensorRT's bound up front, both grown together if a run ever asks for more. What
is made is freed again where making the rest fails (out of memory). The TensorRT side is
the :class:`PlanAdapter` / :class:`ContextAdapter` protocols:
:mod:`~carpool.worker.engines.trt` implements them on tensorrt, tests on a recording fake.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from carpool.worker.cuda.base import Cuda, DeviceBuffer, Event, HostBuffer, Stream
from carpool.worker.engines.trt_plan import BufferPlan, Shape, TensorIO

logger = logging.getLogger(__name__)

#: A tensor's pinned host buffer and its device buffer.
Buffers = tuple[HostBuffer, DeviceBuffer]


def _pair(cuda: Cuda, nbytes: int) -> Buffers:
    """A pinned and a device buffer of ``nbytes`` each (neither left made if one fails)."""
    host = cuda.pinned(nbytes)
    try:
        return host, cuda.device_buffer(nbytes)
    except BaseException:
        cuda.free(host)
        raise


def _free(cuda: Cuda, buffers: Buffers) -> None:
    host, device = buffers
    try:
        cuda.free(device)
    finally:
        cuda.free(host)


class OutputStore:
    """The buffers of the data-dependent outputs of one context: TensorRT's
    ``IOutputAllocator`` calls :meth:`reallocate` and :meth:`notify_shape`; the engine
    copies an output back from its device buffer into its pinned one, which is always at
    least as large."""

    def __init__(self, cuda: Cuda, bounds: Mapping[str, int]) -> None:
        self._cuda = cuda
        self.buffers: dict[str, Buffers] = {}
        try:
            for name, nbytes in bounds.items():
                self.buffers[name] = _pair(cuda, nbytes)
        except BaseException:
            self.close()
            raise
        self.shapes: dict[str, Shape | None] = dict.fromkeys(bounds)
        self.grown = 0  # allocations a run asked for beyond the bound

    def reallocate(self, name: str, nbytes: int) -> int:
        """The device address of at least ``nbytes`` for output ``name`` (its buffer,
        reused; beyond its size, a larger device buffer and a pinned one as large)."""
        old = self.buffers[name]
        if nbytes > old[1].nbytes:
            logger.warning(
                "output %r needs %d bytes, beyond TensorRT's bound of %d: reallocated",
                name,
                nbytes,
                old[1].nbytes,
            )
            # (the new pair first: where it cannot be had, the old one stays whole)
            self.buffers[name] = _pair(self._cuda, nbytes)
            self.grown += 1
            _free(self._cuda, old)
        return self.buffers[name][1].ptr

    def notify_shape(self, name: str, shape: Shape) -> None:
        self.shapes[name] = shape

    def forget_shapes(self) -> None:
        """Before a run: no shape is known until TensorRT tells it again."""
        for name in self.shapes:
            self.shapes[name] = None

    def close(self) -> None:
        with contextlib.ExitStack() as frees:  # (each freed even where one fails)
            for buffers in self.buffers.values():
                frees.callback(_free, self._cuda, buffers)
            self.buffers.clear()


class ContextAdapter(Protocol):
    """One TensorRT execution context (``IExecutionContext``), by tensor name."""

    def set_optimization_profile_async(self, index: int, stream: int) -> None: ...

    def set_input_shape(self, name: str, shape: Shape) -> None: ...

    def get_tensor_shape(self, name: str) -> Shape: ...

    def get_max_output_size(self, name: str) -> int: ...

    def set_tensor_address(self, name: str, ptr: int) -> None: ...

    def set_output_allocator(self, name: str, store: OutputStore) -> None: ...

    def execute_async_v3(self, stream: int) -> bool: ...


class PlanAdapter(Protocol):
    """A deserialized TensorRT engine (``ICudaEngine``)."""

    def tensors(self) -> list[TensorIO]: ...

    def num_optimization_profiles(self) -> int: ...

    def get_tensor_profile_shape(self, name: str, index: int) -> tuple[Shape, Shape, Shape]: ...

    def create_execution_context(self) -> ContextAdapter: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Slot:
    """One execution context and what it owns (see the module docstring)."""

    context: ContextAdapter
    stream: Stream
    start: Event  # recorded just before its batch's execute_async_v3
    done: Event  # completion event, recorded after its batch's copies back to the host
    # tensor name -> (pinned host, device) buffers, for every tensor but the
    # data-dependent outputs (``store``'s)
    buffers: dict[str, Buffers] = field(default_factory=dict)
    store: OutputStore | None = None
    profile: int | None = None  # the profile selected on the context

    @classmethod
    def make(
        cls, cuda: Cuda, context: ContextAdapter, plan: BufferPlan, io: list[TensorIO]
    ) -> Slot:
        """A slot with a buffer pair per tensor of ``plan`` allocated (the only allocations
        it makes, beside an output store growing past TensorRT's bound); where one fails,
        what it made is freed before the error goes on."""
        with contextlib.ExitStack() as made:
            stream = cuda.stream()
            made.callback(cuda.destroy, stream)
            start = cuda.event()
            made.callback(cuda.destroy, start)
            done = cuda.event(timing=False)
            made.callback(cuda.destroy, done)
            slot = cls(context, stream, start, done)
            bounds = {n: plan.nbytes[n] for n in sorted(plan.data_dependent)}
            if bounds:
                slot.store = OutputStore(cuda, bounds)
                made.callback(slot.store.close)
                for name in bounds:
                    context.set_output_allocator(name, slot.store)
            for t in io:
                if t.name not in plan.data_dependent:
                    slot.buffers[t.name] = _pair(cuda, plan.nbytes[t.name])
                    made.callback(_free, cuda, slot.buffers[t.name])
            made.pop_all()
        return slot

    def close(self, cuda: Cuda) -> None:
        """Free the buffers, stream and events (each, even where freeing one fails)."""
        with contextlib.ExitStack() as frees:
            for handle in (self.stream, self.start, self.done):
                frees.callback(cuda.destroy, handle)
            if self.store is not None:
                frees.callback(self.store.close)
            for buffers in self.buffers.values():
                frees.callback(_free, cuda, buffers)
            self.buffers.clear()
            self.store = None
