"""base.py: the CUDA seam — what the TensorRT engine needs from a CUDA binding.

Pinned host memory, device memory, asynchronous copies, streams and events: the small part
of CUDA that feeding an engine takes, behind one interface with two implementations
(:mod:`~carpool.worker.cuda.runtime`, cuda-python, the default; and
:mod:`~carpool.worker.cuda.pycuda_driver`) and a recording fake for tests
(:mod:`~carpool.worker.cuda.fake`).

Rules: a :class:`Cuda` belongs to the thread that opened it (the device's primary context
is made current there); every call from another thread raises :class:`CudaError`. Handles
are plain values (pointers and stream handles as ints) so that TensorRT can take them as
they are. No call allocates unless its name says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray


class CudaError(RuntimeError):
    """A CUDA call failed (its error name in the message), or came from a thread that
    does not own the context."""


class CudaUnavailable(Exception):
    """No CUDA binding imports, or no device answers: the reason is the message."""


@dataclass(frozen=True, slots=True, eq=False)
class HostBuffer:
    """Page-locked host memory: ``array`` (uint8, ``nbytes`` long) views it."""

    ptr: int
    nbytes: int
    array: NDArray[np.uint8]
    native: Any = field(default=None, repr=False)

    def view(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> NDArray[Any]:
        """The first ``prod(shape)`` items of the buffer as an array of ``dtype``."""
        count = int(np.prod(shape, dtype=np.int64))
        return self.array[: count * dtype.itemsize].view(dtype).reshape(shape)


@dataclass(frozen=True, slots=True, eq=False)
class DeviceBuffer:
    """Device memory: ``ptr`` is what ``set_tensor_address`` takes."""

    ptr: int
    nbytes: int
    native: Any = field(default=None, repr=False)


@dataclass(frozen=True, slots=True, eq=False)
class Stream:
    """A non-default, non-blocking stream: ``handle`` is what ``execute_async_v3`` takes."""

    handle: int
    native: Any = field(default=None, repr=False)


@dataclass(frozen=True, slots=True, eq=False)
class Event:
    """An event recorded on a stream: a timing event (``timing``: :meth:`Cuda.elapsed_s`
    times two of them), or a completion event (blocking sync, no timing) that
    :meth:`Cuda.wait` waits for."""

    native: Any = field(repr=False)
    timing: bool = True


class Cuda(Protocol):
    """One CUDA device's primary context, owned by the thread that opened it."""

    #: The binding's name ("cuda-python", "pycuda", "fake").
    name: str
    #: The device's ordinal.
    device: int

    def pinned(self, nbytes: int) -> HostBuffer:
        """Allocate page-locked host memory (async copies need it)."""
        ...

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        """Allocate device memory."""
        ...

    def stream(self) -> Stream:
        """Create a non-blocking stream."""
        ...

    def event(self, *, timing: bool = True) -> Event:
        """Create a timing event, or with ``timing=False`` a completion event: one made
        for :meth:`wait` (blocking sync, no timing, so cheaper to record)."""
        ...

    def to_device(self, dst: DeviceBuffer, src: HostBuffer, nbytes: int, stream: Stream) -> None:
        """Queue a copy of ``src``'s first ``nbytes`` to ``dst`` on ``stream``.

        Raises:
            CudaError: the call failed, or ``nbytes`` is more than either buffer holds
                (:func:`check_copy`).
        """
        ...

    def to_host(self, dst: HostBuffer, src: DeviceBuffer, nbytes: int, stream: Stream) -> None:
        """Queue a copy of ``src``'s first ``nbytes`` to ``dst`` on ``stream``.

        Raises:
            CudaError: the call failed, or ``nbytes`` is more than either buffer holds
                (:func:`check_copy`).
        """
        ...

    def record(self, event: Event, stream: Stream) -> None:
        """Record ``event`` on ``stream``: it completes when the work queued before it does."""
        ...

    def wait(self, done: Event, stream: Stream) -> None:
        """Block the calling thread until ``done``, a completion event recorded as the
        last work queued on ``stream``, has completed: with the GIL released and no core
        spinning, so the worker's other threads run while a batch computes. Each binding
        picks the call that does both: cuda-python synchronizes ``stream`` under the
        blocking-sync schedule it sets at open (``cudaEventSynchronize`` holds the GIL
        before 12.9.1); pycuda synchronizes ``done``, made with ``BLOCKING_SYNC`` (a
        default event may spin)."""
        ...

    def synchronize(self, stream: Stream) -> None:
        """Block the calling thread until the work queued on ``stream`` has completed
        (the GIL released; setup paths and rare waits, not each batch's)."""
        ...

    def elapsed_s(self, start: Event, end: Event) -> float:
        """Seconds of device time from ``start`` to ``end`` (both completed)."""
        ...

    def free(self, buffer: HostBuffer | DeviceBuffer) -> None: ...

    def destroy(self, handle: Stream | Event) -> None: ...

    def close(self) -> None:
        """Release the context (on its own thread); nothing may be used afterwards."""
        ...


class Owner:
    """The thread a context belongs to: :meth:`check` raises on any other."""

    def __init__(self, what: str) -> None:
        import threading

        self._get_ident = threading.get_ident
        self._ident = threading.get_ident()
        self._what = what

    def check(self) -> None:
        if self._get_ident() != self._ident:
            raise CudaError(
                f"{self._what} belongs to the thread that opened it; use it from that thread"
            )


def check_copy(
    what: str, dst: HostBuffer | DeviceBuffer, src: HostBuffer | DeviceBuffer, nbytes: int
) -> None:
    """Raise :class:`CudaError` where a copy of ``nbytes`` would overrun ``dst`` or ``src``
    (CUDA would write past the allocation, or read past it, and say nothing)."""
    if not 0 <= nbytes <= min(dst.nbytes, src.nbytes):
        raise CudaError(
            f"{what}: {nbytes} bytes overrun a buffer (to {dst.nbytes}, from {src.nbytes})"
        )
