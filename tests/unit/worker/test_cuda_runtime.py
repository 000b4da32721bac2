"""The cuda-python binding (:mod:`carpool.worker.cuda.runtime`) on a recording fake of
cuda-python's runtime module (:mod:`.cuda_python_fake`): the calls it makes, how a batch
is waited for, handles as ints, and why it does not open."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from carpool.worker.cuda import open_cuda
from carpool.worker.cuda.base import CudaError, CudaUnavailable, DeviceBuffer, HostBuffer
from carpool.worker.cuda.runtime import RuntimeCuda, open_runtime
from tests.unit.worker.cuda_python_fake import (
    INSUFFICIENT_DRIVER,
    MEMORY_ALLOCATION,
    FakeRuntime,
    cudaMemcpyKind,
    get_cuda_native_handle,
    installed,
)
from tests.unit.worker.pycuda_fake import FakeDriver
from tests.unit.worker.pycuda_fake import installed as pycuda_installed

H2D = cudaMemcpyKind.cudaMemcpyHostToDevice


@pytest.fixture
def rt() -> Iterator[FakeRuntime]:
    runtime = FakeRuntime()
    with installed(runtime):
        yield runtime


def _opened(rt: FakeRuntime) -> RuntimeCuda:
    cuda = open_runtime(0)
    rt.calls.clear()
    return cuda


def test_open_binds_the_device_and_makes_its_waits_block(rt):
    cuda = open_runtime(0)
    assert (cuda.name, cuda.device) == ("cuda-python", 0)
    assert rt.calls == [
        ("cudaGetDeviceCount",),
        ("cudaSetDevice", 0),
        ("cudaSetDeviceFlags", 4),  # cudaDeviceScheduleBlockingSync
    ]


def test_errors_are_named_from_the_enum_cuda_python_returns(rt):
    """cuda-python's ``cudaGetErrorName`` reads ``err.value``: a plain int raises
    AttributeError (cuda-bindings 13.0.0, 12.9.0, cuda-python 12.6.0); the binding passes
    on the ``cudaError_t`` each call returned."""
    with pytest.raises(AttributeError):
        rt.cudaGetErrorName(int(MEMORY_ALLOCATION))
    assert rt.cudaGetErrorName(MEMORY_ALLOCATION) == (0, b"cudaErrorMemoryAllocation")
    rt.failing["cudaStreamCreateWithFlags"] = MEMORY_ALLOCATION
    with pytest.raises(CudaError, match=r"^cudaStreamCreate failed: cudaErrorMemoryAllocation$"):
        open_runtime(0).stream()


def test_a_device_whose_schedule_cannot_be_set_still_opens_and_says_so(rt, caplog):
    rt.failing["cudaSetDeviceFlags"] = 1
    with caplog.at_level(logging.WARNING, logger="carpool.worker.cuda.runtime"):
        cuda = open_runtime(0)
    assert cuda.device == 0
    assert "cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) failed" in caplog.text
    assert "cudaErrorInvalidValue" in caplog.text
    assert cuda.device_buffer(8).nbytes == 8


def test_a_batch_is_waited_for_by_synchronizing_its_stream(rt):
    cuda = _opened(rt)
    stream, done = cuda.stream(), cuda.event(timing=False)
    cuda.record(done, stream)
    rt.calls.clear()
    cuda.wait(done, stream)
    # cudaStreamSynchronize releases the GIL in every cuda-python release, where
    # cudaEventSynchronize holds it up to 12.9.0
    assert rt.calls == [("cudaStreamSynchronize", stream.handle)]


def test_completion_events_block_and_do_not_time(rt):
    cuda = _opened(rt)
    done, timing = cuda.event(timing=False), cuda.event()
    assert rt.calls == [("cudaEventCreateWithFlags", 1 | 2), ("cudaEventCreate",)]
    assert (done.timing, timing.timing) == (False, True)


def test_each_call_goes_to_the_runtime_with_the_handles_it_takes(rt):
    cuda = _opened(rt)
    host, dev = cuda.pinned(16), cuda.device_buffer(16)
    stream, start, end = cuda.stream(), cuda.event(), cuda.event()
    cuda.record(start, stream)
    cuda.to_device(dev, host, 16, stream)
    cuda.to_host(host, dev, 8, stream)
    cuda.record(end, stream)
    cuda.synchronize(stream)
    assert cuda.elapsed_s(start, end) == pytest.approx(0.002)  # two 1 ms copies
    for handle in (start, end, stream):
        cuda.destroy(handle)
    cuda.free(host)
    cuda.free(dev)
    s, a, b = stream.handle, start.native.address, end.native.address
    assert rt.calls == [
        ("cudaMallocHost", 16),
        ("cudaMalloc", 16),
        ("cudaStreamCreateWithFlags", 1),  # cudaStreamNonBlocking
        ("cudaEventCreate",),
        ("cudaEventCreate",),
        ("cudaEventRecord", a, s),
        ("cudaMemcpyAsync", dev.ptr, host.ptr, 16, H2D, s),
        ("cudaMemcpyAsync", host.ptr, dev.ptr, 8, cudaMemcpyKind.cudaMemcpyDeviceToHost, s),
        ("cudaEventRecord", b, s),
        ("cudaStreamSynchronize", s),
        ("cudaEventElapsedTime", a, b),
        ("cudaEventDestroy", a),
        ("cudaEventDestroy", b),
        ("cudaStreamDestroy", s),
        ("cudaFreeHost", host.ptr),
        ("cudaFree", dev.ptr),
    ]


def test_handles_become_ints_through_get_cuda_native_handle_where_it_exists(rt):
    stream = _opened(rt).stream()
    assert stream.handle == get_cuda_native_handle(stream.native)
    assert rt.ints == []  # int(handle) is deprecated from cuda-bindings 12.9.1 / 13.0.0


@pytest.mark.parametrize("layout", ["bindings", "cudart"])
def test_handles_become_ints_through_int_in_releases_before_it(layout):
    runtime = FakeRuntime()
    with installed(runtime, layout=layout):
        stream = open_runtime(0).stream()
    assert stream.handle == stream.native.address
    assert runtime.ints == [stream.handle]


def test_an_empty_buffer_asks_for_one_byte_and_views_none(rt):
    cuda = _opened(rt)
    host, dev = cuda.pinned(0), cuda.device_buffer(0)
    assert rt.calls == [("cudaMallocHost", 1), ("cudaMalloc", 1)]
    assert (host.nbytes, host.array.size, dev.nbytes) == (0, 0, 0)


def test_a_copy_past_a_buffer_is_refused_before_the_runtime_sees_it():
    runtime = FakeRuntime()
    cuda = RuntimeCuda(runtime, 0)
    host, dev = HostBuffer(32, 8, np.zeros(8, np.uint8)), DeviceBuffer(16, 64)
    runtime.calls.clear()
    with pytest.raises(CudaError, match=r"^cudaMemcpyAsync \(to device\): 9 bytes overrun"):
        cuda.to_device(dev, host, 9, cuda.stream())
    with pytest.raises(CudaError, match=r"^cudaMemcpyAsync \(to host\): 9 bytes overrun"):
        cuda.to_host(host, dev, 9, cuda.stream())
    assert [c[0] for c in runtime.calls] == ["cudaStreamCreateWithFlags"] * 2


def test_a_failed_call_is_a_cuda_error_with_the_runtime_s_name_for_it(rt):
    cuda = _opened(rt)
    rt.failing["cudaMalloc"] = MEMORY_ALLOCATION
    with pytest.raises(CudaError, match=r"^cudaMalloc failed: cudaErrorMemoryAllocation$"):
        cuda.device_buffer(8)


def test_no_call_reaches_the_runtime_from_another_thread(rt):
    cuda = _opened(rt)
    stream = cuda.stream()
    rt.calls.clear()
    errors: list[BaseException] = []

    def other() -> None:
        for call in (cuda.event, lambda: cuda.synchronize(stream), cuda.close):
            try:
                call()
            except CudaError as exc:
                errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=10)
    assert len(errors) == 3
    assert all("belongs to the thread that opened it" in str(e) for e in errors)
    assert rt.calls == []


def test_without_cuda_python_it_does_not_open():
    with installed(None), pytest.raises(CudaUnavailable, match=r"^cuda-python is not installed"):
        open_runtime(0)


def test_a_driver_too_old_for_the_binding_is_no_device():
    with (
        installed(FakeRuntime(count_error=INSUFFICIENT_DRIVER)),
        pytest.raises(CudaUnavailable, match=r"cudaGetDeviceCount: cudaErrorInsufficientDriver"),
    ):
        open_runtime(0)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("Failed to dlopen libcuda.so.1"), OSError("libcuda.so.1: cannot open")],
)
def test_a_runtime_that_raises_for_want_of_a_driver_is_unavailable(error):
    runtime = FakeRuntime()
    runtime.count_raises = error  # cuda-python 12.6.0 raises where later releases return
    with (
        installed(runtime, layout="cudart"),
        pytest.raises(CudaUnavailable, match=rf"^no CUDA driver \(cudaGetDeviceCount: {error}"),
    ):
        open_runtime(0)


def test_open_cuda_goes_on_to_pycuda_where_cuda_python_finds_no_driver():
    runtime, driver = FakeRuntime(), FakeDriver()
    runtime.count_raises = RuntimeError("Failed to dlopen libcuda.so.1")
    with installed(runtime, layout="cudart"), pycuda_installed(driver):
        cuda = open_cuda(0)
        assert cuda.name == "pycuda"
        cuda.close()


@pytest.mark.parametrize("device", [1, -1])
def test_a_device_out_of_range_does_not_open(device):
    runtime = FakeRuntime(devices=1)
    with (
        installed(runtime),
        pytest.raises(CudaUnavailable, match=rf"^no CUDA device {device} \(this machine has 1\)"),
    ):
        open_runtime(device)
    assert runtime.calls == [("cudaGetDeviceCount",)]


def test_the_fakes_leave_sys_modules_as_they_found_it():
    before = {name: sys.modules.get(name) for name in ("cuda", "pycuda", "pycuda.driver")}
    with installed(FakeRuntime()), pycuda_installed(FakeDriver()):
        assert sys.modules["cuda"] is not before["cuda"]
    assert {name: sys.modules.get(name) for name in before} == before
