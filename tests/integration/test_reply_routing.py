"""Reply routing: a reply goes to the connection its request came by, never to a later
connection that took the routing id of one that has closed."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from carpool.common.clock import MonotonicClock
from carpool.worker.engines.synthetic import SyntheticEngine

REQUEST = b"CP\x01\x01"
REPLY = 0x02
STATS = b"CP\x01\x04"


def _request(request_id: int) -> list[bytes]:
    meta = {
        "id": request_id,
        "model": "slow",
        "timeout_ms": 10_000,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4]}],
    }
    return [REQUEST, msgpack.packb(meta), np.ones((1, 4), np.float32).tobytes()]


def _dealer(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, rid: bytes) -> Any:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, rid)
    sock.connect(endpoint)
    return sock


@pytest.mark.timeout(60)
def test_a_newcomer_under_a_departed_clients_routing_id_gets_none_of_its_replies(
    fleet_factory: Any, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A client sends to a slow model and leaves; a newcomer connects under its routing id
    (the broker answers it, so the id is the newcomer's) before the batch ends. The reply
    is dropped and counted as ``departed``; the newcomer never sees it."""
    fleet = fleet_factory(max_batch=1, max_wait_s=0.001)
    engine = SyntheticEngine(fixed_cost_s=0.6, item_shape=(4,), max_batch=1)
    fleet.add_worker({"slow": lambda: engine}, warmup=False)
    client = fleet.ready()
    endpoint = fleet.broker.frontend_endpoint
    clock = MonotonicClock()

    def until(what: str, done: Any, limit_s: float = 10.0) -> None:
        end = clock.now() + limit_s
        while not done():
            assert clock.now() < end, f"{what} did not happen in {limit_s} s"
            client.poll(0.01)

    victim = _dealer(context, endpoint, b"victim")
    victim.send_multipart(_request(7))
    until("dispatch", lambda: client.stats()["inflight_batches"] == 1)
    victim.close(linger=0)

    newcomer = None
    end = clock.now() + 5
    while newcomer is None:  # the broker keeps the id while the victim's pipe stands
        assert clock.now() < end, "the newcomer never got the victim's routing id"
        sock = _dealer(context, endpoint, b"victim")
        sock.send_multipart([STATS, msgpack.packb({"id": 1})])
        if sock.poll(200):
            assert sock.recv_multipart()[0] == STATS
            newcomer = sock
        else:
            sock.close(linger=0)
    try:
        got: list[list[bytes]] = []

        def settled() -> bool:
            if newcomer.poll(0):
                got.append(newcomer.recv_multipart())
            assert not got, f"the newcomer received {got[0][0]!r}: the victim's reply"
            stats = client.stats()
            return bool(stats.get("departed")) and stats["inflight_batches"] == 0

        until("the batch's end", settled)
        assert client.stats()["departed"] == 1
        assert not newcomer.poll(0)
    finally:
        newcomer.close(linger=0)
