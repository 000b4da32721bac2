"""test_protocol_doc.py: a client and a worker written only from docs/protocol.md.

Everything on the wire here is built by hand with pyzmq, msgpack and numpy, following the
document section by section; carpool provides nothing but the broker under test. If the
broker and the document disagree, these tests fail. The worked example's hex dumps are
read from the document itself and replayed against the broker byte for byte.

No sleeps: every wait is a poll whose timeout is only an upper-bound guard.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.common.testing import ServerThread

pytestmark = pytest.mark.timeout(30)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

#: Upper bound on any single wait; a healthy exchange takes milliseconds.
GUARD_S = 10.0

# --------------------------------------------------------------------- §3 header, commands

MAGIC = b"CP"
VERSION = 1
REQUEST, REPLY, ERROR, STATS = 0x01, 0x02, 0x03, 0x04
READY, HEARTBEAT, BATCH, RESULT, FAILED, DISCONNECT = 0x10, 0x11, 0x12, 0x13, 0x14, 0x15

# --------------------------------------------------------------------- §12 error codes

INVALID_ARGUMENT = 1
NOT_FOUND = 2
DEADLINE_EXCEEDED = 3
OVERLOADED = 4
UNAVAILABLE = 5
INTERNAL = 6
UNSUPPORTED_VERSION = 7

# --------------------------------------------------------------------- §5.2 dtypes

DTYPES: dict[str, np.dtype[Any]] = {
    "bool": np.dtype("|b1"),
    "uint8": np.dtype("|u1"),
    "int8": np.dtype("|i1"),
    "uint16": np.dtype("<u2"),
    "int16": np.dtype("<i2"),
    "uint32": np.dtype("<u4"),
    "int32": np.dtype("<i4"),
    "uint64": np.dtype("<u8"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}


def header(command: int, version: int = VERSION) -> bytes:
    return MAGIC + bytes((version, command))


def pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def descriptor(name: str, arr: np.ndarray[Any, Any]) -> dict[str, Any]:
    """§5.1: a tensor descriptor for a numpy array (its dtype must be a wire dtype)."""
    assert arr.dtype.name in DTYPES
    return {"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape)}


def payload(arr: np.ndarray[Any, Any]) -> bytes:
    """§5.2: little-endian, C order, no padding."""
    return np.ascontiguousarray(arr, dtype=DTYPES[arr.dtype.name]).tobytes(order="C")


def tensor(desc: Mapping[str, Any], frame: bytes, shape: Sequence[int] | None = None) -> Any:
    """§5.1: rebuild an array from a descriptor and its payload frame, checking the length."""
    dtype = DTYPES[desc["dtype"]]
    shape = list(desc["shape"] if shape is None else shape)
    # Dim 0 counts samples; later dims may be 0 in replies (an empty output).
    assert all(isinstance(d, int) and d >= (1 if i == 0 else 0) for i, d in enumerate(shape))
    assert len(frame) == int(np.prod(shape)) * dtype.itemsize, (desc, len(frame))
    return np.frombuffer(frame, dtype).reshape(shape)


@dataclass
class Message:
    """A framed message: §2.1 header, meta and payload frames."""

    command: int
    meta: dict[str, Any]
    payload: list[bytes]


def parse(frames: Sequence[bytes]) -> Message:
    assert len(frames) >= 1
    hdr = frames[0]
    assert len(hdr) == 4, hdr
    assert hdr[:2] == MAGIC, hdr
    assert hdr[2] == VERSION, hdr
    meta = unpack(frames[1]) if len(frames) > 1 else {}
    assert isinstance(meta, dict)
    return Message(hdr[3], meta, list(frames[2:]))


def is_simple(frames: Sequence[bytes]) -> bool:
    """§2.3: one frame whose first byte is a msgpack map marker."""
    return (
        len(frames) == 1
        and bool(frames[0])
        and (0x80 <= frames[0][0] <= 0x8F or frames[0][0] in (0xDE, 0xDF))
    )


# --------------------------------------------------------------------- sockets


class Net:
    """Our own zmq context; every socket made here is closed with linger=0 at teardown."""

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        done = threading.Event()

        def term() -> None:
            self.context.term()
            done.set()

        threading.Thread(target=term, daemon=True).start()
        assert done.wait(10), "zmq context term() hung: a socket was left open"


def recv(sock: zmq.Socket[bytes], timeout_s: float = GUARD_S) -> list[bytes]:
    if not sock.poll(round(timeout_s * 1000)):
        raise AssertionError(f"nothing received within {timeout_s} s")
    return sock.recv_multipart()


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def start_broker() -> Iterator[Callable[..., BrokerServer]]:
    """Start real brokers on free loopback ports; all are stopped and closed at teardown."""
    with contextlib.ExitStack() as stack:

        def start(max_batch: int = 8, max_wait_s: float = 0.005, **config: Any) -> BrokerServer:
            cfg = BrokerConfig(
                frontend="tcp://127.0.0.1:*",
                backend="tcp://127.0.0.1:*",
                # The minibus rule (full, or the oldest waited T_max) keeps batches predictable.
                batching=BatchingConfig(max_batch=max_batch, max_wait_s=max_wait_s, policy="fixed"),
                # NOT_FOUND from the start, as the worked example shows (§12's grace is 0).
                **{"register_grace_s": 0.0, **config},
            )
            broker: BrokerServer = stack.enter_context(ServerThread(BrokerServer(cfg)))
            return broker

        yield start


# --------------------------------------------------------------------- models


@dataclass(frozen=True)
class Model:
    """A model spec (§8.1) and what the raw worker computes: output = 2 * input + 1."""

    name: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    max_batch: int
    # output name -> input name it is computed from
    source: dict[str, str]

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "max_batch": self.max_batch,
        }

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return {out: affine(inputs[src]) for out, src in self.source.items()}


def affine(x: Any) -> Any:
    return (x * 2 + 1).astype(x.dtype)


AFFINE = Model(
    "affine",
    [{"name": "x", "dtype": "float32", "shape": [-1, 3]}],
    [{"name": "y", "dtype": "float32", "shape": [-1, 3]}],
    max_batch=8,
    source={"y": "x"},
)
# Two inputs, one with a dynamic item dim.
PAIR = Model(
    "pair",
    [
        {"name": "a", "dtype": "float32", "shape": [-1, 2]},
        {"name": "b", "dtype": "int16", "shape": [-1, -1]},
    ],
    [
        {"name": "a2", "dtype": "float32", "shape": [-1, 2]},
        {"name": "b2", "dtype": "int16", "shape": [-1, -1]},
    ],
    max_batch=8,
    source={"a2": "a", "b2": "b"},
)


# --------------------------------------------------------------------- the raw worker (§8, §10)


@dataclass
class Batch:
    meta: dict[str, Any]
    frames: list[bytes]

    @property
    def id(self) -> int:
        batch_id: int = self.meta["batch"]
        return batch_id

    @property
    def requests(self) -> list[dict[str, Any]]:
        reqs: list[dict[str, Any]] = self.meta["requests"]
        return reqs


class RawWorker:
    """A worker DEALER on the backend, from §8 and §10 of the document."""

    def __init__(
        self,
        net: Net,
        endpoint: str,
        models: Sequence[Model] = (AFFINE,),
        *,
        name: str = "raw-worker",
        slots: int = 2,
        heartbeat_ms: int = 10_000,
        ready: bool = True,
    ) -> None:
        self.net = net
        self.endpoint = endpoint
        self.models = {m.name: m for m in models}
        self.name = name
        self.slots = slots
        self.heartbeat_ms = heartbeat_ms
        self.silent = False  # True: play dead (send no heartbeats)
        self.rho = 0.0  # the load reported in HEARTBEAT
        self.heartbeats_heard = 0
        self.sock = net.socket(zmq.DEALER, endpoint)
        self.last_sent = time.monotonic()
        if ready:
            self.send_ready()

    def ready_meta(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slots": self.slots,
            "heartbeat_ms": self.heartbeat_ms,
            "models": [m.spec() for m in self.models.values()],
        }

    def send(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames))
        self.last_sent = time.monotonic()

    def send_ready(self) -> None:
        self.send([header(READY), pack(self.ready_meta())])

    def reconnect(self) -> None:
        """§10.4: close the socket, open a new one, READY again."""
        self.sock.close(linger=0)
        self.sock = self.net.socket(zmq.DEALER, self.endpoint)
        self.send_ready()

    def tick(self) -> None:
        """§10.3: a HEARTBEAT every heartbeat_ms (unless playing dead)."""
        if not self.silent and time.monotonic() - self.last_sent >= self.heartbeat_ms / 1000:
            self.heartbeat()

    def heartbeat(self) -> None:
        self.send([header(HEARTBEAT), pack({"rho": self.rho})])

    def recv(self, timeout_s: float = GUARD_S) -> Message:
        """The next message from the broker other than HEARTBEAT."""
        until = time.monotonic() + timeout_s
        while True:
            self.tick()
            left = until - time.monotonic()
            if left <= 0:
                raise AssertionError(f"worker heard nothing but heartbeats within {timeout_s} s")
            wait_s = min(left, self.heartbeat_ms / 1000)
            if not self.sock.poll(max(1, round(wait_s * 1000))):
                continue
            msg = parse(self.sock.recv_multipart())
            if msg.command == HEARTBEAT:
                self.heartbeats_heard += 1
                continue
            return msg

    def next_batch(self, timeout_s: float = GUARD_S) -> Batch:
        msg = self.recv(timeout_s)
        assert msg.command == BATCH, msg
        batch = Batch(msg.meta, msg.payload)
        check_batch_layout(batch)
        return batch

    def stack(self, batch: Batch) -> dict[str, Any]:
        """§9.2: request-major frames -> one array per input, concatenated along dim 0."""
        inputs = batch.meta["inputs"]
        width = len(inputs)
        assert len(batch.frames) == width * len(batch.requests)
        stacked = {}
        for j, spec in enumerate(inputs):
            parts = [
                tensor(spec, self.bytes_of(batch, i, j), [req["n"], *spec["shape"][1:]])
                for i, req in enumerate(batch.requests)
            ]
            stacked[spec["name"]] = np.concatenate(parts, axis=0)
        return stacked

    def bytes_of(self, batch: Batch, i: int, j: int) -> bytes:
        """Request i's input j: its frame, or (§5.4) the bytes its reference points at."""
        frame = batch.frames[i * len(batch.meta["inputs"]) + j]
        refs = batch.requests[i].get("shm")
        if refs is None or refs[j] is None:
            return frame
        assert frame == b""
        with open(f"/dev/shm/{refs[j]['region']}", "rb") as f:
            head = f.read(32)
        assert head[:16] == b"carpool-shm-v1\0\0", "not a carpool region"
        assert head[16:32].hex() == refs[j]["key"], "the reference's key is not the region's"
        spec = batch.meta["inputs"][j]
        size = int(np.prod([batch.requests[i]["n"], *spec["shape"][1:]]))
        size *= DTYPES[spec["dtype"]].itemsize
        with open(f"/dev/shm/{refs[j]['region']}", "rb") as f:
            f.seek(refs[j]["offset"])
            return f.read(size)

    def client_replies(
        self, batch: Batch, outputs: Mapping[str, Any], compute_ms: float = 1.0
    ) -> list[list[bytes]]:
        """§8.4: the finished client reply of every request, in BATCH order."""
        total = sum(r["n"] for r in batch.requests)
        replies = []
        offset = 0
        for req in batch.requests:
            rows = slice(offset, offset + req["n"])
            offset += req["n"]
            pieces = {name: arr[rows] for name, arr in outputs.items()}
            meta: dict[str, Any] = {
                "id": req["id"],
                "outputs": [descriptor(name, arr) for name, arr in pieces.items()],
                "batch_size": total,
                "queue_ms": req["queue_ms"],
                "compute_ms": compute_ms,
            }
            if req["simple"]:
                meta["v"] = VERSION
                for desc, arr in zip(meta["outputs"], pieces.values(), strict=True):
                    desc["data"] = payload(arr)
                replies.append([pack(meta)])
            else:
                replies.append([header(REPLY), pack(meta), *map(payload, pieces.values())])
        return replies

    def send_result(self, batch: Batch, replies: Sequence[Sequence[bytes]]) -> None:
        meta = {
            "batch": batch.id,
            "rho": 0.5,
            "compute_ms": 1.0,
            "frames": [len(r) for r in replies],
        }
        self.send([header(RESULT), pack(meta), *(f for r in replies for f in r)])

    def answer(self, batch: Batch) -> dict[str, Any]:
        """Run the model on a batch and send the RESULT; returns the batch inputs."""
        inputs = self.stack(batch)
        outputs = self.models[batch.meta["model"]].run(inputs)
        self.send_result(batch, self.client_replies(batch, outputs))
        return inputs

    def fail(self, batch: Batch, code: int, message: str) -> None:
        self.send([header(FAILED), pack({"batch": batch.id, "code": code, "message": message})])

    def disconnect(self) -> None:
        self.send([header(DISCONNECT), pack({"reason": "raw worker leaving"})])


def check_batch_layout(batch: Batch) -> None:
    """§8.3: the fields and the frame count of a BATCH."""
    meta = batch.meta
    assert isinstance(meta["batch"], int)
    assert isinstance(meta["model"], str)
    assert meta["inputs"]
    for spec in meta["inputs"]:
        assert spec["shape"][0] == -1
        assert all(d >= 1 for d in spec["shape"][1:])
    assert meta["requests"]
    for req in meta["requests"]:
        assert isinstance(req["id"], int)
        assert req["n"] >= 1
        assert isinstance(req["simple"], bool)
        assert isinstance(req["queue_ms"], (int, float))
        assert req["queue_ms"] >= 0
    assert len(batch.frames) == len(meta["inputs"]) * len(meta["requests"])


# --------------------------------------------------------------------- the raw client (§6, §7)


class RawClient:
    """A client on the frontend: DEALER (framed) or REQ (framed or simple)."""

    def __init__(self, net: Net, endpoint: str, kind: int = zmq.DEALER) -> None:
        self.sock = net.socket(kind, endpoint)

    def send(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames))

    def request(
        self,
        rid: int,
        model: str,
        inputs: Mapping[str, Any],
        *,
        timeout_ms: int | None = 2000,
        **extra: Any,
    ) -> None:
        """§6.1: header, meta, one payload frame per input in `inputs` order."""
        meta: dict[str, Any] = {
            "id": rid,
            "model": model,
            "inputs": [descriptor(name, arr) for name, arr in inputs.items()],
            **extra,
        }
        if timeout_ms is not None:
            meta["timeout_ms"] = timeout_ms
        self.send([header(REQUEST), pack(meta), *map(payload, inputs.values())])

    def simple_request(
        self, rid: int, model: str, inputs: Mapping[str, Any], *, timeout_ms: int = 2000
    ) -> None:
        """§7: one msgpack map with the tensors inline."""
        tensors = [{**descriptor(name, arr), "data": payload(arr)} for name, arr in inputs.items()]
        body = {"v": VERSION, "id": rid, "model": model, "timeout_ms": timeout_ms}
        self.send([pack({**body, "inputs": tensors})])

    def recv_frames(self, timeout_s: float = GUARD_S) -> list[bytes]:
        return recv(self.sock, timeout_s)

    def recv(self, timeout_s: float = GUARD_S) -> Message:
        return parse(self.recv_frames(timeout_s))

    def recv_simple(self, timeout_s: float = GUARD_S) -> dict[str, Any]:
        frames = self.recv_frames(timeout_s)
        assert is_simple(frames), frames
        reply: dict[str, Any] = unpack(frames[0])
        assert reply["v"] == VERSION
        return reply

    def reply_outputs(self, msg: Message) -> dict[str, Any]:
        """§6.2: check a REPLY and rebuild its outputs."""
        assert msg.command == REPLY, msg
        assert len(msg.payload) == len(msg.meta["outputs"])
        return {
            desc["name"]: tensor(desc, frame)
            for desc, frame in zip(msg.meta["outputs"], msg.payload, strict=True)
        }

    def expect_error(self, code: int, rid: int | None) -> Message:
        msg = self.recv()
        assert msg.command == ERROR, msg
        assert msg.payload == []
        assert msg.meta["code"] == code, msg.meta
        assert msg.meta["id"] == rid, msg.meta
        assert isinstance(msg.meta["message"], str)
        return msg

    def stats(self) -> dict[str, Any]:
        """§6.4: STATS with an empty meta; the reply must be the next message."""
        self.send([header(STATS), pack({})])
        msg = self.recv()
        assert msg.command == STATS, f"expected the STATS reply first, got {msg}"
        return msg.meta

    def wait_stats(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        workers: Sequence[RawWorker] = (),
        timeout_s: float = GUARD_S,
    ) -> dict[str, Any]:
        """Ask STATS until ``predicate`` holds, keeping ``workers`` heartbeating meanwhile."""
        until = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() > until:
                raise AssertionError(f"STATS never satisfied the condition: {stats}")
            for w in workers:
                w.tick()


def registered(*names: str) -> Callable[[dict[str, Any]], bool]:
    def check(stats: dict[str, Any]) -> bool:
        return sorted(w["name"] for w in stats["workers"]) == sorted(names)

    return check


def x_of(rows: int, start: float = 0.0) -> Any:
    return (np.arange(rows * 3, dtype="<f4") + start).reshape(rows, 3)


def serve_one(client: RawClient, worker: RawWorker, rid: int) -> None:
    """A good framed request is served: the broker is still fine."""
    x = x_of(2, start=float(rid))
    client.request(rid, "affine", {"x": x})
    worker.answer(worker.next_batch())
    msg = client.recv()
    assert msg.meta["id"] == rid
    np.testing.assert_array_equal(client.reply_outputs(msg)["y"], affine(x))


@dataclass
class Fleet:
    broker: BrokerServer
    client: RawClient
    worker: RawWorker


@pytest.fixture
def fleet(net: Net, start_broker: Callable[..., BrokerServer]) -> Fleet:
    """A broker, one raw worker serving AFFINE (registered), one DEALER client."""
    broker = start_broker()
    worker = RawWorker(net, broker.backend_endpoint)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"))
    return Fleet(broker, client, worker)


# ===================================================================== tests: happy paths


def test_framed_requests_are_batched_request_major(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    # B_max 4 and a long T_max: 1 + 3 samples fill a batch, so it leaves at once.
    broker = start_broker(max_batch=4, max_wait_s=5.0)
    worker = RawWorker(net, broker.backend_endpoint, (PAIR,), slots=2)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"))

    a0 = np.array([[1.5, -2.0]], dtype="<f4")
    b0 = np.array([[1, 2, 3, 4]], dtype="<i2")
    a1 = np.arange(6, dtype="<f4").reshape(3, 2)
    b1 = np.arange(12, dtype="<i2").reshape(3, 4) - 6
    # Inputs in reverse spec order: the broker puts them in spec order (§9.2).
    client.request(10, "pair", {"b": b0, "a": a0})
    client.request(11, "pair", {"b": b1, "a": a1}, priority=1)
    # Another item shape for the dynamic dim: a separate key, so a separate batch (§9.1).
    a2 = np.ones((4, 2), dtype="<f4")
    b2 = np.full((4, 5), 7, dtype="<i2")
    client.request(12, "pair", {"a": a2, "b": b2})

    first = worker.next_batch()
    assert first.meta["model"] == "pair"
    assert first.meta["inputs"] == [
        {"name": "a", "dtype": "float32", "shape": [-1, 2]},
        {"name": "b", "dtype": "int16", "shape": [-1, 4]},
    ]
    assert [(r["id"], r["n"], r["simple"]) for r in first.requests] == [
        (10, 1, False),
        (11, 3, False),
    ]
    # Request-major: r0.a, r0.b, r1.a, r1.b, each the client's own bytes.
    assert first.frames == [payload(a0), payload(b0), payload(a1), payload(b1)]
    stacked = worker.stack(first)
    np.testing.assert_array_equal(stacked["a"], np.concatenate([a0, a1]))
    np.testing.assert_array_equal(stacked["b"], np.concatenate([b0, b1]))

    second = worker.next_batch()
    assert second.meta["inputs"][1]["shape"] == [-1, 5]
    assert [(r["id"], r["n"]) for r in second.requests] == [(12, 4)]
    assert second.id != first.id

    worker.answer(second)
    worker.answer(first)
    got = {}
    for _ in range(3):
        msg = client.recv()
        got[msg.meta["id"]] = (msg.meta, client.reply_outputs(msg))
    assert sorted(got) == [10, 11, 12]
    for rid, a, b, batch_size in ((10, a0, b0, 4), (11, a1, b1, 4), (12, a2, b2, 4)):
        meta, outputs = got[rid]
        assert meta["batch_size"] == batch_size
        assert meta["queue_ms"] >= 0
        np.testing.assert_array_equal(outputs["a2"], affine(a))
        np.testing.assert_array_equal(outputs["b2"], affine(b))
        assert outputs["b2"].dtype == np.dtype("<i2")
    stats = client.stats()
    assert stats["batch_sizes"] == {"pair": {"4": 2}}
    assert stats["inflight_batches"] == 0


def test_simple_form_and_framed_form_through_a_req_socket(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker()
    worker = RawWorker(net, broker.backend_endpoint)
    watcher = RawClient(net, broker.frontend_endpoint)
    watcher.wait_stats(registered("raw-worker"))
    req = RawClient(net, broker.frontend_endpoint, zmq.REQ)

    # Simple form: one map in, one map out; the REQ adds and strips the delimiter (§2.2).
    x = np.array([[1.5, -2.0, 0.25]], dtype="<f4")
    req.simple_request(8, "affine", {"x": x})
    batch = worker.next_batch()
    assert [(r["id"], r["n"], r["simple"]) for r in batch.requests] == [(8, 1, True)]
    worker.answer(batch)
    reply = req.recv_simple()
    assert reply["id"] == 8
    assert "error" not in reply
    [out] = reply["outputs"]
    assert (out["name"], out["dtype"], out["shape"]) == ("y", "float32", [1, 3])
    np.testing.assert_array_equal(tensor(out, out["data"]), affine(x))
    assert reply["batch_size"] == 1

    # The framed form works from a REQ too.
    x2 = x_of(3)
    req.request(9, "affine", {"x": x2})
    batch = worker.next_batch()
    assert batch.requests[0]["simple"] is False
    worker.answer(batch)
    msg = req.recv()
    assert msg.meta["id"] == 9
    np.testing.assert_array_equal(req.reply_outputs(msg)["y"], affine(x2))

    # STATS from a REQ: a bare header is enough (§6.4).
    req.send([header(STATS)])
    stats = req.recv()
    assert stats.command == STATS
    assert stats.meta["replies"] == 2
    assert [w["name"] for w in stats.meta["workers"]] == ["raw-worker"]

    # The simple form from a DEALER (no delimiter) works as well.
    x3 = x_of(1, start=9)
    watcher.simple_request(77, "affine", {"x": x3})
    worker.answer(worker.next_batch())
    reply = watcher.recv_simple()
    assert reply["id"] == 77
    np.testing.assert_array_equal(
        tensor(reply["outputs"][0], reply["outputs"][0]["data"]), affine(x3)
    )


def test_a_dealer_may_send_the_empty_delimiter_and_gets_it_back(
    fleet: Fleet,
) -> None:
    client, worker = fleet.client, fleet.worker
    x = x_of(1)
    meta = {"id": 5, "model": "affine", "inputs": [descriptor("x", x)]}
    client.send([b"", header(REQUEST), pack(meta), payload(x)])
    worker.answer(worker.next_batch())
    frames = client.recv_frames()
    assert frames[0] == b""
    msg = parse(frames[1:])
    assert msg.meta["id"] == 5
    np.testing.assert_array_equal(client.reply_outputs(msg)["y"], affine(x))


def test_a_worker_may_answer_one_request_of_a_batch_with_an_error(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker(max_batch=2, max_wait_s=5.0)
    worker = RawWorker(net, broker.backend_endpoint)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"))
    client.request(1, "affine", {"x": x_of(1)})
    client.request(2, "affine", {"x": x_of(1, 5)})
    batch = worker.next_batch()
    assert [r["id"] for r in batch.requests] == [1, 2]
    replies = worker.client_replies(batch, AFFINE.run(worker.stack(batch)))
    replies[1] = [header(ERROR), pack({"id": 2, "code": INVALID_ARGUMENT, "message": "no"})]
    worker.send_result(batch, replies)
    got = {m.meta["id"]: m for m in (client.recv(), client.recv())}
    assert got[1].command == REPLY
    assert got[2].command == ERROR
    assert got[2].meta["code"] == INVALID_ARGUMENT


# ===================================================================== tests: client errors


X23 = np.zeros((2, 3), dtype="<f4")
GOOD_META = {"id": 42, "model": "affine", "inputs": [descriptor("x", X23)]}


def bad_request(meta_change: Mapping[str, Any], *frames: bytes) -> list[bytes]:
    meta = {**GOOD_META, **meta_change}
    return [header(REQUEST), pack(meta), *(frames or (payload(X23),))]


def tensor_change(**change: Any) -> dict[str, Any]:
    return {"inputs": [{**descriptor("x", X23), **change}]}


FRAMED_ERRORS: dict[str, tuple[list[bytes], int, int | None]] = {
    # name: (frames, expected code, expected id)
    "unknown model": (bad_request({"model": "nope"}), NOT_FOUND, 42),
    "wrong dtype": (
        bad_request(tensor_change(dtype="float64"), np.zeros((2, 3)).tobytes()),
        INVALID_ARGUMENT,
        42,
    ),
    "dtype not on the list": (bad_request(tensor_change(dtype="complex64")), INVALID_ARGUMENT, 42),
    "numpy byte-order dtype name": (bad_request(tensor_change(dtype="<f4")), INVALID_ARGUMENT, 42),
    "wrong item shape": (
        bad_request(tensor_change(shape=[2, 4]), bytes(32)),
        INVALID_ARGUMENT,
        42,
    ),
    "wrong rank": (bad_request(tensor_change(shape=[6]), bytes(24)), INVALID_ARGUMENT, 42),
    "zero-size dim": (bad_request(tensor_change(shape=[0, 3]), b""), INVALID_ARGUMENT, 42),
    "rank over 8": (
        bad_request(tensor_change(shape=[1] * 9), bytes(4)),
        INVALID_ARGUMENT,
        42,
    ),
    "payload too short": (bad_request({}, bytes(20)), INVALID_ARGUMENT, 42),
    "payload too long": (bad_request({}, bytes(28)), INVALID_ARGUMENT, 42),
    "payload frame missing": ([header(REQUEST), pack(GOOD_META)], INVALID_ARGUMENT, 42),
    "extra payload frame": (bad_request({}, bytes(24), bytes(24)), INVALID_ARGUMENT, 42),
    "wrong input name": (bad_request(tensor_change(name="z")), INVALID_ARGUMENT, 42),
    "duplicate input": (
        bad_request({"inputs": [descriptor("x", X23)] * 2}, bytes(24), bytes(24)),
        INVALID_ARGUMENT,
        42,
    ),
    "no inputs": (bad_request({"inputs": []}, b"x"), INVALID_ARGUMENT, 42),
    "more samples than max_batch": (
        bad_request(tensor_change(shape=[9, 3]), bytes(9 * 12)),
        INVALID_ARGUMENT,
        42,
    ),
    "timeout_ms zero": (bad_request({"timeout_ms": 0}), INVALID_ARGUMENT, 42),
    "timeout_ms over an hour": (bad_request({"timeout_ms": 3_600_001}), INVALID_ARGUMENT, 42),
    "timeout_ms a float": (bad_request({"timeout_ms": 1.5}), INVALID_ARGUMENT, 42),
    "priority 2": (bad_request({"priority": 2}), INVALID_ARGUMENT, 42),
    "empty model name": (bad_request({"model": ""}), INVALID_ARGUMENT, 42),
    "missing id": (
        [header(REQUEST), pack({"model": "affine", "inputs": GOOD_META["inputs"]}), bytes(24)],
        INVALID_ARGUMENT,
        None,
    ),
    "negative id": (bad_request({"id": -1}), INVALID_ARGUMENT, None),
    "id that is a bool": (bad_request({"id": True}), INVALID_ARGUMENT, None),
    "meta not a map": ([header(REQUEST), pack([1, 2]), bytes(24)], INVALID_ARGUMENT, None),
    "meta not msgpack": ([header(REQUEST), b"\xc1", bytes(24)], INVALID_ARGUMENT, None),
    "meta with trailing bytes": (
        [header(REQUEST), pack(GOOD_META) + b"\x00", bytes(24)],
        INVALID_ARGUMENT,
        None,
    ),
    "meta over 64 KiB": (
        [header(REQUEST), pack({**GOOD_META, "pad": "p" * 70_000}), bytes(24)],
        INVALID_ARGUMENT,
        None,
    ),
    "meta with an ext type": (
        [header(REQUEST), pack({**GOOD_META, "e": msgpack.ExtType(1, b"x")}), bytes(24)],
        INVALID_ARGUMENT,
        None,
    ),
    "no meta frame": ([header(REQUEST)], INVALID_ARGUMENT, None),
    "bad magic": ([b"XP\x01\x01", pack(GOOD_META), bytes(24)], INVALID_ARGUMENT, None),
    "short header": ([b"CP\x01", pack(GOOD_META), bytes(24)], INVALID_ARGUMENT, None),
    "long header": ([b"CP\x01\x01\x00", pack(GOOD_META), bytes(24)], INVALID_ARGUMENT, None),
    "unknown command": ([header(0x7F), pack(GOOD_META), bytes(24)], INVALID_ARGUMENT, None),
    "worker command from a client": (
        [header(READY), pack({"name": "w", "slots": 1, "models": [AFFINE.spec()]})],
        INVALID_ARGUMENT,
        None,
    ),
    "REPLY from a client": ([header(REPLY), pack(GOOD_META)], INVALID_ARGUMENT, None),
    "version 2": ([header(REQUEST, 2), pack(GOOD_META), bytes(24)], UNSUPPORTED_VERSION, None),
    "version 0": ([header(REQUEST, 0), pack(GOOD_META), bytes(24)], UNSUPPORTED_VERSION, None),
    "STATS of version 2": ([header(STATS, 2)], UNSUPPORTED_VERSION, None),
    "garbage frame": ([b"hello, broker"], INVALID_ARGUMENT, None),
    "one empty frame": ([b""], INVALID_ARGUMENT, None),
    "garbage frames": ([b"\x00\xff\x10", b"\x01", b"\x02\x03"], INVALID_ARGUMENT, None),
}


@pytest.mark.parametrize("case", FRAMED_ERRORS)
def test_framed_errors_are_typed_and_the_broker_keeps_serving(case: str, fleet: Fleet) -> None:
    client, worker = fleet.client, fleet.worker
    frames, code, rid = FRAMED_ERRORS[case]
    client.send(frames)
    msg = client.expect_error(code, rid)
    assert msg.meta["message"]
    serve_one(client, worker, 1000)


def simple_frame(change: Mapping[str, Any] | None = None, **tensor_fields: Any) -> bytes:
    x = np.zeros((1, 3), dtype="<f4")
    t = {**descriptor("x", x), "data": payload(x), **tensor_fields}
    return pack({"v": 1, "id": 8, "model": "affine", "inputs": [t], **(change or {})})


SIMPLE_ERRORS: dict[str, tuple[bytes, int, tuple[int | None, ...]]] = {
    # name: (frame, expected code, acceptable ids). The document says the id is nil only
    # when the request could not be decoded, so both are allowed for decode-level errors.
    "unknown model": (simple_frame({"model": "nope"}), NOT_FOUND, (8,)),
    "wrong dtype for the model": (
        simple_frame(dtype="float64", data=bytes(24)),
        INVALID_ARGUMENT,
        (8,),
    ),
    "version 2": (simple_frame({"v": 2}), UNSUPPORTED_VERSION, (None, 8)),
    "no version": (
        pack({"id": 8, "model": "affine", "inputs": []}),
        INVALID_ARGUMENT,
        (None, 8),
    ),
    "data missing": (simple_frame(data=None), INVALID_ARGUMENT, (None, 8)),
    "data as str": (simple_frame(data="abcdefghijkl"), INVALID_ARGUMENT, (None, 8)),
    "data too short": (simple_frame(data=bytes(11)), INVALID_ARGUMENT, (None, 8)),
    "truncated map": (b"\x82\xa1v\x01", INVALID_ARGUMENT, (None,)),
    "empty map": (pack({}), INVALID_ARGUMENT, (None,)),
}


@pytest.mark.parametrize("case", SIMPLE_ERRORS)
def test_simple_form_errors_come_back_in_the_simple_form(case: str, net: Net, fleet: Fleet) -> None:
    worker = fleet.worker
    req = RawClient(net, fleet.broker.frontend_endpoint, zmq.REQ)
    frame, code, ids = SIMPLE_ERRORS[case]
    req.send([frame])
    reply = req.recv_simple()
    assert reply["id"] in ids, reply
    assert reply["error"]["code"] == code, reply
    assert isinstance(reply["error"]["message"], str)
    assert "outputs" not in reply
    # The same REQ socket goes on: a good simple request is served.
    x = x_of(1, start=3)
    req.simple_request(9, "affine", {"x": x})
    worker.answer(worker.next_batch())
    ok = req.recv_simple()
    assert ok["id"] == 9
    np.testing.assert_array_equal(tensor(ok["outputs"][0], ok["outputs"][0]["data"]), affine(x))


def test_garbage_from_a_req_socket_gets_a_framed_error_with_a_delimiter(
    net: Net, fleet: Fleet
) -> None:
    client, worker = fleet.client, fleet.worker
    req = RawClient(net, fleet.broker.frontend_endpoint, zmq.REQ)
    req.send([b"\x00garbage"])
    req.expect_error(INVALID_ARGUMENT, None)
    req.send([header(REQUEST, 9), b"\x80"])
    req.expect_error(UNSUPPORTED_VERSION, None)
    serve_one(client, worker, 1)


def test_known_model_without_a_live_worker_is_unavailable(
    fleet: Fleet,
) -> None:
    client, worker = fleet.client, fleet.worker
    worker.disconnect()
    client.wait_stats(registered())
    client.request(3, "affine", {"x": x_of(1)})
    client.expect_error(UNAVAILABLE, 3)
    client.request(4, "never-seen", {"x": x_of(1)})
    client.expect_error(NOT_FOUND, 4)


def test_a_full_queue_is_overloaded_with_a_retry_hint(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker(max_batch=1, max_wait_s=0.02, max_queued=1)
    worker = RawWorker(net, broker.backend_endpoint, slots=1)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"))
    client.request(1, "affine", {"x": x_of(1)})  # dispatched: the worker's only credit
    client.request(2, "affine", {"x": x_of(1)})  # queued: no credit left
    client.request(3, "affine", {"x": x_of(1)})  # the queue is full
    msg = client.expect_error(OVERLOADED, 3)
    assert msg.meta["retry_after_ms"] >= 1
    first = worker.next_batch()
    assert [r["id"] for r in first.requests] == [1]
    worker.answer(first)  # the credit comes back, so request 2 leaves
    second = worker.next_batch()
    assert [r["id"] for r in second.requests] == [2]
    worker.answer(second)
    assert sorted(client.recv().meta["id"] for _ in range(2)) == [1, 2]


# ===================================================================== tests: worker errors


def test_failed_batch_gives_every_client_the_workers_code(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker(max_batch=2, max_wait_s=5.0)
    worker = RawWorker(net, broker.backend_endpoint, slots=1)
    dealer = RawClient(net, broker.frontend_endpoint)
    dealer.wait_stats(registered("raw-worker"))
    req = RawClient(net, broker.frontend_endpoint, zmq.REQ)
    # A framed and a simple request share one batch (§9.1).
    dealer.request(1, "affine", {"x": x_of(1)})
    req.simple_request(2, "affine", {"x": x_of(1)})
    batch = worker.next_batch()
    assert sorted((r["id"], r["simple"]) for r in batch.requests) == [(1, False), (2, True)]
    worker.fail(batch, INTERNAL, "engine exploded")
    msg = dealer.expect_error(INTERNAL, 1)
    assert msg.meta["message"] == "engine exploded"
    reply = req.recv_simple()
    assert reply["id"] == 2
    assert reply["error"]["code"] == INTERNAL
    assert reply["error"]["message"] == "engine exploded"
    # The credit came back with FAILED: the worker gets the next batch.
    dealer.request(3, "affine", {"x": x_of(1)})
    dealer.request(4, "affine", {"x": x_of(1)})
    batch = worker.next_batch()
    worker.fail(batch, DEADLINE_EXCEEDED, "too slow")
    for _ in range(2):
        assert dealer.recv().meta["code"] == DEADLINE_EXCEEDED


def test_unknown_failed_code_becomes_internal(fleet: Fleet) -> None:
    client, worker = fleet.client, fleet.worker
    client.request(1, "affine", {"x": x_of(1)})
    worker.fail(worker.next_batch(), 99, "strange")
    msg = client.expect_error(INTERNAL, 1)
    assert "99" in msg.meta["message"]
    assert "strange" in msg.meta["message"]


@pytest.mark.parametrize("counts", [[], [3, 3], [2]])
def test_result_whose_frame_counts_do_not_add_up_is_internal(
    counts: list[int], fleet: Fleet
) -> None:
    client, worker = fleet.client, fleet.worker
    client.request(1, "affine", {"x": x_of(1)})
    batch = worker.next_batch()
    [reply] = worker.client_replies(batch, AFFINE.run(worker.stack(batch)))
    meta = {"batch": batch.id, "rho": 0.0, "compute_ms": 0.0, "frames": counts}
    worker.send([header(RESULT), pack(meta), *reply])
    client.expect_error(INTERNAL, 1)
    serve_one(client, worker, 2)  # the credit came back and the worker is still registered


# ===================================================================== tests: deadlines


def test_deadlines_are_relative_and_a_late_result_is_dropped(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    """Each ``timeout_ms`` counts from its own request's arrival: request 1 (100 ms)
    reaches the worker, then 1 and 2 (150 ms) end DEADLINE_EXCEEDED, in that order, while
    3 (30 s), sent with them, still waits (the exact instant a deadline passes is the
    core's arithmetic, tests/unit/broker/test_core.py::test_deadline_while_queued). The
    worker's late result for 1 is dropped: the credit comes back, takes 3, and 3's reply
    is the next message the client gets."""
    broker = start_broker(max_batch=1, max_wait_s=0.0)
    worker = RawWorker(net, broker.backend_endpoint, slots=1)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"))
    client.request(1, "affine", {"x": x_of(1)}, timeout_ms=100)  # in flight at the worker
    client.request(2, "affine", {"x": x_of(1)}, timeout_ms=150)  # queued: no credit
    client.request(3, "affine", {"x": x_of(1)}, timeout_ms=30_000)  # queued behind it
    held = worker.next_batch()
    assert [r["id"] for r in held.requests] == [1]
    first = client.expect_error(DEADLINE_EXCEEDED, 1)
    assert first.meta["message"]
    client.expect_error(DEADLINE_EXCEEDED, 2)
    assert client.stats()["queued"] == 1  # 3: its deadline is its own
    # The worker finishes after all: no second answer for request 1, and the credit returns.
    worker.answer(held)
    batch = worker.next_batch()
    assert [r["id"] for r in batch.requests] == [3]
    worker.answer(batch)
    assert client.recv().meta["id"] == 3
    stats = client.wait_stats(lambda s: s["inflight_batches"] == 0)
    assert stats["replies"] == 1
    serve_one(client, worker, 4)


def test_a_request_without_timeout_uses_the_broker_default(
    fleet: Fleet,
) -> None:
    client, worker = fleet.client, fleet.worker
    client.request(1, "affine", {"x": x_of(1)}, timeout_ms=None)
    worker.answer(worker.next_batch())
    assert client.recv().meta["id"] == 1


# ===================================================================== tests: worker lifecycle


def test_heartbeats_flow_both_ways_and_silence_loses_the_worker(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker()
    worker = RawWorker(net, broker.backend_endpoint, heartbeat_ms=50)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"), [worker])

    # The broker heartbeats at the worker's interval: [header, empty map]. Four of them
    # span more than the 3 intervals of silence that lose a worker: heartbeating, it stays.
    until = time.monotonic() + GUARD_S
    while worker.heartbeats_heard < 4:
        assert time.monotonic() < until, "fewer than 4 HEARTBEATs from the broker"
        worker.tick()
        if worker.sock.poll(10):
            frames = worker.sock.recv_multipart()
            assert frames == [header(HEARTBEAT), b"\x80"], frames
            worker.heartbeats_heard += 1
    assert registered("raw-worker")(client.stats())

    worker.rho = 0.75
    worker.heartbeat()
    client.wait_stats(lambda s: [w["rho"] for w in s["workers"]] == [0.75], [worker])

    # Silence for 3 intervals: the broker forgets the worker (the instant is the core's
    # arithmetic: tests/unit/broker/test_core.py, liveness silent intervals).
    worker.silent = True
    client.wait_stats(registered())

    # Anything but READY from a forgotten worker is answered with DISCONNECT.
    worker.heartbeat()
    bye = worker.recv()
    assert bye.command == DISCONNECT
    assert isinstance(bye.meta["reason"], str)

    # A new socket and READY again, and it serves.
    worker.silent = False
    worker.reconnect()
    client.wait_stats(registered("raw-worker"), [worker])
    serve_one(client, worker, 7)


def test_unregistered_worker_gets_disconnect_then_registers(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker()
    worker = RawWorker(net, broker.backend_endpoint, ready=False)
    worker.heartbeat()
    bye = worker.recv()
    assert bye.command == DISCONNECT
    assert bye.meta["reason"]
    worker.reconnect()
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"))
    serve_one(client, worker, 1)


def test_ready_that_conflicts_with_the_registered_spec_is_refused(net: Net, fleet: Fleet) -> None:
    client, worker = fleet.client, fleet.worker
    other = Model(
        "affine",
        [{"name": "x", "dtype": "float64", "shape": [-1, 3]}],
        AFFINE.outputs,
        max_batch=8,
        source={"y": "x"},
    )
    rogue = RawWorker(net, worker.endpoint, (other,), name="rogue")
    bye = rogue.recv()
    assert bye.command == DISCONNECT
    assert "affine" in bye.meta["reason"]
    assert [w["name"] for w in client.stats()["workers"]] == ["raw-worker"]


def test_a_worker_that_breaks_the_protocol_is_dropped(
    fleet: Fleet,
) -> None:
    client, worker = fleet.client, fleet.worker
    worker.send([header(HEARTBEAT)])  # no meta frame
    assert worker.recv().command == DISCONNECT
    client.wait_stats(registered())


def test_worker_disconnect_requeues_to_a_new_worker_exactly_once(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker()
    first = RawWorker(net, broker.backend_endpoint, name="first")
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("first"))
    x = x_of(2, start=1)
    client.request(1, "affine", {"x": x}, timeout_ms=5000)
    lost = first.next_batch()
    first.disconnect()
    stats = client.wait_stats(lambda s: not s["workers"] and s["queued"] == 1)
    assert stats["requeued"] == 1

    second = RawWorker(net, broker.backend_endpoint, name="second")
    again = second.next_batch()
    assert [(r["id"], r["n"]) for r in again.requests] == [(1, 2)]
    assert again.frames == lost.frames
    second.answer(again)
    msg = client.recv()
    np.testing.assert_array_equal(client.reply_outputs(msg)["y"], affine(x))

    # The lost worker finishes after all: the broker answers it DISCONNECT and drops the
    # result. The STATS reply is the next message for the client: no second reply.
    first.answer(lost)
    assert first.recv().command == DISCONNECT
    assert client.stats()["late_results"] == 1
    assert client.stats()["replies"] == 1


def test_heartbeat_expiry_requeues_a_running_batch(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker()
    doomed = RawWorker(net, broker.backend_endpoint, name="doomed", heartbeat_ms=30)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("doomed"), [doomed])
    client.request(1, "affine", {"x": x_of(1)}, timeout_ms=5000)
    doomed.next_batch()
    doomed.silent = True  # hangs with the batch
    rescuer = RawWorker(net, broker.backend_endpoint, name="rescuer")
    batch = rescuer.next_batch()  # arrives once the broker has given up on "doomed"
    assert [r["id"] for r in batch.requests] == [1]
    rescuer.answer(batch)
    assert client.recv().meta["id"] == 1
    assert [w["name"] for w in client.stats()["workers"]] == ["rescuer"]


# ===================================================================== tests: §15 worked example


@dataclass
class HexMessage:
    title: str
    frames: list[bytes] = field(default_factory=list)


def doc_examples() -> dict[str, HexMessage]:
    """The ```hex blocks of §15: '# TITLE · ...', then 'frame i · label · N bytes' + hex."""
    out: dict[str, HexMessage] = {}
    for block in re.findall(r"```hex\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL):
        lines = block.strip("\n").split("\n")
        assert lines[0].startswith("# "), lines[0]
        msg = HexMessage(lines[0][2:].split(" · ")[0])
        sizes = []
        for line in lines[1:]:
            if line.startswith("frame "):
                parts = line.split(" · ")
                assert int(parts[0].split()[1]) == len(msg.frames)
                sizes.append(int(parts[-1].removesuffix(" bytes")))
                msg.frames.append(b"")
            else:
                msg.frames[-1] += bytes.fromhex(line)
        assert [len(f) for f in msg.frames] == sizes, msg.title
        out[msg.title] = msg
    return out


def test_doc_hex_blocks_are_well_formed() -> None:
    examples = doc_examples()
    assert sorted(examples) == sorted(
        ["READY", "REQUEST", "BATCH", "RESULT", "REPLY", "SIMPLE REQUEST", "SIMPLE REPLY", "ERROR"]
    )
    commands = {"READY": READY, "REQUEST": REQUEST, "BATCH": BATCH, "RESULT": RESULT}
    commands |= {"REPLY": REPLY, "ERROR": ERROR}
    for title, command in commands.items():
        msg = parse(examples[title].frames)
        assert msg.command == command, title
    result = parse(examples["RESULT"].frames)
    assert sum(result.meta["frames"]) == len(result.payload)
    assert result.payload == examples["REPLY"].frames
    assert is_simple(examples["SIMPLE REQUEST"].frames)
    assert is_simple(examples["SIMPLE REPLY"].frames)


def test_worked_example_replays_byte_for_byte(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    ex = doc_examples()
    broker = start_broker(max_batch=8, max_wait_s=0.005)
    worker = RawWorker(net, broker.backend_endpoint, heartbeat_ms=1000, ready=False)
    worker.send(ex["READY"].frames)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("w1"))

    # REQUEST, verbatim. The BATCH matches the document except for the measured queue_ms
    # (and the batch id, which only has to be unique).
    client.send(ex["REQUEST"].frames)
    batch = worker.next_batch()
    want = parse(ex["BATCH"].frames)
    assert batch.meta["requests"][0].pop("queue_ms") >= 0
    want.meta["requests"][0].pop("queue_ms")
    want.meta.pop("batch")
    assert {k: v for k, v in batch.meta.items() if k != "batch"} == want.meta
    assert batch.frames == want.payload
    np.testing.assert_array_equal(worker.stack(batch)["x"], [[0, 1, 2], [3, 4, 5]])

    # RESULT as in the document (with our batch id): the client gets the REPLY verbatim.
    result = list(ex["RESULT"].frames)
    meta = unpack(result[1])
    if meta["batch"] != batch.id:
        result[1] = pack({**meta, "batch": batch.id})
    worker.send(result)
    frames = client.recv_frames()
    assert frames == ex["REPLY"].frames
    np.testing.assert_array_equal(client.reply_outputs(parse(frames))["y"], [[1, 3, 5], [7, 9, 11]])

    # The simple form: the REQ's request verbatim; the worker answers with the document's
    # reply frame, and the REQ receives it unchanged.
    req = RawClient(net, broker.frontend_endpoint, zmq.REQ)
    req.send(ex["SIMPLE REQUEST"].frames)
    batch = worker.next_batch()
    assert [(r["id"], r["n"], r["simple"]) for r in batch.requests] == [(8, 1, True)]
    worker.send_result(batch, [ex["SIMPLE REPLY"].frames])
    assert req.recv_frames() == ex["SIMPLE REPLY"].frames

    # The ERROR example: same command, id and code (the message text is not normative).
    x = np.array([[1.5, -2.0, 0.25]], dtype="<f4")
    client.request(9, "nope", {"x": x}, timeout_ms=None)
    got = client.recv()
    want = parse(ex["ERROR"].frames)
    assert (got.command, got.meta["id"], got.meta["code"]) == (
        want.command,
        want.meta["id"],
        want.meta["code"],
    )


# --------------------------------------------------------------------- §5.4 shared memory


@pytest.mark.skipif(
    not (Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK)), reason="no usable /dev/shm"
)
def test_an_input_in_shared_memory_reaches_the_worker_as_a_reference(
    net: Net, start_broker: Callable[..., BrokerServer]
) -> None:
    broker = start_broker(max_batch=4, max_wait_s=0.0)
    worker = RawWorker(net, broker.backend_endpoint, (PAIR,), slots=2)
    client = RawClient(net, broker.frontend_endpoint)
    client.wait_stats(registered("raw-worker"))
    a = np.arange(6, dtype="<f4").reshape(3, 2)
    b = np.arange(12, dtype="<i2").reshape(3, 4)
    region = Path(f"/dev/shm/carpool-doc-test-{id(net):x}")
    # The client's own region: the header (magic, then its key), then `a` at offset 64.
    key = bytes(range(16))
    header_bytes = b"carpool-shm-v1\0\0" + key
    region.write_bytes(header_bytes.ljust(64, b"\0") + payload(a))
    try:
        ref = {"region": region.name, "offset": 64, "key": key.hex()}
        meta: dict[str, Any] = {
            "id": 40,
            "model": "pair",
            "timeout_ms": 2000,
            # Request order (b, a); `a` is in shared memory and its frame is empty.
            "inputs": [descriptor("b", b), {**descriptor("a", a), "shm": ref}],
            "shm_outputs": True,  # §5.5: a worker without a ring answers in frames
        }
        client.send([header(REQUEST), pack(meta), payload(b), b""])
        batch = worker.next_batch()
        # §8.3: one entry per input in spec order (a, b); the empty frame travels.
        assert batch.requests[0]["shm"] == [ref, None]
        assert batch.requests[0]["shm_outputs"] is True
        assert batch.frames == [b"", payload(b)]
        worker.answer(batch)
        outputs = client.reply_outputs(client.recv())
        np.testing.assert_array_equal(outputs["a2"], affine(a))
        np.testing.assert_array_equal(outputs["b2"], affine(b))
        # A reference next to a non-empty frame, or a region name outside carpool-*:
        client.send([header(REQUEST), pack(meta), payload(b), payload(a)])
        client.expect_error(INVALID_ARGUMENT, 40)
        meta["inputs"][1]["shm"] = {**ref, "region": "../carpool-x"}
        client.send([header(REQUEST), pack(meta), payload(b), b""])
        client.expect_error(INVALID_ARGUMENT, 40)
        # A key that is not the region's reaches the worker (the broker never opens a
        # region), which answers that request with an error (§8.4).
        meta["inputs"][1]["shm"] = {**ref, "key": "ff" * 16}
        client.send([header(REQUEST), pack(meta), payload(b), b""])
        batch = worker.next_batch()
        assert batch.requests[0]["shm"][0]["key"] == "ff" * 16
    finally:
        region.unlink()
