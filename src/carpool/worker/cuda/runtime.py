"""runtime.py: the CUDA seam on cuda-python's runtime API (``cuda.bindings.runtime``).

The default implementation: cuda-python ships wheels for every CUDA 12 and 13 install,
and TensorRT's own Python samples use it. The runtime API works in the device's primary
context, the one TensorRT uses; :func:`open_runtime` makes it current on the calling
thread, which then owns this object. cuda-python 13 removed the old ``from cuda import
cudart`` module; releases of 12.x before ``cuda.bindings`` have only that one, so both
are tried.
"""

from __future__ import annotations

import ctypes
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
)


def _import() -> Any:
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart  # cuda-python 12.x before cuda.bindings

        return cudart
    except ImportError as exc:
        raise CudaUnavailable(f"cuda-python is not installed ({exc})") from None


def _handle(obj: Any) -> int:
    """The integer value of a cuda-python handle (a pointer, a ``cudaStream_t``)."""
    return int(obj)


def _error_name(rt: Any, err: Any) -> str:
    _, name = rt.cudaGetErrorName(err)
    return name.decode() if isinstance(name, bytes) else str(err)


class RuntimeCuda:
    """:class:`~carpool.worker.cuda.base.Cuda` on cuda-python's runtime API."""

    name = "cuda-python"

    def __init__(self, rt: Any, device: int) -> None:
        self._rt = rt
        self.device = device
        self._owner = Owner(f"CUDA device {device} (cuda-python)")
        self._check(rt.cudaSetDevice(device), "cudaSetDevice")
        self._h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost

    def _check(self, result: Any, call: str) -> Any:
        """The value(s) of a cuda-python call returning ``(err, *values)``."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise CudaError(f"{call} failed: {_error_name(self._rt, err)}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def pinned(self, nbytes: int) -> HostBuffer:
        self._owner.check()
        ptr = _handle(self._check(self._rt.cudaMallocHost(max(nbytes, 1)), "cudaMallocHost"))
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
        array = np.ctypeslib.as_array(raw)[:nbytes]
        return HostBuffer(ptr, nbytes, array, native=raw)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        self._owner.check()
        ptr = _handle(self._check(self._rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))
        return DeviceBuffer(ptr, nbytes)

    def stream(self) -> Stream:
        self._owner.check()
        flags = self._rt.cudaStreamNonBlocking
        native = self._check(self._rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreate")
        return Stream(_handle(native), native)

    def event(self) -> Event:
        self._owner.check()
        return Event(self._check(self._rt.cudaEventCreate(), "cudaEventCreate"))

    def to_device(self, dst: DeviceBuffer, src: HostBuffer, nbytes: int, stream: Stream) -> None:
        self._owner.check()
        call = self._rt.cudaMemcpyAsync(dst.ptr, src.ptr, nbytes, self._h2d, stream.native)
        self._check(call, "cudaMemcpyAsync (to device)")

    def to_host(self, dst: HostBuffer, src: DeviceBuffer, nbytes: int, stream: Stream) -> None:
        self._owner.check()
        call = self._rt.cudaMemcpyAsync(dst.ptr, src.ptr, nbytes, self._d2h, stream.native)
        self._check(call, "cudaMemcpyAsync (to host)")

    def record(self, event: Event, stream: Stream) -> None:
        self._owner.check()
        self._check(self._rt.cudaEventRecord(event.native, stream.native), "cudaEventRecord")

    def wait_event(self, event: Event) -> None:
        self._owner.check()
        self._check(self._rt.cudaEventSynchronize(event.native), "cudaEventSynchronize")

    def synchronize(self, stream: Stream) -> None:
        self._owner.check()
        self._check(self._rt.cudaStreamSynchronize(stream.native), "cudaStreamSynchronize")

    def elapsed_s(self, start: Event, end: Event) -> float:
        self._owner.check()
        ms = self._check(
            self._rt.cudaEventElapsedTime(start.native, end.native), "cudaEventElapsedTime"
        )
        return float(ms) / 1000.0

    def free(self, buffer: HostBuffer | DeviceBuffer) -> None:
        self._owner.check()
        if isinstance(buffer, HostBuffer):
            self._check(self._rt.cudaFreeHost(buffer.ptr), "cudaFreeHost")
        else:
            self._check(self._rt.cudaFree(buffer.ptr), "cudaFree")

    def destroy(self, handle: Stream | Event) -> None:
        self._owner.check()
        if isinstance(handle, Stream):
            self._check(self._rt.cudaStreamDestroy(handle.native), "cudaStreamDestroy")
        else:
            self._check(self._rt.cudaEventDestroy(handle.native), "cudaEventDestroy")

    def close(self) -> None:
        self._owner.check()  # the primary context stays, for TensorRT and others in-process


def open_runtime(device: int = 0) -> RuntimeCuda:
    """cuda-python's runtime on ``device``, owned by the calling thread.

    Raises:
        CudaUnavailable: cuda-python is not installed, or no device answers.
    """
    rt = _import()
    err, count = rt.cudaGetDeviceCount()
    if int(err) != 0:
        raise CudaUnavailable(f"no CUDA device (cudaGetDeviceCount: {_error_name(rt, err)})")
    if not 0 <= device < count:
        raise CudaUnavailable(f"no CUDA device {device} (this machine has {count})")
    return RuntimeCuda(rt, device)
