"""pycuda_driver.py: the CUDA seam on pycuda (``pycuda.driver``).

For Jetson setups that have pycuda (built from source against JetPack's CUDA toolkit).
``pycuda.autoinit`` is never used: it makes a new, non-primary context current in the
importing thread only, while TensorRT works in the primary context. :func:`open_pycuda`
retains the device's primary context and pushes it on the calling thread, which owns this
object; :meth:`PyCudaCuda.close` pops it there and releases it, once, even where the pop
fails (a context left on a thread's stack when the thread ends makes pycuda abort).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carpool.worker.cuda.base import (
    CudaError,
    CudaUnavailable,
    DeviceBuffer,
    Event,
    HostBuffer,
    Owner,
    Stream,
    check_copy,
)

_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING


class PyCudaCuda:
    """:class:`~carpool.worker.cuda.base.Cuda` on pycuda's driver API."""

    name = "pycuda"

    def __init__(self, drv: Any, device: int) -> None:
        self._drv = drv
        self.device = device
        self._owner = Owner(f"CUDA device {device} (pycuda)")
        self._context = self._call("retain_primary_context", _retain, drv, device)
        try:
            self._call("Context.push", self._context.push)
        except CudaError:
            self._call("Context.detach", self._context.detach)
            raise
        self._closed = False

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        self._owner.check()
        try:
            return fn(*args)
        except self._drv.Error as exc:
            raise CudaError(f"{what} failed: {exc}") from None

    def pinned(self, nbytes: int) -> HostBuffer:
        # at least one byte, as CUDA may refuse an empty allocation; the view keeps nbytes
        whole = self._call("pagelocked_empty", self._drv.pagelocked_empty, max(nbytes, 1), np.uint8)
        return HostBuffer(int(whole.ctypes.data), nbytes, whole[:nbytes], native=whole.base)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        native = self._call("mem_alloc", self._drv.mem_alloc, max(nbytes, 1))
        return DeviceBuffer(int(native), nbytes, native)

    def stream(self) -> Stream:
        native = self._call("Stream", self._drv.Stream, _NON_BLOCKING)
        return Stream(int(native.handle), native)

    def event(self, *, timing: bool = True) -> Event:
        if timing:
            return Event(self._call("Event", self._drv.Event))
        flags = self._drv.event_flags.BLOCKING_SYNC | self._drv.event_flags.DISABLE_TIMING
        return Event(self._call("Event", self._drv.Event, flags), timing=False)

    def to_device(self, dst: DeviceBuffer, src: HostBuffer, nbytes: int, stream: Stream) -> None:
        self._owner.check()
        check_copy("memcpy_htod_async", dst, src, nbytes)  # pycuda would copy fewer bytes
        self._call(
            "memcpy_htod_async",
            self._drv.memcpy_htod_async,
            dst.ptr,
            src.array[:nbytes],
            stream.native,
        )

    def to_host(self, dst: HostBuffer, src: DeviceBuffer, nbytes: int, stream: Stream) -> None:
        self._owner.check()
        check_copy("memcpy_dtoh_async", dst, src, nbytes)
        self._call(
            "memcpy_dtoh_async",
            self._drv.memcpy_dtoh_async,
            dst.array[:nbytes],
            src.ptr,
            stream.native,
        )

    def record(self, event: Event, stream: Stream) -> None:
        self._call("Event.record", event.native.record, stream.native)

    def wait(self, done: Event, stream: Stream) -> None:
        # pycuda releases the GIL in Event.synchronize; a blocking-sync event does not
        # spin (pycuda cannot set the primary context's schedule flags).
        self._call("Event.synchronize", done.native.synchronize)

    def synchronize(self, stream: Stream) -> None:
        self._call("Stream.synchronize", stream.native.synchronize)

    def elapsed_s(self, start: Event, end: Event) -> float:
        return float(self._call("Event.time_since", end.native.time_since, start.native)) / 1000

    def free(self, buffer: HostBuffer | DeviceBuffer) -> None:
        if isinstance(buffer, DeviceBuffer):
            self._call("DeviceAllocation.free", buffer.native.free)
        else:  # page-locked arrays are freed with their last reference
            self._call("HostAllocation.free", buffer.native.free)

    def destroy(self, handle: Stream | Event) -> None:
        self._owner.check()  # pycuda frees streams and events with their last reference

    def close(self) -> None:
        self._owner.check()
        if self._closed:
            return
        self._closed = True
        try:
            self._call("Context.pop", self._context.pop)
        finally:
            self._call("Context.detach", self._context.detach)


def _retain(drv: Any, device: int) -> Any:
    return drv.Device(device).retain_primary_context()


def open_pycuda(device: int = 0) -> PyCudaCuda:
    """pycuda on ``device``'s primary context, owned by the calling thread.

    Raises:
        CudaUnavailable: pycuda is not installed, or no device answers.
    """
    try:
        import pycuda.driver as drv
    except ImportError as exc:
        raise CudaUnavailable(f"pycuda is not installed ({exc})") from None
    try:
        drv.init()
        count = drv.Device.count()
    except drv.Error as exc:
        raise CudaUnavailable(f"no CUDA device (pycuda: {exc})") from None
    if not 0 <= device < count:
        raise CudaUnavailable(f"no CUDA device {device} (this machine has {count})")
    return PyCudaCuda(drv, device)
