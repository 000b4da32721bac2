"""handshake.py: what a new connection to the broker costs before its first answer.

A broker and a synthetic worker in this process (threads), then ``--connects`` times: a
new DEALER connects to the frontend, sends STATS and waits for the answer (ZMTP's
handshake, the broker's ZAP door, one message each way). Prints the median, p90 and p99
in milliseconds, on an idle broker and, with ``--busy``, beside a client that keeps 50
requests in flight in the same process (the broker's loop and the GIL are shared then).
The door's share: run it at a revision without one (``PYTHONPATH=/path/to/checkout/src``).

Run: ``.venv/bin/python bench/handshake.py [--connects 200] [--busy]``
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import zmq

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer

STATS = [b"CP\x01\x04"]


def measure(connects: int, busy: bool) -> list[float]:
    """Seconds from connect to STATS answered, for each new connection."""
    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        register_grace_s=0.0,
        batching=BatchingConfig(max_batch=8, max_wait_s=0.001),
    )
    engines = {"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)}
    with (
        ServerThread(BrokerServer(config)) as broker,
        ServerThread(WorkerServer(broker.backend_endpoint, engines)),
    ):
        with Client(broker.frontend_endpoint) as client:  # until the worker is in
            until = time.monotonic() + 30
            while not client.stats()["workers"]:
                if time.monotonic() > until:
                    raise RuntimeError("the worker did not register within 30 s")
                client.poll(0.02)
        stop = threading.Event()

        def load() -> None:
            x = np.ones((1, 4), np.float32)
            with Client(broker.frontend_endpoint) as client:
                while not stop.is_set():
                    for future in [client.submit("syn", {"x": x}) for _ in range(50)]:
                        future.result(10)

        loader = threading.Thread(target=load, daemon=True)
        if busy:
            loader.start()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        took = []
        try:
            for _ in range(connects):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                start = time.perf_counter()
                sock.connect(broker.frontend_endpoint)
                sock.send_multipart(STATS)
                if not sock.poll(5000):
                    raise RuntimeError("no answer within 5 s")
                sock.recv_multipart()
                took.append(time.perf_counter() - start)
                sock.close()
        finally:
            stop.set()
            if busy:
                loader.join(30)
            context.term()
    return sorted(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connects", type=int, default=200)
    parser.add_argument("--busy", action="store_true")
    args = parser.parse_args()
    took = measure(args.connects, args.busy)
    n = len(took)
    p50, p90, p99 = (1000 * took[min(n - 1, int(q * n))] for q in (0.5, 0.9, 0.99))
    label = "busy" if args.busy else "idle"
    print(f"{label}: connect + STATS answered, ms: p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}")


if __name__ == "__main__":
    main()
