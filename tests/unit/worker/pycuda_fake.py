"""A recording fake of ``pycuda.driver``: the part :mod:`carpool.worker.cuda.pycuda_driver`
calls, with pycuda's names, signatures, errors and rules (``inducer/pycuda``
``src/wrapper/wrap_cudadrv.cpp`` and ``src/cpp/cuda.hpp``):

- ``init(flags=0)`` first: ``Device(ordinal)`` and ``Device.count()`` raise before it.
- ``Device(n).retain_primary_context()`` gives a ``Context``; ``push()`` makes it current
  on the calling thread, ``Context.pop()`` (static) pops that thread's stack, ``detach()``
  releases it (a second ``detach`` raises, as pycuda's does). Context stacks are per
  thread: memory, stream and event calls need a context current on the calling thread
  (``CUDA_ERROR_INVALID_CONTEXT`` otherwise).
- ``pagelocked_empty(shape, dtype, order="C", mem_flags=0)``: an ndarray whose ``base``
  is the ``HostAllocation`` (``free()`` once). ``mem_alloc(bytesize)``: a
  ``DeviceAllocation`` (``int()``, ``free()`` once). A 0-byte request is refused
  (``CUDA_ERROR_INVALID_VALUE``: documented for ``cuMemAlloc``; ``cuMemHostAlloc``
  promises nothing for it).
- ``Stream(flags=0)`` (``handle``: an int; ``synchronize()``), ``Event(flags=0)``
  (``record(stream=None)``, ``synchronize()``, ``query()``, ``time_since(start)`` in ms;
  ``event_flags.BLOCKING_SYNC | DISABLE_TIMING``).
- ``memcpy_htod_async(dest, src, stream=None)`` and ``memcpy_dtoh_async(dest, src,
  stream=None)`` copy the whole host buffer, as pycuda does (its length is the size).
- ``Error``, and ``MemoryError``, ``LogicError``, ``LaunchError``, ``RuntimeError`` under it,
  with pycuda's message form ``"cuXxx failed: reason"``.

Its device: work queued on a stream runs when the host waits for it (the stream, or an
event recorded on it), one millisecond of device time per copy, so an event's time is the
time its stream reached it. Every call is recorded in :attr:`FakeDriver.calls`; a call
named in :attr:`FakeDriver.failing` raises the error given there once recorded.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tests.unit.worker.fake_modules import modules_replaced


class Error(Exception):
    """pycuda._driver.Error."""


class MemoryError(Error):
    pass


class LogicError(Error):
    pass


class LaunchError(Error):
    pass


class RuntimeError(Error):
    pass


class event_flags(enum.IntEnum):  # noqa: N801 - pycuda's name (CUevent_flags)
    DEFAULT = 0
    BLOCKING_SYNC = 1
    DISABLE_TIMING = 2
    INTERPROCESS = 4


_INVALID_CONTEXT = "invalid device context"


class HostAllocation:
    """pycuda's PagelockedHostAllocation: page-locked bytes an ndarray wraps."""

    def __init__(self, driver: FakeDriver, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self._driver = driver
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        self._raw = (ctypes.c_uint8 * size)()
        self.address = ctypes.addressof(self._raw)
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (self.address, False),
            "version": 3,
        }
        self.valid = True

    def free(self) -> None:
        self._driver.note("HostAllocation.free", self.address)
        if not self.valid:
            raise LogicError("pagelocked_host_allocation::free failed: invalid resource handle")
        self.valid = False


class DeviceAllocation:
    """pycuda's DeviceAllocation: ``int()`` is its device pointer."""

    def __init__(self, driver: FakeDriver, ptr: int, nbytes: int) -> None:
        self._driver, self._ptr, self.nbytes = driver, ptr, nbytes

    def __int__(self) -> int:
        return self._ptr

    __index__ = __int__

    def free(self) -> None:
        self._driver.note("DeviceAllocation.free", self._ptr)
        if self._ptr not in self._driver.device_memory:
            raise LogicError("device_allocation::free failed: invalid resource handle")
        del self._driver.device_memory[self._ptr]


class FakeDriver(types.ModuleType):
    """``pycuda.driver`` over a fake device with ``devices`` GPUs (see the module
    docstring); :func:`installed` puts it where ``import pycuda.driver`` finds it."""

    Error = Error
    MemoryError = MemoryError
    LogicError = LogicError
    LaunchError = LaunchError
    RuntimeError = RuntimeError
    event_flags = event_flags

    def __init__(self, devices: int = 1) -> None:
        super().__init__("pycuda.driver")
        self.devices = devices
        #: call name (as recorded) → the error that call raises
        self.failing: dict[str, Error] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.initialised = False
        self.device_memory: dict[int, bytearray] = {}
        self.device_ms = 0.0
        self._ptrs = itertools.count(0x7F0000000000, 0x100000)
        self._ids = itertools.count(1)
        self._stacks = threading.local()
        this = self

        # pycuda's classes, bound to this fake (what the binding calls them through)
        class Device(_Device):
            driver = this

        class Context(_Context):
            driver = this

        class Stream(_Stream):
            driver = this

        class Event(_Event):
            driver = this

        self.Device, self.Context, self.Stream, self.Event = Device, Context, Stream, Event

    # -- what the fake keeps -------------------------------------------------------------
    def note(self, *call: Any) -> None:
        """Record ``call``; raise the error :attr:`failing` gives for its name, if any."""
        self.calls.append(call)
        if call[0] in self.failing:
            raise self.failing[call[0]]

    @property
    def stack(self) -> list[_Context]:
        """The calling thread's context stack."""
        if not hasattr(self._stacks, "contexts"):
            self._stacks.contexts = []
        contexts: list[_Context] = self._stacks.contexts
        return contexts

    def need_context(self, call: str) -> None:
        if not self.stack:
            raise LogicError(f"{call} failed: {_INVALID_CONTEXT}")

    def need_init(self, call: str) -> None:
        if not self.initialised:
            raise LogicError(f"{call} failed: initialization error")

    def device_bytes(self, ptr: int, nbytes: int, call: str) -> memoryview:
        """The device bytes ``[ptr, ptr + nbytes)``, which must lie in one allocation."""
        for base, memory in self.device_memory.items():
            if base <= ptr and ptr + nbytes <= base + len(memory):
                return memoryview(memory)[ptr - base : ptr - base + nbytes]
        raise LogicError(f"{call} failed: invalid argument")

    # -- pycuda.driver's functions -------------------------------------------------------
    def init(self, flags: int = 0) -> None:
        self.note("init", flags)
        if self.devices == 0:
            raise RuntimeError("cuInit failed: no CUDA-capable device is detected")
        self.initialised = True

    def pagelocked_empty(
        self, shape: Any, dtype: Any, order: str = "C", mem_flags: int = 0
    ) -> np.ndarray[Any, Any]:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        self.note("pagelocked_empty", dims, np.dtype(dtype).name, mem_flags)
        self.need_context("cuMemHostAlloc")
        if np.dtype(dtype).itemsize * int(np.prod(dims, dtype=np.int64)) == 0:
            raise LogicError("cuMemHostAlloc failed: invalid argument")
        return np.asarray(HostAllocation(self, dims, np.dtype(dtype)))

    def mem_alloc(self, bytesize: int) -> DeviceAllocation:
        self.note("mem_alloc", bytesize)
        self.need_context("cuMemAlloc")
        if bytesize == 0:
            raise LogicError("cuMemAlloc failed: invalid argument")
        ptr = next(self._ptrs)
        self.device_memory[ptr] = bytearray(bytesize)
        return DeviceAllocation(self, ptr, bytesize)

    def memcpy_htod_async(self, dest: Any, src: Any, stream: _Stream | None = None) -> None:
        host = memoryview(src).cast("B")
        self.note("memcpy_htod_async", int(dest), host.nbytes, _handle(stream))
        self.need_context("cuMemcpyHtoDAsync")
        target = self.device_bytes(int(dest), host.nbytes, "cuMemcpyHtoDAsync")
        self._queue(stream, lambda: target.__setitem__(slice(None), host))

    def memcpy_dtoh_async(self, dest: Any, src: Any, stream: _Stream | None = None) -> None:
        host = memoryview(dest).cast("B")
        if host.readonly:
            raise TypeError("memcpy_dtoh_async: the destination buffer is read-only")
        self.note("memcpy_dtoh_async", int(src), host.nbytes, _handle(stream))
        self.need_context("cuMemcpyDtoHAsync")
        source = self.device_bytes(int(src), host.nbytes, "cuMemcpyDtoHAsync")
        self._queue(stream, lambda: host.__setitem__(slice(None), source))

    def _queue(self, stream: _Stream | None, run: Callable[[], None]) -> None:
        def copy() -> None:
            run()
            self.device_ms += 1.0

        if stream is None:  # the default stream: done by the time the call returns
            copy()
        else:
            stream.ops.append(copy)


def _handle(stream: _Stream | None) -> int:
    return 0 if stream is None else stream.handle


class _Device:
    driver: FakeDriver

    def __init__(self, ordinal: int) -> None:
        self.driver.note("Device", ordinal)
        self.driver.need_init("cuDeviceGet")
        if not 0 <= ordinal < self.driver.devices:
            raise LogicError("cuDeviceGet failed: invalid device ordinal")
        self.ordinal = ordinal

    @classmethod
    def count(cls) -> int:
        cls.driver.note("Device.count")
        cls.driver.need_init("cuDeviceGetCount")
        return cls.driver.devices

    def retain_primary_context(self) -> _Context:
        self.driver.note("Device.retain_primary_context", self.ordinal)
        context: _Context = self.driver.Context(self.ordinal)
        return context


class _Context:
    driver: FakeDriver

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.valid = True

    def push(self) -> None:
        self.driver.note("Context.push", self.ordinal)
        self.driver.stack.append(self)

    @classmethod
    def pop(cls) -> None:
        cls.driver.note("Context.pop")
        if not cls.driver.stack:
            raise LogicError("context::pop failed: cannot pop non-current context")
        cls.driver.stack.pop()

    def detach(self) -> None:
        self.driver.note("Context.detach", self.ordinal)
        if not self.valid:
            raise LogicError("context::detach failed: cannot detach from invalid context")
        self.valid = False
        if self in self.driver.stack:  # detaching the current context pops it too
            self.driver.stack.remove(self)


class _Stream:
    driver: FakeDriver

    def __init__(self, flags: int = 0) -> None:
        self.handle = next(self.driver._ids) << 8
        self.driver.note("Stream", flags)
        self.driver.need_context("cuStreamCreate")
        self.flags = flags
        self.ops: list[Callable[[], None]] = []

    def run(self, upto: int | None = None) -> None:
        upto = len(self.ops) if upto is None else upto
        ops, self.ops = self.ops[:upto], self.ops[upto:]
        for op in ops:
            op()

    def synchronize(self) -> None:
        self.driver.note("Stream.synchronize", self.handle)
        self.driver.need_context("cuStreamSynchronize")
        self.run()

    def is_done(self) -> bool:
        return not self.ops


class _Event:
    driver: FakeDriver

    def __init__(self, flags: int = 0) -> None:
        self.id = next(self.driver._ids)
        self.driver.note("Event", int(flags))
        self.driver.need_context("cuEventCreate")
        self.flags = int(flags)
        self.stream: _Stream | None = None
        self.at_ms: float | None = None
        self._mark: Callable[[], None] | None = None

    @property
    def timing(self) -> bool:
        return not self.flags & event_flags.DISABLE_TIMING

    def record(self, stream: _Stream | None = None) -> _Event:
        self.driver.note("Event.record", self.id, _handle(stream))
        self.driver.need_context("cuEventRecord")
        self.at_ms = None

        def reach() -> None:
            self.at_ms = self.driver.device_ms

        if stream is None:
            reach()
        else:
            stream.ops.append(reach)
        self.stream, self._mark = stream, reach
        return self

    def synchronize(self) -> _Event:
        self.driver.note("Event.synchronize", self.id)
        self.driver.need_context("cuEventSynchronize")
        stream = self.stream
        if stream is not None and self._mark in stream.ops:
            stream.run(stream.ops.index(self._mark) + 1)
        return self

    def query(self) -> bool:
        return self.at_ms is not None

    def time_since(self, start: _Event) -> float:
        self.driver.note("Event.time_since", self.id, start.id)
        self.driver.need_context("cuEventElapsedTime")
        if not (self.timing and start.timing):
            raise LogicError("cuEventElapsedTime failed: invalid resource handle")
        if self.at_ms is None or start.at_ms is None:
            raise RuntimeError("cuEventElapsedTime failed: device not ready")
        return self.at_ms - start.at_ms


@contextmanager
def installed(driver: FakeDriver | None) -> Iterator[None]:
    """``import pycuda.driver`` gives ``driver`` inside (``None``: the import fails, as
    where pycuda is not installed); ``sys.modules`` is as it was afterwards."""
    package = types.ModuleType("pycuda")
    package.__path__ = []
    if driver is not None:
        package.driver = driver  # type: ignore[attr-defined]
    with modules_replaced({"pycuda": package, "pycuda.driver": driver}):
        yield
