"""Shared-memory inputs end to end (protocol §5.4): a real broker and worker on loopback,
a real ONNX model, clients whose large inputs travel through /dev/shm."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from carpool.client import AsyncClient, Client
from carpool.common.errors import ErrorCode
from carpool.common.shm import available as shm_available
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.models import locate

pytestmark = pytest.mark.skipif(not shm_available(), reason="no usable /dev/shm")

#: Rings and regions are allocated in full: keep them small (a container's /dev/shm may
#: be 64 MiB in all).
RING = 4 << 20


@pytest.fixture(scope="module")
def reference() -> OnnxRuntimeEngine:
    return OnnxRuntimeEngine(locate("ppocr-cls"), max_batch=8)


@pytest.mark.timeout(120)
def test_shared_memory_inputs_give_the_same_answers_as_frames(
    fleet_factory: Any, reference: OnnxRuntimeEngine
) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.005)
    fleet.add_worker({"ppocr-cls": lambda: OnnxRuntimeEngine(locate("ppocr-cls"), max_batch=8)})
    plain = fleet.ready()
    shared = fleet.client(shared_memory=4 << 20, shared_memory_min_bytes=64 << 10)
    region = shared.core.arena.path
    assert os.path.exists(region)
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((n, 3, 48, 192)).astype(np.float32) for n in (1, 2, 1, 3) * 4]
    out_name = reference.info.io.outputs[0].name
    want = [reference.run({"x": x})[out_name] for x in xs]
    # Both clients pipelined, so batches mix requests in shared memory and in frames.
    futures = [
        (c.submit("ppocr-cls", {"x": x}), w)
        for x, w in zip(xs, want, strict=True)
        for c in (plain, shared)
    ]
    for future, expected in futures:
        np.testing.assert_allclose(future.outputs(30)[out_name], expected, rtol=1e-4, atol=1e-5)
    assert shared.core.arena.used_bytes == 0  # every request settled, its space freed
    mixed = [k for k, v in plain.stats()["batch_sizes"]["ppocr-cls"].items() if int(k) > 1]
    assert mixed, "no batch held more than one request"
    shared.close()
    assert not os.path.exists(region)


@pytest.mark.timeout(60)
def test_an_unreadable_region_fails_only_its_request(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    fleet = fleet_factory(max_batch=4, max_wait_s=0.05)
    fleet.add_worker({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=4)})
    client = fleet.ready()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fleet.broker.frontend_endpoint)
    meta = {
        "id": 77,
        "model": "syn",
        "inputs": [
            {
                "name": "x",
                "dtype": "float32",
                "shape": [1, 4],
                "shm": {"region": "carpool-no-such-region", "offset": 64, "key": "00" * 16},
            }
        ],
    }
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    future = client.submit("syn", {"x": x})  # waits for company (50 ms) and gets it
    sock.send_multipart([b"CP\x01\x01", msgpack.packb(meta), b""])
    np.testing.assert_array_equal(future.outputs(10)["y"], synthetic_output(x))
    assert sock.poll(10_000)
    frames = sock.recv_multipart()
    assert frames[0] == b"CP\x01\x03"
    error = msgpack.unpackb(frames[1])
    assert (error["id"], error["code"]) == (77, int(ErrorCode.UNAVAILABLE))
    assert "carpool-no-such-region" in error["message"]
    sock.close(linger=0)


@pytest.mark.timeout(60)
def test_the_async_client_uses_shared_memory_too(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=4, max_wait_s=0.001)
    fleet.add_worker(
        {"syn": lambda: SyntheticEngine(item_shape=(32768,), max_batch=4)}, shm_output_bytes=RING
    )
    fleet.ready()

    async def main() -> tuple[np.ndarray, bool, str]:
        async with AsyncClient(
            fleet.broker.frontend_endpoint, shared_memory=1 << 20, shared_memory_outputs=True
        ) as client:
            arena = client.core.arena
            assert arena is not None
            path = arena.path
            x = np.linspace(0, 1, 32768, dtype=np.float32).reshape(1, -1)  # 128 KiB
            y = await client.infer("syn", {"x": x}, timeout_s=10)
            assert arena.used_bytes == 0
            existed = await asyncio.to_thread(os.path.exists, path)
            return y["y"] - synthetic_output(x), existed, path

    diff, existed, path = asyncio.run(main())
    assert not diff.any()
    assert existed
    assert not os.path.exists(path)


def test_clients_share_memory_only_when_asked(fleet_factory: Any) -> None:
    fleet = fleet_factory()
    with Client(fleet.broker.frontend_endpoint) as client:
        assert client.core.arena is None


@pytest.mark.timeout(60)
def test_large_outputs_come_back_through_the_workers_ring(fleet_factory: Any) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.002)
    worker = fleet.add_worker(
        {"syn": lambda: SyntheticEngine(item_shape=(32768,), max_batch=8)}, shm_output_bytes=RING
    )
    plain = fleet.ready()
    shared = fleet.client(shared_memory=8 << 20, shared_memory_outputs=True)
    inputs_only = fleet.client(shared_memory=8 << 20)  # outputs in frames: the default
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1 + i % 2, 32768)).astype(np.float32) for i in range(24)]
    futures = [(c.submit("syn", {"x": x}), x) for x in xs for c in (plain, shared, inputs_only)]
    for future, x in futures:
        np.testing.assert_array_equal(future.outputs(30)["y"], synthetic_output(x))
    ring = worker._ring._ring
    assert ring is not None
    # Only `shared` asked: 24 requests, 128 or 256 KiB of output each.
    assert ring.head >= sum(x.nbytes for x in xs) * 0.5  # a reader may have held a range
    assert shared.core.reader is not None
    assert inputs_only.core.reader is None  # never got a reference to read
    assert os.path.exists(ring.path)  # removed when the worker closes (unit-tested)


@pytest.mark.timeout(60)
def test_a_client_written_from_the_document_reads_the_ring(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """§5.5 followed by hand (raw DEALER, msgpack, fcntl): ask for shared-memory outputs,
    then open the ring, check its header and key, take the range lock and then the header
    lock, check offset/seq/head, and copy. Nothing of carpool's client code is used."""
    import fcntl
    import struct

    fleet = fleet_factory(max_batch=4, max_wait_s=0.001)
    fleet.add_worker(
        {"syn": lambda: SyntheticEngine(item_shape=(32768,), max_batch=4)}, shm_output_bytes=RING
    )
    fleet.ready()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fleet.broker.frontend_endpoint)
    x = np.linspace(-1, 1, 32768, dtype="<f4").reshape(1, 32768)
    meta = {
        "id": 9,
        "model": "syn",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 32768]}],
        "shm_outputs": True,
    }
    sock.send_multipart([b"CP\x01\x01", msgpack.packb(meta), x.tobytes()])
    assert sock.poll(10_000)
    frames = sock.recv_multipart()
    assert frames[0] == b"CP\x01\x02"
    reply = msgpack.unpackb(frames[1])
    (out,) = reply["outputs"]
    ref = out["shm"]
    assert frames[2] == b""  # the output's frame is empty: its bytes are in the ring
    nbytes = 4 * int(np.prod(out["shape"]))

    def lock(fd: int, kind: int, start: int, length: int) -> None:
        flock = struct.pack("hhqqi4x", kind, 0, start, length, 0)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, flock)

    fd = os.open(f"/dev/shm/{ref['region']}", os.O_RDONLY | os.O_NOFOLLOW)
    try:
        head_bytes = os.pread(fd, 32, 0)
        assert head_bytes[:16] == b"carpool-shm-v1\0\0"
        assert head_bytes[16:32].hex() == ref["key"]
        lock(fd, fcntl.F_RDLCK, ref["offset"], nbytes)
        lock(fd, fcntl.F_RDLCK, 0, 64)
        head, capacity = struct.unpack("<QQ", os.pread(fd, 16, 32))
        lock(fd, fcntl.F_UNLCK, 0, 64)
        assert ref["offset"] == 64 + ref["seq"] % capacity
        assert ref["seq"] + nbytes <= head <= ref["seq"] + capacity
        data = os.pread(fd, nbytes, ref["offset"])
        lock(fd, fcntl.F_UNLCK, ref["offset"], nbytes)
    finally:
        os.close(fd)
    y = np.frombuffer(data, "<f4").reshape(out["shape"])
    np.testing.assert_array_equal(y, synthetic_output(x))
    sock.close(linger=0)


# ------------------------------------------------------------------- hostile clients, bad settings

N = 32768  # float32: 128 KiB, large enough for the ring


@pytest.mark.timeout(60)
def test_a_worker_never_reads_its_output_ring_as_an_input(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A confused deputy: every client that asks for shared-memory outputs learns the
    worker's ring name and key, even one on another host that cannot open it. Handed back
    as an input reference, it is refused INVALID_ARGUMENT: the worker never reads another
    client's output for it."""
    fleet = fleet_factory(max_batch=4, max_wait_s=0.001)
    engine = {"syn": lambda: SyntheticEngine(item_shape=(N,), max_batch=4)}
    fleet.add_worker(engine, shm_output_bytes=RING, warmup=False)
    fleet.ready()
    victim = fleet.client(shared_memory_outputs=True)
    secret = np.random.default_rng(1).standard_normal((1, N)).astype(np.float32)
    victim.infer("syn", {"x": secret}, timeout_s=10)  # its output: in the ring at 64

    thief = context.socket(zmq.DEALER)
    thief.setsockopt(zmq.LINGER, 0)
    thief.connect(fleet.broker.frontend_endpoint)
    x = [{"name": "x", "dtype": "float32", "shape": [1, N]}]
    probe = {"id": 1, "model": "syn", "shm_outputs": True, "inputs": x}
    thief.send_multipart([b"CP\x01\x01", msgpack.packb(probe), bytes(4 * N)])
    assert thief.poll(10_000)
    ring = msgpack.unpackb(thief.recv_multipart()[1])["outputs"][0]["shm"]
    steal = {"region": ring["region"], "offset": 64, "key": ring["key"]}
    meta = {"id": 2, "model": "syn", "inputs": [{**x[0], "shm": steal}]}
    thief.send_multipart([b"CP\x01\x01", msgpack.packb(meta), b""])
    assert thief.poll(10_000)
    frames = thief.recv_multipart()
    thief.close(linger=0)
    assert frames[0] == b"CP\x01\x03", "the worker served its output ring as an input"
    error = msgpack.unpackb(frames[1])
    assert error["code"] == ErrorCode.INVALID_ARGUMENT
    assert "output ring" in error["message"]


def test_the_output_rings_group_is_checked_when_the_worker_starts() -> None:
    """A misspelt shm_output_group is a ConfigError at start, not a warning at a
    client's first request for shared-memory outputs and outputs in frames from then on."""
    import grp
    import os

    from carpool.common.errors import ConfigError
    from carpool.worker.server import WorkerServer

    engine = {"syn": lambda: SyntheticEngine(item_shape=(N,))}
    with pytest.raises(ConfigError, match="shm_output_group 'carpol-shm-nosuch': no such group"):
        WorkerServer("tcp://127.0.0.1:9", engine, shm_output_group="carpol-shm-nosuch")
    own = grp.getgrgid(os.getegid()).gr_name
    WorkerServer("tcp://127.0.0.1:9", engine, shm_output_group=own, warmup=False).close()
    # No ring, no group to check.
    WorkerServer(
        "tcp://127.0.0.1:9", engine, shm_output_bytes=0, shm_output_group="carpol-shm-nosuch"
    ).close()
