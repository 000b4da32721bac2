"""A peer that fills a connection's receive queue, then resets the connection: libzmq
4.3.5 stops reading a connection at its receive high-water mark, and once the peer resets
it, the next ZMTP PING on it aborts the process (``stream_engine_base.cpp:310``,
``!_io_error``): the receiver's own PING when its heartbeat falls due, or one the peer
sent behind the message that met the mark, read as the receiver reads on. The broker's
ROUTERs and the worker's DEALER have no receive mark (docs/security.md).

Each attack runs in a process of its own (an abort ends it), from a raw TCP socket that
closes with SO_LINGER 0 (a reset)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

#: The peer's side: a ZMTP 3.1 NULL handshake; 120,000 messages of two small frames (each
#: followed by a PING when ``pings``), far past the receiver's mark; half a second for the
#: receiver to take in what it will; a reset.
_PEER = r"""
import socket, struct
import zmq

def greeting(as_server):
    return (b"\xff" + b"\x00" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\x00")
            + bytes([as_server]) + b"\x00" * 31)

def ready(kind):
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(kind)) + kind
    return bytes([0x04, len(body)]) + body

def handshake(peer, as_server, kind):
    # Greet and send READY, and take the other side's greeting and READY (a message
    # sent before those is a protocol error).
    peer.sendall(greeting(as_server) + ready(kind))
    header = peer.recv(66, socket.MSG_WAITALL)
    peer.recv(header[-1], socket.MSG_WAITALL)

def flood(peer, pings):
    message = b"\x01\x04CP\x01\x01\x00\x01x" + (b"\x04\x07\x04PING\x00\x00" if pings else b"")
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.settimeout(0.5)
    try:
        for _ in range(40):
            peer.sendall(message * 3000)
    except OSError:  # the buffers are full (or the receiver closed the connection)
        pass
    pause = zmq.Context.instance().socket(zmq.PAIR)  # (a wait that reads no socket)
    pause.poll(500)  # the receiver takes in what it will
    pause.close()
    peer.close()  # SO_LINGER 0: a reset
"""


def _survives(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a process of its own (an abort ends only it); it exited 0."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        timeout=45,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


#: A broker on a thread (its ROUTERs as :func:`bind_router` makes them, the backend's as
#: the frontend's); the peer attacks the frontend, faster than the broker reads; after
#: the broker's heartbeats have fallen due a client asks STATS.
_BROKER = (
    _PEER
    + r"""
import sys
import zmq
from carpool.broker.config import BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.testing import ServerThread

heartbeat_s, pings = float(sys.argv[1]), sys.argv[2] == "pings"
config = BrokerConfig(
    frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", register_grace_s=0.0,
    peer_heartbeat_s=heartbeat_s, peer_timeout_s=5.0,
)
with ServerThread(BrokerServer(config)) as broker:
    host, port = broker.frontend_endpoint.removeprefix("tcp://").rsplit(":", 1)
    peer = socket.create_connection((host, int(port)))
    handshake(peer, 0, b"DEALER")
    flood(peer, pings)
    idle = zmq.Context.instance().socket(zmq.PAIR)  # (a wait that reads no socket)
    idle.poll(600)
    idle.close()
    with Client(broker.frontend_endpoint) as client:
        print("serving", sorted(client.stats())[:1])
"""
)


@pytest.mark.parametrize(
    ("heartbeat_s", "pings"),
    [(0.1, "no-pings"), (0.0, "pings")],
    ids=["broker-heartbeats", "peer-pings"],
)
def test_a_client_that_fills_its_connection_and_resets_it_does_not_stop_the_broker(
    heartbeat_s: float, pings: str
) -> None:
    done = _survives(_BROKER, str(heartbeat_s), pings)
    assert done.stdout.startswith("serving"), done.stdout


#: A ROUTER as :func:`bind_router` makes it (both of the broker's sides), left unread
#: while the peer floods it and resets, then read on after its heartbeats fell due.
_ROUTER = (
    _PEER
    + r"""
import sys
import zmq
from carpool.broker.transports.zeromq import bind_router

heartbeat_s, pings = float(sys.argv[1]), sys.argv[2] == "pings"
context = zmq.Context()
router = bind_router(
    context, "tcp://127.0.0.1:0", max_frame_mib=64,
    peer_heartbeat_s=heartbeat_s, peer_timeout_s=5.0,
)
port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
peer = socket.create_connection(("127.0.0.1", port))
handshake(peer, 0, b"DEALER")
flood(peer, pings)
router.poll(600)  # (a wait: nothing is read)
while router.poll(500):
    router.recv_multipart()
print("alive")
router.close()
"""
)


@pytest.mark.parametrize(
    ("heartbeat_s", "pings"),
    [(0.1, "no-pings"), (0.0, "pings")],
    ids=["router-heartbeats", "peer-pings"],
)
def test_a_broker_router_left_unread_while_a_peer_fills_and_resets_it_reads_on(
    heartbeat_s: float, pings: str
) -> None:
    done = _survives(_ROUTER, str(heartbeat_s), pings)
    assert done.stdout.split() == ["alive"], done.stdout


#: A peer posing as the worker's broker: the worker's DEALER (as ZmqConnection opens
#: it) sends READY and reads nothing while the peer floods it with messages and PINGs,
#: then resets; the worker then reads what waits.
_WORKER = (
    _PEER
    + r"""
import zmq
from carpool.worker.connection import ZmqConnection

class Ready:
    def to_frames(self):
        return [b"CP\x01\x01", b"\x80"]

listener = socket.create_server(("127.0.0.1", 0))
port = listener.getsockname()[1]
connection = ZmqConnection(f"tcp://127.0.0.1:{port}", "w")
poller = zmq.Poller()
connection.open(poller, Ready())
peer, _ = listener.accept()
handshake(peer, 1, b"ROUTER")
flood(peer, True)
read = 0
while dict(poller.poll(1000)):
    read += sum(1 for _ in connection.receive(dict(poller.poll(0))))
print("alive")
connection.shut()
"""
)


def test_a_broker_that_fills_the_worker_connection_and_resets_it_does_not_stop_the_worker() -> None:
    done = _survives(_WORKER)
    assert done.stdout.split() == ["alive"], done.stdout
