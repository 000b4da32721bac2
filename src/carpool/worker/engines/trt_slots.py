"""trt_slots.py: what one TensorRT execution context of the engine owns — its stream,
events and buffers — and the seam it talks to TensorRT through.

A :class:`Slot` is one execution context with its own non-default stream, a pinned host
buffer and a device buffer for every tensor of every profile (sized once, at the
profile's max, from its :class:`~carpool.worker.engines.trt_plan.BufferPlan`), and the
events that time its batches. :class:`OutputStore` is where TensorRT's output allocator
puts outputs whose shape depends on the data: sized to TensorRT's bound up front, grown
only if a run ever asks for more. The TensorRT side is the :class:`PlanAdapter` /
:class:`ContextAdapter` protocols: :mod:`~carpool.worker.engines.trt` implements them on
tensorrt, tests on a recording fake.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from carpool.worker.cuda.base import Cuda, DeviceBuffer, Event, HostBuffer, Stream
from carpool.worker.engines.trt_plan import BufferPlan, Shape, TensorIO

logger = logging.getLogger(__name__)


class OutputStore:
    """Device memory for the data-dependent outputs of one context (TensorRT's
    ``IOutputAllocator`` calls :meth:`reallocate` and :meth:`notify_shape`)."""

    def __init__(self, cuda: Cuda, bounds: Mapping[str, int]) -> None:
        self._cuda = cuda
        self.buffers = {name: cuda.device_buffer(b) for name, b in bounds.items()}
        self.shapes: dict[str, Shape | None] = dict.fromkeys(bounds)
        self.grown = 0  # allocations a run asked for beyond the bound

    def reallocate(self, name: str, nbytes: int) -> int:
        """The address of at least ``nbytes`` for output ``name`` (its buffer, reused)."""
        buffer = self.buffers[name]
        if nbytes > buffer.nbytes:
            logger.warning(
                "output %r needs %d bytes, beyond TensorRT's bound of %d: reallocated",
                name,
                nbytes,
                buffer.nbytes,
            )
            self._cuda.free(buffer)
            buffer = self.buffers[name] = self._cuda.device_buffer(nbytes)
            self.grown += 1
        return buffer.ptr

    def notify_shape(self, name: str, shape: Shape) -> None:
        self.shapes[name] = shape

    def forget_shapes(self) -> None:
        """Before a run: no shape is known until TensorRT tells it again."""
        for name in self.shapes:
            self.shapes[name] = None

    def close(self) -> None:
        for buffer in self.buffers.values():
            self._cuda.free(buffer)
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
    # profile index -> tensor name -> (pinned host, device) buffers; a data-dependent
    # output's device side is in ``store`` (None here)
    buffers: dict[int, dict[str, tuple[HostBuffer, DeviceBuffer | None]]] = field(
        default_factory=dict
    )
    store: OutputStore | None = None
    profile: int | None = None  # the profile selected on the context

    @classmethod
    def make(
        cls, cuda: Cuda, context: ContextAdapter, plans: list[BufferPlan], io: list[TensorIO]
    ) -> Slot:
        """A slot with every buffer of every plan allocated (the only allocations it makes,
        beside an output store growing past TensorRT's bound)."""
        slot = cls(context, cuda.stream(), cuda.event(), cuda.event(timing=False))
        bounds: dict[str, int] = {}
        for plan in plans:
            for name in plan.data_dependent:
                bounds[name] = max(bounds.get(name, 0), plan.nbytes[name])
        if bounds:
            slot.store = OutputStore(cuda, bounds)
            for name in bounds:
                context.set_output_allocator(name, slot.store)
        for plan in plans:
            slot.buffers[plan.profile] = {
                t.name: (
                    cuda.pinned(plan.nbytes[t.name]),
                    None
                    if t.name in plan.data_dependent
                    else cuda.device_buffer(plan.nbytes[t.name]),
                )
                for t in io
            }
        return slot

    def close(self, cuda: Cuda) -> None:
        for buffers in self.buffers.values():
            for host, device in buffers.values():
                cuda.free(host)
                if device is not None:
                    cuda.free(device)
        self.buffers.clear()
        if self.store is not None:
            self.store.close()
        for handle in (self.start, self.done, self.stream):
            cuda.destroy(handle)
