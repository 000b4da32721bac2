"""The CUDA layer's contract, run against the recording fake, against the pycuda binding
on a fake ``pycuda.driver`` (:mod:`.pycuda_fake`), and against each real binding where a
GPU answers (marked ``gpu``: skipped with the reason elsewhere)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from carpool.worker.cuda import open_cuda
from carpool.worker.cuda.base import Cuda, CudaError, CudaUnavailable
from carpool.worker.cuda.fake import FakeCuda
from tests.unit.worker.pycuda_fake import FakeDriver, installed


@pytest.fixture(
    params=[
        "fake",
        "pycuda on a fake driver",
        pytest.param("cuda-python", marks=pytest.mark.gpu),
        pytest.param("pycuda", marks=pytest.mark.gpu),
    ]
)
def cuda(request):
    if request.param == "fake":
        layer: Cuda = FakeCuda()
    elif request.param == "pycuda on a fake driver":
        with installed(FakeDriver()):
            layer = open_cuda(0, ("pycuda",))
    else:
        try:
            layer = open_cuda(0, (request.param,))
        except CudaUnavailable as exc:
            pytest.skip(f"{request.param}: {exc}")
    yield layer
    layer.close()


def _roundtrip(cuda: Cuda, data: np.ndarray) -> tuple:
    src, dst = cuda.pinned(data.nbytes), cuda.pinned(data.nbytes)
    dev = cuda.device_buffer(data.nbytes)
    src.view(data.dtype, data.shape)[...] = data
    return src, dst, dev


def test_pinned_buffers_view_as_arrays(cuda):
    host = cuda.pinned(64)
    assert host.nbytes == 64
    assert host.array.size == 64
    view = host.view(np.dtype(np.float32), (4, 2))
    view[...] = 7
    assert host.array[:32].view(np.float32).tolist() == [7.0] * 8
    cuda.free(host)


def test_async_copies_round_trip_once_the_stream_is_done(cuda):
    data = np.arange(1000, dtype=np.float32)
    src, dst, dev = _roundtrip(cuda, data)
    stream = cuda.stream()
    cuda.to_device(dev, src, data.nbytes, stream)
    cuda.to_host(dst, dev, data.nbytes, stream)
    cuda.synchronize(stream)
    np.testing.assert_array_equal(dst.view(data.dtype, data.shape), data)
    for b in (src, dst, dev):
        cuda.free(b)
    cuda.destroy(stream)


def test_an_event_marks_the_work_before_it_and_times_it(cuda):
    data = np.arange(1 << 16, dtype=np.int32)
    src, dst, dev = _roundtrip(cuda, data)
    stream, start, end = cuda.stream(), cuda.event(), cuda.event()
    done = cuda.event(timing=False)
    cuda.record(start, stream)
    cuda.to_device(dev, src, data.nbytes, stream)
    cuda.to_host(dst, dev, data.nbytes, stream)
    cuda.record(end, stream)
    cuda.record(done, stream)
    cuda.wait(done, stream)
    np.testing.assert_array_equal(dst.view(data.dtype, data.shape), data)
    assert cuda.elapsed_s(start, end) >= 0.0
    for h in (start, end, done, stream):
        cuda.destroy(h)


def test_two_streams_carry_their_own_copies(cuda):
    pairs = []
    for k in range(2):
        data = np.full(4096, k + 1, np.uint8)
        src, dst, dev = _roundtrip(cuda, data)
        stream = cuda.stream()
        cuda.to_device(dev, src, data.nbytes, stream)
        cuda.to_host(dst, dev, data.nbytes, stream)
        pairs.append((stream, dst, k + 1))
    for stream, dst, value in pairs:
        cuda.synchronize(stream)
        assert set(dst.array.tolist()) == {value}


def test_the_context_belongs_to_the_thread_that_opened_it(cuda):
    errors = []

    def other() -> None:
        try:
            cuda.pinned(16)
        except CudaError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=10)
    assert errors
    assert "thread" in str(errors[0])


def test_the_fake_runs_a_stream_only_when_waited_for():
    cuda = FakeCuda()
    data = np.arange(8, dtype=np.uint8)
    src, dst, dev = _roundtrip(cuda, data)
    stream, end, done = cuda.stream(), cuda.event(), cuda.event(timing=False)
    cuda.to_device(dev, src, 8, stream)
    cuda.to_host(dst, dev, 8, stream)
    cuda.record(end, stream)
    cuda.record(done, stream)
    assert dst.array.tolist() == [0] * 8  # queued, not done
    with pytest.raises(CudaError, match="NotReady"):
        cuda.elapsed_s(end, end)
    cuda.wait(done, stream)
    assert dst.array.tolist() == list(range(8))


def test_the_fake_holds_callers_to_the_wait_contract():
    cuda = FakeCuda()
    stream, timing, done = cuda.stream(), cuda.event(), cuda.event(timing=False)
    cuda.record(timing, stream)
    with pytest.raises(CudaError, match="completion event"):
        cuda.wait(timing, stream)
    cuda.record(done, stream)
    cuda.record(timing, stream)
    with pytest.raises(CudaError, match="after its completion event"):
        cuda.wait(done, stream)
    with pytest.raises(CudaError, match="InvalidResourceHandle"):
        cuda.elapsed_s(done, timing)


def test_open_cuda_gives_every_bindings_reason_when_none_opens():
    with pytest.raises(CudaUnavailable, match=r"^one: unknown CUDA binding; two: unknown"):
        open_cuda(0, ("one", "two"))


class _FakeRuntime:
    """cuda-python's runtime module as RuntimeCuda calls it: each call records its name
    and arguments and returns ``(err, value)``; a name in ``failing`` returns error 2."""

    class cudaMemcpyKind:  # noqa: N801 - cuda-python's names
        cudaMemcpyHostToDevice = "h2d"  # noqa: N815
        cudaMemcpyDeviceToHost = "d2h"  # noqa: N815

    cudaStreamNonBlocking = 1  # noqa: N815
    cudaDeviceScheduleBlockingSync = 4  # noqa: N815
    cudaEventBlockingSync = 1  # noqa: N815
    cudaEventDisableTiming = 2  # noqa: N815

    def __init__(self, failing: str = "") -> None:
        self.calls: list[tuple[object, ...]] = []
        self.failing = failing

    def cudaGetErrorName(self, err: int) -> tuple[int, bytes]:  # noqa: N802
        return 0, b"cudaErrorMemoryAllocation"

    def __getattr__(self, name: str):
        def call(*args: object) -> tuple[int, int]:
            self.calls.append((name, *args))
            return (2 if name == self.failing else 0), 4096

        return call


def test_the_cuda_python_binding_checks_every_call_on_the_owning_thread():
    from carpool.worker.cuda.base import DeviceBuffer, HostBuffer
    from carpool.worker.cuda.runtime import RuntimeCuda

    rt = _FakeRuntime()
    layer = RuntimeCuda(rt, 0)
    stream = layer.stream()
    layer.to_device(DeviceBuffer(16, 8), HostBuffer(32, 8, np.zeros(8, np.uint8)), 8, stream)
    layer.destroy(stream)
    assert rt.calls == [
        ("cudaSetDevice", 0),
        ("cudaSetDeviceFlags", 4),
        ("cudaStreamCreateWithFlags", 1),
        ("cudaMemcpyAsync", 16, 32, 8, "h2d", 4096),
        ("cudaStreamDestroy", 4096),
    ]
    failing = RuntimeCuda(_FakeRuntime(failing="cudaMalloc"), 0)
    with pytest.raises(CudaError, match=r"^cudaMalloc failed: cudaErrorMemoryAllocation$"):
        failing.device_buffer(8)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(errors, lambda: layer.event()))
    thread.start()
    thread.join(timeout=10)
    assert len(errors) == 1
    assert "belongs to the thread" in str(errors[0])
    assert rt.calls[-1] == ("cudaStreamDestroy", 4096)  # the other thread's call never ran


def _capture(errors: list[BaseException], fn) -> None:
    try:
        fn()
    except CudaError as exc:
        errors.append(exc)
