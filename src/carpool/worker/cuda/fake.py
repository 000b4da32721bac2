"""fake.py: FakeCuda — a recording, deterministic stand-in for the CUDA seam, for tests.

It behaves like a device where it matters to the engine's logic: work queued on a stream
happens only when the host waits for it (a stream synchronised, or an event on it waited
for), so code that reads a pinned buffer before waiting reads stale bytes, as it would on
a GPU. Every call is recorded in :attr:`FakeCuda.calls`. Device time is modelled: a copy
takes ``copy_s``; a kernel (:meth:`FakeCuda.launch`, what a fake TensorRT context queues)
takes the time it is given and waits for the one compute engine, while copies run on
their own copy engine beside it, so one stream's copies overlap another's kernel. The
host's own time is :attr:`FakeCuda.host_s`, advanced by tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carpool.worker.cuda.base import CudaError, DeviceBuffer, Event, HostBuffer, Owner, Stream


@dataclass(slots=True)
class _Op:
    run: Callable[[], None]
    event: int | None = None  # the event this op records, if any


@dataclass(slots=True)
class _StreamState:
    ops: list[_Op] = field(default_factory=list)
    free_at_s: float = 0.0  # device time at which its queued work ends


class FakeCuda:
    """:class:`~carpool.worker.cuda.base.Cuda` in memory (see the module docstring)."""

    name = "fake"

    def __init__(self, device: int = 0, *, copy_s: float = 0.0) -> None:
        self.device = device
        self.copy_s = copy_s
        self.host_s = 0.0
        self.calls: list[tuple[Any, ...]] = []
        self.memory: dict[int, np.ndarray[Any, np.dtype[np.uint8]]] = {}
        self.kernels: list[tuple[int, str, float, float]] = []  # (stream, name, start, end)
        self.closed = False
        self._owner = Owner("fake CUDA device")
        self._ptrs = itertools.count(0x10000, 0x10000)
        self._ids = itertools.count(1)
        self._streams: dict[int, _StreamState] = {}
        self._event_times: dict[int, float | None] = {}  # None: recorded, not yet reached
        self._recorded_on: dict[int, int] = {}  # event → the stream of its last record
        self._compute_free_s = 0.0

    # -- what tests read ---------------------------------------------------------------
    @property
    def allocations(self) -> int:
        """How many buffers, streams and events were created."""
        made = ("pinned", "device_buffer", "stream", "event")
        return sum(1 for c in self.calls if c[0] in made)

    def device_array(self, ptr: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The bytes of the device buffer at ``ptr`` (for fake kernels)."""
        return self.memory[ptr]

    def launch(self, stream: int, name: str, cost_s: float, run: Callable[[], None]) -> None:
        """Queue a kernel on the stream of handle ``stream``, taking ``cost_s`` of device
        time after the kernels queued before it, running ``run`` when reached."""
        self._owner.check()
        state = self._streams[stream]
        start = max(state.free_at_s, self._compute_free_s, self.host_s)
        state.free_at_s = self._compute_free_s = start + cost_s
        self.kernels.append((stream, name, start, start + cost_s))
        self.calls.append(("launch", stream, name))
        state.ops.append(_Op(run))

    def drain(self, stream: int) -> None:
        """Run what the stream of handle ``stream`` has queued (as TensorRT does inside a
        run whose output shapes depend on the data); not recorded."""
        state = self._streams[stream]
        self._drain(state, len(state.ops))

    # -- the interface -------------------------------------------------------------------
    def pinned(self, nbytes: int) -> HostBuffer:
        self._owner.check()
        self.calls.append(("pinned", nbytes))
        ptr = next(self._ptrs)
        array = np.zeros(nbytes, np.uint8)
        self.memory[ptr] = array
        return HostBuffer(ptr, nbytes, array)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        self._owner.check()
        self.calls.append(("device_buffer", nbytes))
        ptr = next(self._ptrs)
        self.memory[ptr] = np.zeros(nbytes, np.uint8)
        return DeviceBuffer(ptr, nbytes)

    def stream(self) -> Stream:
        self._owner.check()
        handle = next(self._ids)
        self.calls.append(("stream", handle))
        self._streams[handle] = _StreamState()
        return Stream(handle)

    def event(self, *, timing: bool = True) -> Event:
        self._owner.check()
        handle = next(self._ids)
        self.calls.append(("event", handle) if timing else ("event", handle, "completion"))
        return Event(handle, timing)

    def _copy(self, what: str, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._owner.check()
        for ptr in (dst, src):
            if ptr not in self.memory:
                raise CudaError(f"{what}: {ptr:#x} is no buffer of this device")
        if nbytes > min(self.memory[dst].size, self.memory[src].size):
            raise CudaError(f"{what}: {nbytes} bytes overrun a buffer")
        self.calls.append((what, dst, src, nbytes, stream.handle))
        state = self._streams[stream.handle]
        state.free_at_s = max(state.free_at_s, self.host_s) + self.copy_s
        target, source = self.memory[dst], self.memory[src]
        state.ops.append(_Op(lambda: target.__setitem__(slice(0, nbytes), source[:nbytes])))

    def to_device(self, dst: DeviceBuffer, src: HostBuffer, nbytes: int, stream: Stream) -> None:
        self._copy("to_device", dst.ptr, src.ptr, nbytes, stream)

    def to_host(self, dst: HostBuffer, src: DeviceBuffer, nbytes: int, stream: Stream) -> None:
        self._copy("to_host", dst.ptr, src.ptr, nbytes, stream)

    def record(self, event: Event, stream: Stream) -> None:
        self._owner.check()
        self.calls.append(("record", event.native, stream.handle))
        state = self._streams[stream.handle]
        state.free_at_s = max(state.free_at_s, self.host_s)
        at_s = state.free_at_s
        self._event_times[event.native] = None
        self._recorded_on[event.native] = stream.handle

        def reach() -> None:
            self._event_times[event.native] = at_s

        state.ops.append(_Op(reach, event.native))

    def wait(self, done: Event, stream: Stream) -> None:
        """As the interface says; raises :class:`CudaError` where the caller breaks its
        contract: a timing event, one last recorded on another stream or never, or work
        queued on ``stream`` after ``done``."""
        self._owner.check()
        self.calls.append(("wait", done.native, stream.handle))
        if done.timing:
            raise CudaError("wait takes a completion event (event(timing=False))")
        if self._recorded_on.get(done.native) != stream.handle:
            raise CudaError("wait: the completion event was not last recorded on this stream")
        state = self._streams[stream.handle]
        if state.ops and state.ops[-1].event != done.native:
            raise CudaError("wait: work was queued on the stream after its completion event")
        self._drain(state, len(state.ops))

    def synchronize(self, stream: Stream) -> None:
        self._owner.check()
        self.calls.append(("synchronize", stream.handle))
        state = self._streams[stream.handle]
        self._drain(state, len(state.ops))

    @staticmethod
    def _drain(state: _StreamState, upto: int) -> None:
        ops, state.ops = state.ops[:upto], state.ops[upto:]
        for op in ops:
            op.run()

    def elapsed_s(self, start: Event, end: Event) -> float:
        self._owner.check()
        self.calls.append(("elapsed_s", start.native, end.native))
        if not (start.timing and end.timing):
            raise CudaError("cudaEventElapsedTime failed: cudaErrorInvalidResourceHandle")
        a = self._event_times.get(start.native)
        b = self._event_times.get(end.native)
        if a is None or b is None:
            raise CudaError("cudaEventElapsedTime failed: cudaErrorNotReady")
        return b - a

    def free(self, buffer: HostBuffer | DeviceBuffer) -> None:
        self._owner.check()
        self.calls.append(("free", buffer.ptr))
        del self.memory[buffer.ptr]

    def destroy(self, handle: Stream | Event) -> None:
        self._owner.check()
        key = handle.handle if isinstance(handle, Stream) else handle.native
        self.calls.append(("destroy", key))

    def close(self) -> None:
        self._owner.check()
        self.calls.append(("close",))
        self.closed = True
