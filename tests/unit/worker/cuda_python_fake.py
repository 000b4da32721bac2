# cuda-python's names, as the binding calls them
# ruff: noqa: N801, N802, N815
"""A recording fake of cuda-python's runtime module (``cuda.bindings.runtime``, or
``cuda.cudart`` before 12.6.1): the part :mod:`carpool.worker.cuda.runtime` calls, with
cuda-python's names, constants and return shapes (checked against cuda-bindings 13.0.0
and 12.9.0 and cuda-python 12.6.0):

- every call returns a tuple, the error first: ``(err,)`` or ``(err, value)``, the value
  None on an error; errors are ``cudaError_t`` members (an ``IntEnum``), named by
  ``cudaGetErrorName(err)`` → ``(cudaSuccess, b"cudaErrorXxx")``, which refuses a plain
  int (AttributeError: it reads ``err.value``).
- pointers are plain ints; streams and events are handle objects (``cudaStream_t``,
  ``cudaEvent_t``) whose ``int()`` still works but is deprecated from 12.9.1 / 13.0.0 for
  ``cuda.bindings.utils.get_cuda_native_handle``, which refuses a plain int (TypeError);
  the fake counts each ``int()`` of a handle in :attr:`FakeRuntime.ints`.
- the constants ``cudaStreamNonBlocking`` (1), ``cudaDeviceScheduleBlockingSync`` (4),
  ``cudaEventBlockingSync`` (1), ``cudaEventDisableTiming`` (2) and
  ``cudaMemcpyKind.cudaMemcpyHostToDevice`` / ``DeviceToHost``.

Its device: copies queued on a stream run when the host waits for it (the stream, or an
event recorded on it), one millisecond of device time each. Host pointers must be ones it
allocated (it reads and writes memory through them). Every call is recorded in
:attr:`FakeRuntime.calls`; a call named in :attr:`FakeRuntime.failing` returns that error.
:func:`installed` puts it where ``open_runtime`` imports it from.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.unit.worker.fake_modules import modules_replaced


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInsufficientDriver = 35
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600


SUCCESS, INVALID_VALUE = cudaError_t.cudaSuccess, cudaError_t.cudaErrorInvalidValue
MEMORY_ALLOCATION, NOT_READY = cudaError_t.cudaErrorMemoryAllocation, cudaError_t.cudaErrorNotReady
INSUFFICIENT_DRIVER = cudaError_t.cudaErrorInsufficientDriver
INVALID_HANDLE = cudaError_t.cudaErrorInvalidResourceHandle


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


class _Handle:
    """A cuda-python handle object (``cudaStream_t``, ``cudaEvent_t``)."""

    def __init__(self, runtime: FakeRuntime, address: int) -> None:
        self.runtime, self.address = runtime, address

    def __int__(self) -> int:
        self.runtime.ints.append(self.address)
        return self.address


class cudaStream_t(_Handle):
    def __init__(self, runtime: FakeRuntime, address: int) -> None:
        super().__init__(runtime, address)
        self.ops: list[Callable[[], None]] = []

    def run(self, upto: int | None = None) -> None:
        upto = len(self.ops) if upto is None else upto
        ops, self.ops = self.ops[:upto], self.ops[upto:]
        for op in ops:
            op()


class cudaEvent_t(_Handle):
    def __init__(self, runtime: FakeRuntime, address: int, flags: int) -> None:
        super().__init__(runtime, address)
        self.flags = flags
        self.at_ms: float | None = None
        self.stream: cudaStream_t | None = None
        self.mark: Callable[[], None] | None = None


def get_cuda_native_handle(obj: Any) -> int:
    """``cuda.bindings.utils.get_cuda_native_handle``: a handle object's address."""
    if not isinstance(obj, _Handle):
        raise TypeError(f"Unknown type: {type(obj)}")
    return obj.address


class FakeRuntime(types.ModuleType):
    """cuda-python's runtime module over a fake device with ``devices`` GPUs (see the
    module docstring)."""

    cudaMemcpyKind = cudaMemcpyKind
    cudaStreamNonBlocking = 1
    cudaDeviceScheduleBlockingSync = 4
    cudaEventBlockingSync = 1
    cudaEventDisableTiming = 2

    def __init__(self, devices: int = 1, *, count_error: int = SUCCESS) -> None:
        super().__init__("cuda.bindings.runtime")
        self.cudaError_t = cudaError_t
        self.devices = devices
        self.count_error = cudaError_t(count_error)
        #: raised by cudaGetDeviceCount, as cuda-python 12.6.0 does with no libcuda.so.1
        self.count_raises: BaseException | None = None
        #: call name → the error that call returns (a cudaError_t value)
        self.failing: dict[str, int] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.ints: list[int] = []
        self.host: dict[int, ctypes.Array[ctypes.c_uint8]] = {}
        self.device_memory: dict[int, bytearray] = {}
        self.device_ms = 0.0
        self._ptrs = itertools.count(0x7F0000000000, 0x100000)
        self._handles = itertools.count(0x5000, 0x10)

    def _note(self, *call: Any) -> cudaError_t:
        self.calls.append(call)
        return cudaError_t(self.failing.get(call[0], SUCCESS))

    def cudaGetErrorName(self, err: cudaError_t) -> tuple[cudaError_t, bytes]:
        value = err.value  # a plain int has none: AttributeError, as cuda-python raises
        return SUCCESS, cudaError_t(value).name.encode()

    def cudaGetDeviceCount(self) -> tuple[cudaError_t, int | None]:
        self.calls.append(("cudaGetDeviceCount",))
        if self.count_raises is not None:
            raise self.count_raises
        if self.count_error:
            return self.count_error, None
        return SUCCESS, self.devices

    def cudaSetDevice(self, device: int) -> tuple[cudaError_t]:
        return (self._note("cudaSetDevice", device),)

    def cudaSetDeviceFlags(self, flags: int) -> tuple[cudaError_t]:
        return (self._note("cudaSetDeviceFlags", flags),)

    def cudaMallocHost(self, size: int) -> tuple[cudaError_t, int | None]:
        err = self._note("cudaMallocHost", size) or (INVALID_VALUE if size == 0 else SUCCESS)
        if err:
            return err, None
        raw = (ctypes.c_uint8 * size)()
        self.host[ctypes.addressof(raw)] = raw
        return SUCCESS, ctypes.addressof(raw)

    def cudaMalloc(self, size: int) -> tuple[cudaError_t, int | None]:
        err = self._note("cudaMalloc", size) or (INVALID_VALUE if size == 0 else SUCCESS)
        if err:
            return err, None
        ptr = next(self._ptrs)
        self.device_memory[ptr] = bytearray(size)
        return SUCCESS, ptr

    def cudaFreeHost(self, ptr: int) -> tuple[cudaError_t]:
        err = self._note("cudaFreeHost", ptr)
        return (err or (SUCCESS if self.host.pop(ptr, None) is not None else INVALID_VALUE),)

    def cudaFree(self, ptr: int) -> tuple[cudaError_t]:
        err = self._note("cudaFree", ptr)
        found = self.device_memory.pop(ptr, None) is not None
        return (err or (SUCCESS if found else INVALID_VALUE),)

    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[cudaError_t, cudaStream_t | None]:
        err = self._note("cudaStreamCreateWithFlags", flags)
        return (err, None) if err else (SUCCESS, cudaStream_t(self, next(self._handles)))

    def cudaStreamDestroy(self, stream: cudaStream_t) -> tuple[cudaError_t]:
        return (self._note("cudaStreamDestroy", stream.address),)

    def cudaStreamSynchronize(self, stream: cudaStream_t) -> tuple[cudaError_t]:
        err = self._note("cudaStreamSynchronize", stream.address)
        if not err:
            stream.run()
        return (err,)

    def cudaEventCreate(self) -> tuple[cudaError_t, cudaEvent_t | None]:
        err = self._note("cudaEventCreate")
        return (err, None) if err else (SUCCESS, cudaEvent_t(self, next(self._handles), 0))

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[cudaError_t, cudaEvent_t | None]:
        err = self._note("cudaEventCreateWithFlags", flags)
        return (err, None) if err else (SUCCESS, cudaEvent_t(self, next(self._handles), flags))

    def cudaEventDestroy(self, event: cudaEvent_t) -> tuple[cudaError_t]:
        return (self._note("cudaEventDestroy", event.address),)

    def cudaEventRecord(self, event: cudaEvent_t, stream: cudaStream_t) -> tuple[cudaError_t]:
        err = self._note("cudaEventRecord", event.address, stream.address)
        if err:
            return (err,)
        event.at_ms = None

        def reach() -> None:
            event.at_ms = self.device_ms

        stream.ops.append(reach)
        event.stream, event.mark = stream, reach
        return (SUCCESS,)

    def cudaEventSynchronize(self, event: cudaEvent_t) -> tuple[cudaError_t]:
        err = self._note("cudaEventSynchronize", event.address)
        stream = event.stream
        if not err and stream is not None and event.mark in stream.ops:
            stream.run(stream.ops.index(event.mark) + 1)
        return (err,)

    def cudaEventElapsedTime(
        self, start: cudaEvent_t, end: cudaEvent_t
    ) -> tuple[cudaError_t, float | None]:
        err = self._note("cudaEventElapsedTime", start.address, end.address)
        if not err and (start.flags | end.flags) & self.cudaEventDisableTiming:
            err = INVALID_HANDLE
        if err:
            return err, None
        if start.at_ms is None or end.at_ms is None:
            return NOT_READY, None
        return SUCCESS, end.at_ms - start.at_ms

    def cudaMemcpyAsync(
        self, dst: int, src: int, count: int, kind: int, stream: cudaStream_t
    ) -> tuple[cudaError_t]:
        err = self._note("cudaMemcpyAsync", dst, src, count, kind, stream.address)
        if err:
            return (err,)
        to_device = kind == cudaMemcpyKind.cudaMemcpyHostToDevice
        host = self._bytes(self.host, src if to_device else dst, count)
        device = self._bytes(self.device_memory, dst if to_device else src, count)
        if host is None or device is None:
            return (INVALID_VALUE,)
        target, source = (device, host) if to_device else (host, device)

        def copy() -> None:
            target[:] = source
            self.device_ms += 1.0

        stream.ops.append(copy)
        return (SUCCESS,)

    @staticmethod
    def _bytes(allocations: dict[int, Any], ptr: int, count: int) -> memoryview | None:
        """The bytes ``[ptr, ptr + count)`` where they lie in one allocation."""
        for base, memory in allocations.items():
            if base <= ptr and ptr + count <= base + len(memory):
                return memoryview(memory).cast("B")[ptr - base : ptr - base + count]
        return None


@contextmanager
def installed(runtime: FakeRuntime | None, *, layout: str = "bindings+utils") -> Iterator[None]:
    """``open_runtime`` imports ``runtime`` inside: as ``cuda.bindings.runtime`` with
    ``cuda.bindings.utils`` (``layout="bindings+utils"``, 12.9.1 on), without it
    (``"bindings"``, 12.6.1 to 12.9.0), or as ``cuda.cudart`` (``"cudart"``, before
    12.6.1); ``None``: no cuda-python. ``sys.modules`` is as it was afterwards."""
    names = ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.bindings.utils", "cuda.cudart")
    modules: dict[str, Any] = dict.fromkeys(names)
    if runtime is not None:
        cuda = modules["cuda"] = types.ModuleType("cuda")
        cuda.__path__ = []
        if layout == "cudart":
            cuda.cudart = modules["cuda.cudart"] = runtime  # type: ignore[attr-defined]
        else:
            bindings = modules["cuda.bindings"] = types.ModuleType("cuda.bindings")
            bindings.__path__ = []
            cuda.bindings = bindings  # type: ignore[attr-defined]
            bindings.runtime = modules["cuda.bindings.runtime"] = runtime  # type: ignore[attr-defined]
            if layout == "bindings+utils":
                utils = modules["cuda.bindings.utils"] = types.ModuleType("cuda.bindings.utils")
                utils.get_cuda_native_handle = get_cuda_native_handle  # type: ignore[attr-defined]
                bindings.utils = utils  # type: ignore[attr-defined]
    with modules_replaced(modules):
        yield
