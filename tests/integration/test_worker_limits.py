"""Workers with other limits serve one model (protocol §8.1): a small worker (batches of
2, item length up to 64) and a large one (batches of 8, lengths 16..256), real workers
over loopback. Each batch goes to a worker that admits it, the door refuses only what
neither admits, and when the large worker leaves the broker's limits shrink to the small
one's with every request answered once, none left waiting for its deadline."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.errors import InvalidArgument, RequestError, Unavailable
from carpool.common.protocol import (
    MetadataRequest,
    ModelMetadata,
    decode_meta,
    parse_metadata_reply,
)
from carpool.common.shape_rules import ShapeRule
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer
from tests.conftest import Fleet, wait_for_workers

pytestmark = pytest.mark.timeout(120)


def _x(n: int, length: int) -> dict[str, np.ndarray]:
    return {"x": np.arange(n * length, dtype=np.float32).reshape(n, length)}


def _metadata(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> ModelMetadata:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send_multipart(MetadataRequest(1, "echo").to_frames())
        assert socket.poll(10_000), "the broker did not answer METADATA"
        _header, meta = socket.recv_multipart()
        (model,) = parse_metadata_reply(decode_meta(meta))[1]
        return model
    finally:
        socket.close(linger=0)


def test_two_workers_with_other_limits_serve_one_model(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    fleet: Fleet = fleet_factory(max_batch=8, max_wait_s=0.005)
    small_rule, large_rule = ShapeRule(max_shape=(-1, 64)), ShapeRule((1, 16), (-1, 256))
    small = SyntheticEngine(item_shape=(-1,), max_batch=2, shape_rules={"x": small_rule})
    large = SyntheticEngine(
        item_shape=(-1,), max_batch=8, per_sample_s=0.001, shape_rules={"x": large_rule}
    )
    fleet.add_worker({"echo": lambda: small}, name="jetson-1", warmup=False)
    client: Client = fleet.ready(1)
    big = ServerThread(
        WorkerServer(
            fleet.broker.backend_endpoint, {"echo": lambda: large}, name="gpu-1", warmup=False
        )
    )
    with big:
        wait_for_workers(client, 2)
        model = _metadata(context, fleet.broker.frontend_endpoint)
        assert model.spec.max_batch == 8
        assert model.spec.rules == (ShapeRule(max_shape=(-1, 256)),)  # the union
        assert [(w.worker, w.max_batch, w.rules) for w in model.limits] == [
            ("gpu-1", 8, (large_rule,)),
            ("jetson-1", 2, (small_rule,)),
        ]
        # Requests of 5 samples: only the large worker takes them.
        for _ in range(3):
            got = client.infer("echo", _x(5, 32), timeout_s=30)["y"]
            np.testing.assert_array_equal(got, 2 * _x(5, 32)["x"] + 1)  # the engine's y
        # Length 8: only the small worker admits it; 128 only the large one.
        client.infer("echo", _x(1, 8), timeout_s=30)
        client.infer("echo", _x(1, 128), timeout_s=30)
        assert set(large.batches) == {(5, (32,)), (1, (128,))}
        assert list(small.batches) == [(1, (8,))]
        # Neither admits 300; 3 samples of length 8 are more than the small worker takes.
        with pytest.raises(InvalidArgument, match=r"dim 1 is 300.*gpu-1: max_batch 8"):
            client.infer("echo", _x(1, 300), timeout_s=30)
        with pytest.raises(InvalidArgument, match="accepts at most 2 per batch"):
            client.infer("echo", _x(3, 8), timeout_s=30)
        # A burst for the large worker, then it leaves while some still wait.
        burst = [
            client.submit("echo", _x(n, 128 if n == 1 else 32), timeout_s=60) for n in (1, 5) * 20
        ]
        # STATS goes after them on the one connection: once it is answered, the broker has
        # taken in the whole burst (before the large worker leaves).
        client.stats()
    # Every request of the burst gets exactly one answer, long before its deadline.
    clock = MonotonicClock()
    until = clock.now() + 20.0
    outcomes: list[str] = []
    for future in burst:
        try:
            future.result(max(0.0, until - clock.now()))
            outcomes.append("ok")
        except (Unavailable, InvalidArgument) as exc:
            outcomes.append(type(exc).__name__)
        except RequestError as exc:  # pragma: no cover - shown in the failure
            outcomes.append(f"unexpected {exc!r}")
    assert len(outcomes) == len(burst)
    assert all(o in ("ok", "Unavailable") for o in outcomes), outcomes
    # The broker's limits are the small worker's now.
    deadline = clock.now() + 10.0
    while _metadata(context, fleet.broker.frontend_endpoint).spec.max_batch != 2:
        assert clock.now() < deadline, "the broker still takes batches of the large worker"
        client.poll(0.02)
    model = _metadata(context, fleet.broker.frontend_endpoint)
    assert model.workers == ("jetson-1",)
    assert model.spec.rules == (small_rule,)
    with pytest.raises(InvalidArgument, match="accepts at most 2 per batch"):
        client.infer("echo", _x(5, 32), timeout_s=30)
    with pytest.raises(InvalidArgument, match="dim 1 is 128, the model takes at most 64"):
        client.infer("echo", _x(1, 128), timeout_s=30)
    got = client.infer("echo", _x(2, 32), timeout_s=30)["y"]
    np.testing.assert_array_equal(got, 2 * _x(2, 32)["x"] + 1)
    assert (2, (32,)) in small.batches
