"""runtime.py: the CUDA seam on cuda-python's runtime API (``cuda.bindings.runtime``).

The default implementation: cuda-python ships wheels for every CUDA 12 and 13 install,
and TensorRT's own Python samples use it. The runtime API works in the device's primary
context, the one TensorRT uses; :func:`open_runtime` makes it current on the calling
thread, which then owns this object. cuda-python 13 removed the old ``from cuda import
cudart`` module; releases of 12.x before ``cuda.bindings`` have only that one, so both
are tried. Handles become ints through ``cuda.bindings.utils.get_cuda_native_handle``
where the release has it (``int()`` on a handle is deprecated there), else ``int()``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
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

logger = logging.getLogger(__name__)

#: What turns a cuda-python handle object (a ``cudaStream_t``) into its address.
NativeHandle = Callable[[Any], int]


def _import() -> tuple[Any, NativeHandle]:
    """The runtime module, and the function that gives a handle's address."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        pass
    else:
        try:
            from cuda.bindings.utils import get_cuda_native_handle
        except ImportError:  # before 12.9.1 / 13.0.0
            return runtime, int
        return runtime, get_cuda_native_handle
    try:
        from cuda import cudart  # cuda-python 12.x before cuda.bindings
    except ImportError as exc:
        raise CudaUnavailable(f"cuda-python is not installed ({exc})") from None
    return cudart, int


def _error_name(rt: Any, err: Any) -> str:
    _, name = rt.cudaGetErrorName(err)
    return name.decode() if isinstance(name, bytes) else str(err)


class RuntimeCuda:
    """:class:`~carpool.worker.cuda.base.Cuda` on cuda-python's runtime API."""

    name = "cuda-python"

    def __init__(self, rt: Any, device: int, *, handle: NativeHandle = int) -> None:
        self._rt = rt
        self._handle = handle
        self.device = device
        self._owner = Owner(f"CUDA device {device} (cuda-python)")
        self._check(rt.cudaSetDevice(device), "cudaSetDevice")
        self._block_on_waits()
        self._h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost

    def _block_on_waits(self) -> None:
        """Make waits block on a synchronization primitive instead of spinning a core (the
        default, cudaDeviceScheduleAuto, spins on a dGPU with fewer contexts than CPUs).
        The flags are the primary context's: TensorRT's own waits block the same way.

        A failure is logged and passed over: the flag decides how the host thread waits,
        not what the device computes, and :meth:`wait` releases the GIL without it. A
        core spinning through each batch costs less than refusing TensorRT for ONNX
        Runtime; and a device that is really broken fails its next call anyway.
        """
        err = self._rt.cudaSetDeviceFlags(self._rt.cudaDeviceScheduleBlockingSync)
        err = err[0] if isinstance(err, tuple) else err
        if int(err) != 0:
            logger.warning(
                "cuda device=%d: cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) "
                "failed (%s): each batch's wait may spin a core",
                self.device,
                _error_name(self._rt, err),
            )

    def _check(self, result: Any, call: str) -> Any:
        """The value(s) of a cuda-python call returning ``(err, *values)``."""
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise CudaError(f"{call} failed: {_error_name(self._rt, err)}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _call(self, fn: str, *args: Any, what: str = "") -> Any:
        """The runtime's ``fn(*args)`` on the owning thread, checked (:meth:`_check`) and
        named ``what`` (default ``fn``) in its error."""
        self._owner.check()
        return self._check(getattr(self._rt, fn)(*args), what or fn)

    def pinned(self, nbytes: int) -> HostBuffer:
        ptr = int(self._call("cudaMallocHost", max(nbytes, 1)))
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
        array = np.ctypeslib.as_array(raw)[:nbytes]
        return HostBuffer(ptr, nbytes, array, native=raw)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        ptr = int(self._call("cudaMalloc", max(nbytes, 1)))
        return DeviceBuffer(ptr, nbytes)

    def stream(self) -> Stream:
        flags = self._rt.cudaStreamNonBlocking
        native = self._call("cudaStreamCreateWithFlags", flags, what="cudaStreamCreate")
        return Stream(self._handle(native), native)

    def event(self, *, timing: bool = True) -> Event:
        if timing:
            return Event(self._call("cudaEventCreate"))
        flags = self._rt.cudaEventBlockingSync | self._rt.cudaEventDisableTiming
        return Event(self._call("cudaEventCreateWithFlags", flags), timing=False)

    def to_device(self, dst: DeviceBuffer, src: HostBuffer, nbytes: int, stream: Stream) -> None:
        self._copy("to device", dst, src, nbytes, self._h2d, stream)

    def to_host(self, dst: HostBuffer, src: DeviceBuffer, nbytes: int, stream: Stream) -> None:
        self._copy("to host", dst, src, nbytes, self._d2h, stream)

    def _copy(
        self,
        way: str,
        dst: HostBuffer | DeviceBuffer,
        src: HostBuffer | DeviceBuffer,
        nbytes: int,
        kind: Any,
        stream: Stream,
    ) -> None:
        what = f"cudaMemcpyAsync ({way})"
        self._owner.check()
        check_copy(what, dst, src, nbytes)  # the runtime would copy past the buffer
        self._call("cudaMemcpyAsync", dst.ptr, src.ptr, nbytes, kind, stream.native, what=what)

    def record(self, event: Event, stream: Stream) -> None:
        self._call("cudaEventRecord", event.native, stream.native)

    def wait(self, done: Event, stream: Stream) -> None:
        # cudaStreamSynchronize releases the GIL in every cuda-python release;
        # cudaEventSynchronize holds it up to 12.9.0 (docs/gpu.md). ``done`` is the last
        # work on ``stream``, so waiting for the stream is waiting for it; with the
        # blocking-sync schedule set at open, the wait does not spin.
        self._call("cudaStreamSynchronize", stream.native)

    def synchronize(self, stream: Stream) -> None:
        self._call("cudaStreamSynchronize", stream.native)

    def elapsed_s(self, start: Event, end: Event) -> float:
        ms = self._call("cudaEventElapsedTime", start.native, end.native)
        return float(ms) / 1000.0

    def free(self, buffer: HostBuffer | DeviceBuffer) -> None:
        if isinstance(buffer, HostBuffer):
            self._call("cudaFreeHost", buffer.ptr)
        else:
            self._call("cudaFree", buffer.ptr)

    def destroy(self, handle: Stream | Event) -> None:
        if isinstance(handle, Stream):
            self._call("cudaStreamDestroy", handle.native)
        else:
            self._call("cudaEventDestroy", handle.native)

    def close(self) -> None:
        self._owner.check()  # the primary context stays, for TensorRT and others in-process


def open_runtime(device: int = 0) -> RuntimeCuda:
    """cuda-python's runtime on ``device``, owned by the calling thread.

    Raises:
        CudaUnavailable: cuda-python is not installed, or no device answers.
    """
    rt, handle = _import()
    try:
        err, count = rt.cudaGetDeviceCount()
        reason = _error_name(rt, err) if int(err) != 0 else ""
    except (RuntimeError, OSError) as exc:  # cuda-python 12.6.0 raises with no libcuda.so.1
        raise CudaUnavailable(f"no CUDA driver (cudaGetDeviceCount: {exc})") from None
    if reason:
        raise CudaUnavailable(f"no CUDA device (cudaGetDeviceCount: {reason})")
    if not 0 <= device < count:
        raise CudaUnavailable(f"no CUDA device {device} (this machine has {count})")
    return RuntimeCuda(rt, device, handle=handle)
