"""The CUDA layer's contract, run against the recording fake, against each binding on a
fake of its module (:mod:`.cuda_python_fake`, :mod:`.pycuda_fake`), and against each real
binding where a GPU answers (marked ``gpu``: skipped with the reason elsewhere)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from carpool.worker.cuda import open_cuda
from carpool.worker.cuda.base import Cuda, CudaError, CudaUnavailable
from carpool.worker.cuda.fake import FakeCuda
from tests.unit.worker import cuda_python_fake, pycuda_fake


@pytest.fixture(
    params=[
        "fake",
        "cuda-python on a fake runtime",
        "pycuda on a fake driver",
        pytest.param("cuda-python", marks=pytest.mark.gpu),
        pytest.param("pycuda", marks=pytest.mark.gpu),
    ]
)
def cuda(request):
    if request.param == "fake":
        layer: Cuda = FakeCuda()
    elif request.param == "cuda-python on a fake runtime":
        with cuda_python_fake.installed(cuda_python_fake.FakeRuntime()):
            layer = open_cuda(0, ("cuda-python",))
    elif request.param == "pycuda on a fake driver":
        with pycuda_fake.installed(pycuda_fake.FakeDriver()):
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


def test_the_fake_refuses_a_wait_for_an_event_not_last_recorded_on_the_stream():
    cuda = FakeCuda()
    stream, other, done = cuda.stream(), cuda.stream(), cuda.event(timing=False)
    with pytest.raises(CudaError, match="not last recorded on this stream"):
        cuda.wait(done, stream)  # never recorded
    cuda.record(done, stream)
    cuda.record(done, other)
    with pytest.raises(CudaError, match="not last recorded on this stream"):
        cuda.wait(done, stream)  # its last record is on another stream
    cuda.wait(done, other)
    cuda.record(done, stream)
    cuda.synchronize(stream)
    cuda.record(cuda.event(), stream)
    with pytest.raises(CudaError, match="after its completion event"):
        cuda.wait(done, stream)  # reached already, and work queued since


def test_open_cuda_gives_every_bindings_reason_when_none_opens():
    with pytest.raises(CudaUnavailable, match=r"^one: unknown CUDA binding; two: unknown"):
        open_cuda(0, ("one", "two"))
