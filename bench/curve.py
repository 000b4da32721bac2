"""What does CURVE cost a request: CPU per request and round trip, CURVE on against off.

Method: one process holds a broker (``BrokerServer`` on a thread), one worker with a
null synthetic engine (a batch costs nothing) on another thread, and a ``Client`` in a
closed loop, one request in flight, float32 [1, 16] inputs, over ``tcp://127.0.0.1``.
Rounds alternate CURVE off and on (the same keys each time, made once in a temporary
directory); each round sends a warm-up, then ``--requests`` timed requests. CPU per
request is this process's CPU time (all three parts, user + system) over the timed
requests; the round trip is each request's submit-to-result time. The table shows
medians over rounds, and the ratio on / off of the per-round figures measured back to
back. Also: the cost on the broker's loop of reading a message's authenticated key
(``BrokerAuth.client_key``: the ``User-Id`` property, once a message) against the
routing id alone, on a frame received over CURVE.

Run: ``.venv/bin/python bench/curve.py [--rounds 5] [--requests 2000]``
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from carpool.broker.auth import BrokerAuth, Door
from carpool.broker.config import BrokerConfig, CurveConfig
from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.curve import client_keys, connect_keys, create_keypair
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer


def _keys(root: Path) -> CurveConfig:
    create_keypair(root / "broker", "broker")
    create_keypair(root / "clients", "client")
    create_keypair(root / "workers", "worker")
    return CurveConfig(
        enabled=True,
        server_key=str(root / "broker" / "broker.key_secret"),
        clients=str(root / "clients"),
        workers=str(root / "workers"),
    )


def _round(curve: CurveConfig, on: bool, root: Path, warmup: int, n: int) -> tuple[float, float]:
    """(CPU µs per request, median round trip µs) of one round."""
    config = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*")
    config = dataclasses.replace(config, curve=curve if on else CurveConfig())
    server_key = str(root / "broker" / "broker.key") if on else ""
    worker_keys = client_keys(server_key, str(root / "workers" / "worker.key_secret") if on else "")
    kwargs: dict[str, Any] = {}
    if on:
        kwargs = {
            "curve_server_key": server_key,
            "curve_key": str(root / "clients/client.key_secret"),
        }
    x = np.ones((1, 16), np.float32)
    with (
        ServerThread(BrokerServer(config)) as broker,
        WorkerServer(
            broker.backend_endpoint,
            {"m": lambda: SyntheticEngine(item_shape=(16,), max_batch=8)},
            curve=worker_keys,
        ) as worker,
        ServerThread(worker),
        Client(broker.frontend_endpoint, **kwargs) as client,
    ):
        for _ in range(200):  # the worker joins
            try:
                client.infer("m", {"x": x}, timeout_s=1.0)
                break
            except Exception:
                client.poll(0.05)
        for _ in range(warmup):
            client.infer("m", {"x": x}, timeout_s=5.0)
        trips = []
        cpu0 = time.process_time()
        for _ in range(n):
            t0 = time.perf_counter()
            client.infer("m", {"x": x}, timeout_s=5.0)
            trips.append(time.perf_counter() - t0)
        cpu_s = time.process_time() - cpu0
    return cpu_s / n * 1e6, statistics.median(trips) * 1e6


def _key_read_ns(curve: CurveConfig, root: Path, reads: int = 200_000) -> tuple[float, float]:
    """ns per message: the routing id alone, and the key + routing id (client_key)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    door = Door(ctx)
    auth = BrokerAuth(door, curve)
    try:
        router = ctx.socket(zmq.ROUTER)
        auth.secure_frontend(router)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        keys = client_keys(str(root / "broker/broker.key"), str(root / "clients/client.key_secret"))
        assert keys is not None
        connect_keys(dealer, keys)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"x")
        while not router.poll(10):  # (the broker's loop answers its door: here this one)
            door.on_poll()
        first = router.recv_multipart(copy=False)[0]
        key = auth.client_key()
        t0 = time.perf_counter()
        for _ in range(reads):
            first.bytes  # noqa: B018
        plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(reads):
            key(first)
        keyed = time.perf_counter() - t0
        dealer.close(0)
        router.close(0)
    finally:
        door.close()
        ctx.term()
    return plain / reads * 1e9, keyed / reads * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        curve = _keys(root)
        rows: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                rows[on].append(_round(curve, on, root, args.warmup, args.requests))
        plain_ns, keyed_ns = _key_read_ns(curve, root)
    print("| CURVE | CPU µs/request | round trip p50 µs |")
    print("| --- | --- | --- |")
    for on in (False, True):
        cpu = statistics.median(r[0] for r in rows[on])
        rtt = statistics.median(r[1] for r in rows[on])
        print(f"| {'on' if on else 'off'} | {cpu:.0f} | {rtt:.0f} |")
    cpu_ratio = statistics.median(a[0] / b[0] for a, b in zip(rows[True], rows[False], strict=True))
    rtt_ratio = statistics.median(a[1] / b[1] for a, b in zip(rows[True], rows[False], strict=True))
    print(f"| on / off | {cpu_ratio:.2f} | {rtt_ratio:.2f} |")
    print(
        f"\nper frontend message: routing id {plain_ns:.0f} ns, key + routing id "
        f"{keyed_ns:.0f} ns (+{keyed_ns - plain_ns:.0f} ns)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
