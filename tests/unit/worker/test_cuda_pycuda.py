"""The pycuda binding (:mod:`carpool.worker.cuda.pycuda_driver`) on a recording fake of
``pycuda.driver`` (:mod:`.pycuda_fake`): the calls each method makes, its errors as
CudaError, the owning thread, the context's release, and why it does not open."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from carpool.worker.cuda import open_cuda
from carpool.worker.cuda.base import CudaError, CudaUnavailable
from carpool.worker.cuda.pycuda_driver import PyCudaCuda, open_pycuda
from tests.unit.worker.pycuda_fake import FakeDriver, HostAllocation, installed

BLOCKING_SYNC, DISABLE_TIMING = 1, 2  # CU_EVENT_BLOCKING_SYNC, CU_EVENT_DISABLE_TIMING


@pytest.fixture
def drv() -> Iterator[FakeDriver]:
    driver = FakeDriver()
    with installed(driver):
        yield driver


def _opened(drv: FakeDriver) -> PyCudaCuda:
    cuda = open_pycuda(0)
    drv.calls.clear()
    return cuda


def test_open_retains_the_primary_context_and_pushes_it_on_this_thread(drv):
    cuda = open_pycuda(0)
    assert (cuda.name, cuda.device) == ("pycuda", 0)
    assert drv.calls == [
        ("init", 0),
        ("Device.count",),
        ("Device", 0),
        ("Device.retain_primary_context", 0),
        ("Context.push", 0),
    ]
    assert [c.ordinal for c in drv.stack] == [0]


def test_each_call_goes_to_pycuda_with_the_handles_it_takes(drv):
    cuda = _opened(drv)
    host, dev = cuda.pinned(64), cuda.device_buffer(64)
    stream = cuda.stream()
    start, done = cuda.event(), cuda.event(timing=False)
    cuda.record(start, stream)
    cuda.to_device(dev, host, 48, stream)
    cuda.to_host(host, dev, 16, stream)
    cuda.record(done, stream)
    cuda.synchronize(stream)
    assert drv.calls == [
        ("pagelocked_empty", (64,), "uint8", 0),
        ("mem_alloc", 64),
        ("Stream", 1),  # CU_STREAM_NON_BLOCKING
        ("Event", 0),
        ("Event", BLOCKING_SYNC | DISABLE_TIMING),
        ("Event.record", start.native.id, stream.handle),
        ("memcpy_htod_async", dev.ptr, 48, stream.handle),
        ("memcpy_dtoh_async", dev.ptr, 16, stream.handle),
        ("Event.record", done.native.id, stream.handle),
        ("Stream.synchronize", stream.handle),
    ]
    assert host.ptr == host.array.ctypes.data
    assert isinstance(host.native, HostAllocation)
    assert stream.handle == stream.native.handle
    assert dev.ptr == int(dev.native)
    assert not done.timing
    drv.calls.clear()
    cuda.free(host)
    cuda.free(dev)
    cuda.destroy(stream)  # pycuda frees streams and events with their last reference
    cuda.destroy(done)
    assert drv.calls == [
        ("HostAllocation.free", host.ptr),
        ("DeviceAllocation.free", dev.ptr),
    ]


def test_a_batch_is_waited_for_on_its_blocking_sync_event_alone(drv):
    cuda = _opened(drv)
    data = np.arange(32, dtype=np.uint8)
    src, dst, dev = cuda.pinned(32), cuda.pinned(32), cuda.device_buffer(32)
    src.array[:] = data
    stream, done = cuda.stream(), cuda.event(timing=False)
    cuda.to_device(dev, src, 32, stream)
    cuda.to_host(dst, dev, 32, stream)
    cuda.record(done, stream)
    assert dst.array.tolist() == [0] * 32  # queued, not run
    drv.calls.clear()
    cuda.wait(done, stream)
    # Event.synchronize releases the GIL; a BLOCKING_SYNC event makes the thread sleep
    # (pycuda cannot set the primary context's schedule flags, so the stream would spin)
    assert drv.calls == [("Event.synchronize", done.native.id)]
    assert done.native.flags == BLOCKING_SYNC | DISABLE_TIMING
    assert dst.array.tolist() == data.tolist()


def test_elapsed_time_is_the_end_event_timed_since_the_start_in_seconds(drv):
    cuda = _opened(drv)
    host, dev = cuda.pinned(8), cuda.device_buffer(8)
    stream, start, end = cuda.stream(), cuda.event(), cuda.event()
    cuda.record(start, stream)
    cuda.to_device(dev, host, 8, stream)
    cuda.to_host(host, dev, 8, stream)  # the fake's copies take 1 ms of device time each
    cuda.record(end, stream)
    cuda.synchronize(stream)
    drv.calls.clear()
    assert cuda.elapsed_s(start, end) == pytest.approx(0.002)
    assert drv.calls == [("Event.time_since", end.native.id, start.native.id)]


def test_an_empty_pinned_buffer_asks_pycuda_for_one_byte_and_views_none(drv):
    cuda = _opened(drv)
    host = cuda.pinned(0)
    assert drv.calls == [("pagelocked_empty", (1,), "uint8", 0)]
    assert host.nbytes == 0
    assert host.array.size == 0
    assert host.view(np.dtype(np.float32), (0, 4)).shape == (0, 4)
    cuda.free(host)


def test_a_copy_past_a_buffer_is_refused_before_pycuda_sees_it(drv):
    cuda = _opened(drv)
    small, big = cuda.pinned(8), cuda.device_buffer(16)
    stream = cuda.stream()
    drv.calls.clear()
    with pytest.raises(CudaError, match="16 bytes overrun a buffer"):
        cuda.to_device(big, small, 16, stream)
    with pytest.raises(CudaError, match="16 bytes overrun a buffer"):
        cuda.to_host(small, big, 16, stream)
    assert drv.calls == []


_CALLS: dict[str, Callable[[PyCudaCuda, dict[str, Any]], object]] = {
    "pagelocked_empty": lambda cuda, h: cuda.pinned(8),
    "mem_alloc": lambda cuda, h: cuda.device_buffer(8),
    "Stream": lambda cuda, h: cuda.stream(),
    "Event": lambda cuda, h: cuda.event(timing=False),
    "memcpy_htod_async": lambda cuda, h: cuda.to_device(h["dev"], h["host"], 8, h["stream"]),
    "memcpy_dtoh_async": lambda cuda, h: cuda.to_host(h["host"], h["dev"], 8, h["stream"]),
    "Event.record": lambda cuda, h: cuda.record(h["done"], h["stream"]),
    "Event.synchronize": lambda cuda, h: cuda.wait(h["done"], h["stream"]),
    "Stream.synchronize": lambda cuda, h: cuda.synchronize(h["stream"]),
    "Event.time_since": lambda cuda, h: cuda.elapsed_s(h["start"], h["start"]),
    "DeviceAllocation.free": lambda cuda, h: cuda.free(h["dev"]),
    "HostAllocation.free": lambda cuda, h: cuda.free(h["host"]),
}


def _handles(cuda: PyCudaCuda) -> dict[str, Any]:
    stream, start = cuda.stream(), cuda.event()
    cuda.record(start, stream)
    cuda.synchronize(stream)
    return {
        "host": cuda.pinned(8),
        "dev": cuda.device_buffer(8),
        "stream": stream,
        "done": cuda.event(timing=False),
        "start": start,
    }


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_each_pycuda_error_becomes_a_cuda_error_naming_the_call(drv, call):
    cuda = _opened(drv)
    handles = _handles(cuda)
    drv.failing[call] = drv.LaunchError("cuXxx failed: unspecified launch failure")
    with pytest.raises(CudaError, match=rf"^{call} failed: cuXxx failed: unspecified launch"):
        _CALLS[call](cuda, handles)


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_no_call_reaches_pycuda_from_another_thread(drv, call):
    cuda = _opened(drv)
    handles = _handles(cuda)
    drv.calls.clear()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            _CALLS[call](cuda, handles)
        except CudaError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=10)
    assert len(errors) == 1
    assert "belongs to the thread that opened it" in str(errors[0])
    assert drv.calls == []


def test_close_pops_and_releases_the_context_once(drv):
    cuda = _opened(drv)
    cuda.close()
    cuda.close()
    assert drv.calls == [("Context.pop",), ("Context.detach", 0)]
    assert drv.stack == []


def test_close_from_another_thread_is_refused_and_leaves_the_context(drv):
    cuda = _opened(drv)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            cuda.close()
        except CudaError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=10)
    assert len(errors) == 1
    assert drv.calls == []
    cuda.close()
    assert drv.calls == [("Context.pop",), ("Context.detach", 0)]


def test_close_releases_the_context_even_when_the_pop_fails(drv):
    cuda = _opened(drv)
    drv.failing["Context.pop"] = drv.LogicError("context::pop failed: invalid device context")
    with pytest.raises(CudaError, match=r"^Context.pop failed: context::pop failed"):
        cuda.close()
    cuda.close()
    assert drv.calls == [("Context.pop",), ("Context.detach", 0)]


def test_a_context_that_does_not_push_is_released_and_the_open_fails(drv):
    drv.failing["Context.push"] = drv.LogicError("cuCtxPushCurrent failed: invalid context")
    with pytest.raises(CudaError, match=r"^Context.push failed: cuCtxPushCurrent failed"):
        open_pycuda(0)
    assert drv.calls[-2:] == [("Context.push", 0), ("Context.detach", 0)]
    assert drv.stack == []


def test_a_primary_context_that_cannot_be_retained_is_a_cuda_error(drv):
    error = drv.MemoryError("cuDevicePrimaryCtxRetain failed: out of memory")
    drv.failing["Device.retain_primary_context"] = error
    with pytest.raises(CudaError, match=r"^retain_primary_context failed: cuDevicePrimary"):
        open_pycuda(0)
    assert drv.stack == []


def test_without_pycuda_it_does_not_open():
    with installed(None), pytest.raises(CudaUnavailable, match=r"^pycuda is not installed"):
        open_pycuda(0)


def test_without_a_device_it_does_not_open():
    with (
        installed(FakeDriver(devices=0)),
        pytest.raises(CudaUnavailable, match=r"^no CUDA device \(pycuda: cuInit failed: no CUDA"),
    ):
        open_pycuda(0)


@pytest.mark.parametrize("device", [1, -1])
def test_a_device_out_of_range_does_not_open(device):
    driver = FakeDriver(devices=1)
    with (
        installed(driver),
        pytest.raises(CudaUnavailable, match=rf"^no CUDA device {device} \(this machine has 1\)"),
    ):
        open_pycuda(device)
    assert ("Device", device) not in driver.calls


def test_open_cuda_falls_back_to_pycuda_where_cuda_python_is_missing(drv, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    cuda = open_cuda(0)
    assert cuda.name == "pycuda"
    cuda.close()


def test_the_fake_refuses_what_pycuda_refuses():
    drv = FakeDriver()
    with pytest.raises(drv.LogicError, match="initialization error"):
        drv.Device(0)
    drv.init()
    with pytest.raises(drv.LogicError, match="invalid device context"):
        drv.mem_alloc(8)  # no context current on this thread
    context = drv.Device(0).retain_primary_context()
    context.push()
    with pytest.raises(drv.LogicError, match="invalid argument"):
        drv.pagelocked_empty(0, np.uint8)
    allocation = drv.mem_alloc(8)
    allocation.free()
    with pytest.raises(drv.LogicError, match="invalid resource handle"):
        allocation.free()
    timing, done = drv.Event(), drv.Event(drv.event_flags.DISABLE_TIMING)
    with pytest.raises(drv.LogicError, match="invalid resource handle"):
        done.time_since(timing)
    drv.Context.pop()
    with pytest.raises(drv.LogicError, match="cannot pop non-current context"):
        drv.Context.pop()
    context.detach()
    with pytest.raises(drv.LogicError, match="cannot detach from invalid context"):
        context.detach()
