"""A client that does not read while its answers pile up, and whose broker then closes:
libzmq stops reading a connection at its receive high-water mark, and, once that
connection closes, a ZMTP heartbeat falling due on it aborts the process (libzmq 4.3.5,
``stream_engine_base.cpp``: ``!_io_error``). The SDK's sockets have no receive mark: a
broker sends one answer per request, so the answers waiting are bounded by the requests
sent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

#: In a process of its own (an abort ends it): a ROUTER answers 1,500 requests, 100 at a
#: time, to a Client that submits and never reads, then closes; the client waits three
#: of its heartbeat intervals without reading.
_CLIENT = """
import sys
import msgpack, numpy as np, zmq
from carpool.client import Client
from carpool.client.shell import HEARTBEAT_IVL_MS
endpoint = sys.argv[1]
context = zmq.Context()
broker = context.socket(zmq.ROUTER)
broker.bind(endpoint)
x = np.ones((1, 4), np.float32)
with Client(endpoint, default_timeout_s=30.0) as client:
    answered = 0
    while answered < 1500:
        for _ in range(100):
            client.submit("m", {"x": x})
        for _ in range(100):
            frames = broker.recv_multipart()
            meta = msgpack.unpackb(frames[2])
            reply = msgpack.packb({"id": meta["id"], "outputs": []})
            broker.send_multipart([frames[0], b"CP\\x01\\x02", reply])
            answered += 1
    broker.close(linger=0)
    idle = context.socket(zmq.PAIR)  # (nothing arrives: a wait that reads no socket)
    idle.poll(3 * HEARTBEAT_IVL_MS)
    idle.close()
    print("alive", len(client.core.pending))
"""


@pytest.mark.timeout(60)
def test_answers_left_unread_when_the_broker_closes_do_not_abort_the_client(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT, f"ipc://{tmp_path}/fe"],
        timeout=45,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["alive", "1500"], done.stdout
