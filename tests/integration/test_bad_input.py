"""Bad input at the protocol boundary: a typed error reply, and the broker keeps serving."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from carpool.broker.config import BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.client import InvalidArgument, NotFound, UnsupportedVersion
from carpool.common.errors import ErrorCode, InternalError
from carpool.common.protocol import TensorMeta
from carpool.common.testing import ServerThread
from carpool.worker.engines.base import Array, EngineInfo, engine_io
from carpool.worker.engines.synthetic import SyntheticEngine
from tests.conftest import loopback_config

GOOD = np.ones((1, 4), np.float32)


@pytest.fixture
def fleet(fleet_factory: Any) -> Any:
    fleet = fleet_factory(max_batch=4, max_wait_s=0.001)
    fleet.add_worker({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=4)})
    fleet.ready()
    return fleet


@pytest.fixture
def raw(fleet: Any, context: zmq.Context[zmq.Socket[bytes]]) -> Any:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fleet.broker.frontend_endpoint)

    def exchange(frames: list[bytes]) -> list[bytes]:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no reply to a bad message"
        return sock.recv_multipart()

    yield exchange
    sock.close(linger=0)


def _error(frames: list[bytes]) -> dict[str, Any]:
    assert frames[0][:2] == b"CP"
    assert frames[0][3] == 0x03, "expected an ERROR reply"
    return msgpack.unpackb(frames[1])


def _request_meta(**overrides: Any) -> bytes:
    meta = {
        "id": 5,
        "model": "syn",
        "timeout_ms": 1000,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}],
    }
    meta.update(overrides)
    return msgpack.packb(meta)


HEADER = b"CP\x01\x01"


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        pytest.param([b"\x00garbage"], ErrorCode.INVALID_ARGUMENT, id="garbage-one-frame"),
        pytest.param([b"a", b"b", b"c"], ErrorCode.INVALID_ARGUMENT, id="garbage-frames"),
        pytest.param([HEADER], ErrorCode.INVALID_ARGUMENT, id="no-meta"),
        pytest.param([HEADER, b"\xc1"], ErrorCode.INVALID_ARGUMENT, id="bad-msgpack"),
        pytest.param([HEADER, msgpack.packb([1, 2])], ErrorCode.INVALID_ARGUMENT, id="meta-list"),
        pytest.param([b"CP\x01\x7f", b"\x80"], ErrorCode.INVALID_ARGUMENT, id="unknown-command"),
        pytest.param([b"CP\x01\x02", b"\x80"], ErrorCode.INVALID_ARGUMENT, id="reply-from-client"),
        pytest.param(
            [b"CP\x09\x01", _request_meta(), GOOD.tobytes()],
            ErrorCode.UNSUPPORTED_VERSION,
            id="version-9",
        ),
        pytest.param(
            [HEADER, _request_meta(model="nope"), GOOD.tobytes()],
            ErrorCode.NOT_FOUND,
            id="unknown-model",
        ),
        pytest.param(
            [
                HEADER,
                _request_meta(inputs=[{"name": "x", "dtype": "float64", "shape": [1, 4]}]),
                np.ones((1, 4)).tobytes(),
            ],
            ErrorCode.INVALID_ARGUMENT,
            id="wrong-dtype",
        ),
        pytest.param(
            [
                HEADER,
                _request_meta(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 5]}]),
                np.ones((1, 5), np.float32).tobytes(),
            ],
            ErrorCode.INVALID_ARGUMENT,
            id="wrong-shape",
        ),
        pytest.param(
            [HEADER, _request_meta(), GOOD.tobytes()[:-1]],
            ErrorCode.INVALID_ARGUMENT,
            id="short-payload",
        ),
        pytest.param([HEADER, _request_meta()], ErrorCode.INVALID_ARGUMENT, id="missing-payload"),
        pytest.param(
            [HEADER, _request_meta(timeout_ms=-3), GOOD.tobytes()],
            ErrorCode.INVALID_ARGUMENT,
            id="negative-timeout",
        ),
        pytest.param(
            [
                HEADER,
                _request_meta(inputs=[{"name": "x", "dtype": "object", "shape": [1, 4]}]),
                GOOD.tobytes(),
            ],
            ErrorCode.INVALID_ARGUMENT,
            id="object-dtype",
        ),
        pytest.param(
            [
                HEADER,
                _request_meta(inputs=[{"name": "y", "dtype": "float32", "shape": [1, 4]}]),
                GOOD.tobytes(),
            ],
            ErrorCode.INVALID_ARGUMENT,
            id="wrong-input-name",
        ),
        pytest.param(
            [
                HEADER,
                _request_meta(inputs=[{"name": "x", "dtype": "float32", "shape": [9, 4]}]),
                np.ones((9, 4), np.float32).tobytes(),
            ],
            ErrorCode.INVALID_ARGUMENT,
            id="too-many-samples",
        ),
        pytest.param(
            [msgpack.packb({"v": 1, "id": 3, "model": "syn", "inputs": []})],
            ErrorCode.INVALID_ARGUMENT,
            id="simple-form-no-inputs",
        ),
    ],
)
def test_bad_message_gets_typed_error_and_broker_keeps_serving(
    fleet: Any, raw: Any, frames: list[bytes], code: ErrorCode
) -> None:
    reply = raw(frames)
    # The simple form is answered in the simple form.
    err = msgpack.unpackb(reply[0])["error"] if len(reply) == 1 else _error(reply)
    assert err["code"] == code, err
    assert err["message"]
    # ... and the broker still serves a good request.
    client = fleet.client()
    np.testing.assert_array_equal(client.infer("syn", {"x": GOOD}, timeout_s=5)["y"], GOOD * 2 + 1)


def test_error_reply_carries_request_id(raw: Any) -> None:
    err = _error(raw([HEADER, _request_meta(id=77, model="nope"), GOOD.tobytes()]))
    assert err["id"] == 77


def test_unsupported_version_reply_speaks_v1(raw: Any) -> None:
    reply = raw([b"CP\x02\x01", _request_meta(), GOOD.tobytes()])
    assert reply[0] == b"CP\x01\x03"
    assert "version" in _error(reply)["message"]


def test_client_sdk_raises_typed_errors(fleet: Any) -> None:
    client = fleet.client()
    with pytest.raises(NotFound):
        client.infer("nope", {"x": GOOD})
    with pytest.raises(InvalidArgument, match="dtype"):
        client.infer("syn", {"x": GOOD.astype(np.float64)})
    with pytest.raises(InvalidArgument, match="shape"):
        client.infer("syn", {"x": np.ones((1, 3), np.float32)})
    assert issubclass(UnsupportedVersion, InvalidArgument)


def test_a_frame_over_the_brokers_limit_is_refused_and_others_are_served(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """max_frame_mib (ZMQ_MAXMSGSIZE): libzmq drops the peer that sends a larger frame
    before buffering it; the broker goes on serving everyone else."""
    config = dataclasses.replace(loopback_config(), max_frame_mib=1)
    with ServerThread(BrokerServer(config, context=context)) as broker:
        assert broker.frontend.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
        assert broker.backend.getsockopt(zmq.MAXMSGSIZE) == -1  # workers: not limited
        endpoint = broker.frontend_endpoint
        big, small = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        try:
            for sock in (big, small):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
            shape = {"inputs": [{"name": "x", "dtype": "float32", "shape": [1, 1 << 18]}]}
            # 1 MiB + 4 bytes: over the limit. No worker serves "syn" here: a request
            # the broker reads is answered NOT_FOUND.
            over = np.zeros((1, (1 << 18) + 1), np.float32)
            big.send_multipart([HEADER, _request_meta(**shape), over.tobytes()])
            assert not big.poll(1000), "a frame over the limit was read and answered"
            under = np.zeros((1, 1 << 18), np.float32)
            small.send_multipart([HEADER, _request_meta(**shape), under.tobytes()])
            assert small.poll(5000), "the broker stopped serving"
            assert _error(small.recv_multipart())["code"] == ErrorCode.NOT_FOUND
        finally:
            big.close(linger=0)
            small.close(linger=0)


def test_one_drain_takes_every_waiting_message_and_a_later_one_the_rest(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The drain asks ZMQ_EVENTS after the first message rather than reading until
    zmq.Again: several waiting messages are all handled in one turn, and one that comes
    after the drain ended wakes the next poll (level-triggered). Over inproc, a sent
    message is in the broker's queue when send returns."""
    config = BrokerConfig(frontend="inproc://drain-front", backend="inproc://drain-back")
    with BrokerServer(config, context=context) as broker:
        sock = context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(config.frontend)
            for rid in (1, 2, 3):
                sock.send_multipart([b"CP\x01\x04", msgpack.packb({"id": rid})])  # STATS
            assert broker.step(1.0) == 3
            sock.send_multipart([b"CP\x01\x04", msgpack.packb({"id": 4})])
            assert broker.step(5.0) == 1
            got: list[int] = []
            while len(got) < 4 and sock.poll(1000):
                got.append(msgpack.unpackb(sock.recv_multipart()[1])["id"])
            assert got == [1, 2, 3, 4]
        finally:
            sock.close(linger=0)


class _RankNine:
    """An engine whose output has rank 9: something protocol v1 cannot carry
    (docs/protocol.md §5.1)."""

    thread_bound = True

    def __init__(self) -> None:
        outputs = (TensorMeta("y", "float32", (-1,) * 8),)  # what it says it gives
        self.info = EngineInfo(engine_io((TensorMeta("x", "float32", (-1, 4)),), outputs, 4))

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        return {"y": np.zeros((len(inputs["x"]),) + (1,) * 8, np.float32)}

    def close(self) -> None:
        pass


@pytest.mark.timeout(30)
def test_an_output_the_protocol_cannot_carry_fails_the_request_at_once(
    fleet_factory: Any,
) -> None:
    """The worker fails the batch INTERNAL with the reason (rank 1..8), so the client has
    an answer at once, not a REPLY it cannot read and then its local deadline as if the
    broker were gone."""
    fleet = fleet_factory(max_batch=4, max_wait_s=0.0)
    fleet.add_worker({"deep": _RankNine}, warmup=False)
    client = fleet.ready()
    started = time.monotonic()
    with pytest.raises(InternalError, match=r"rank 1\.\.8"):
        client.infer("deep", {"x": GOOD}, timeout_s=20)
    assert time.monotonic() - started < 10  # an answer, not the local deadline
