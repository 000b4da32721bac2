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

#: In a process of its own (an abort ends it): the SDK's socket (client/shell.py's
#: Dealer, as a Client opens it) sends 1,500 requests and reads nothing; a ROUTER answers
#: them all, then closes; the socket then waits three of its heartbeat intervals. (A
#: Client's I/O thread reads answers as they come, so only the socket itself can be made
#: to leave them unread.)
_CLIENT = """
import sys
import zmq
from carpool.client.shell import HEARTBEAT_IVL_MS, Dealer
endpoint = sys.argv[1]
context = zmq.Context()
broker = context.socket(zmq.ROUTER)
broker.bind(endpoint)
owner = type("Owner", (), {})()
dealer = Dealer(owner, context, endpoint, own_context=False, keys=None)
for i in range(1500):
    dealer.current.socket.send_multipart([b"CP\\x01\\x01", str(i).encode()])
for _ in range(1500):
    frames = broker.recv_multipart()
    broker.send_multipart([frames[0], b"CP\\x01\\x02", frames[2]])
broker.close(linger=0)
idle = context.socket(zmq.PAIR)  # (nothing arrives: a wait that reads no socket)
idle.poll(3 * HEARTBEAT_IVL_MS)
idle.close()
unread = 0
while dealer.current.socket.poll(0):
    dealer.current.socket.recv_multipart()
    unread += 1
print("alive", unread)
dealer.close()
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
    assert done.stdout.split() == ["alive", "1500"], done.stdout  # every answer kept
