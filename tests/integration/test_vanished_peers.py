"""A peer whose host vanishes (power or network gone) sends no FIN: the broker's kernel
sees an idle TCP connection for ever. Held open, its descriptor and buffers would stay
in the broker for good, and a thousand such robots would fill the default fd limit so
that no new client got in. ZMTP heartbeats (``peer_heartbeat_s``/``peer_timeout_s``)
close it. A stopped process (SIGSTOP) stands in for the vanished host: its kernel still
holds the connection, but nothing in it answers the heartbeat."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.testing import ServerThread
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)

_PEER = """
import os, signal, sys, zmq
from carpool.common.protocol import Command, encode
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
s.send_multipart(encode(Command.STATS, {"id": 1}))
s.recv_multipart()  # connected, and answered
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # the host is gone
"""


def _held(port: int) -> int:
    """Connections accepted on loopback ``port`` that a descriptor still holds: the
    kernel's TCP table (/proc/net/tcp), not listening, inode 0 being one that no
    descriptor holds (closed)."""
    held = 0
    for line in Path("/proc/net/tcp").read_text(encoding="ascii").splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], int(fields[9])
        held += int(local.rsplit(":", 1)[1], 16) == port and state != "0A" and inode != 0
    return held


def _fewest_within(port: int, seconds: float) -> int:
    """The fewest connections held on loopback ``port`` over the next ``seconds``."""
    clock, pause = MonotonicClock(), threading.Event()
    until = clock.now() + seconds
    fewest = _held(port)
    while clock.now() < until:
        pause.wait(0.01)
        fewest = min(fewest, _held(port))
    return fewest


@pytest.mark.parametrize("heartbeat_s", [0.1, 0.0])
def test_a_silent_peer_is_disconnected_and_a_live_idle_one_is_not(heartbeat_s: float) -> None:
    config = dataclasses.replace(
        loopback_config(), peer_heartbeat_s=heartbeat_s, peer_timeout_s=0.5
    )
    server = BrokerServer(config)
    port = int(server.frontend_endpoint.rsplit(":", 1)[1])
    peer = None
    with ServerThread(server), Client(server.frontend_endpoint) as idle:
        try:
            assert idle.stats()["replies"] == 0  # a live client, connected
            peer = subprocess.Popen(
                [sys.executable, "-c", _PEER, server.frontend_endpoint],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert peer.stdout is not None
            assert peer.stdout.readline().strip() == "ready"
            # Of the two connections (the live client's and the peer's), those closed:
            dropped = 2 - _fewest_within(port, 2.0)
            # The live client, idle all that while (4 timeouts), answers the PINGs by
            # itself (libzmq) and is still connected: its STATS is answered.
            assert idle.stats(5)["replies"] == 0
            assert dropped == (1 if heartbeat_s else 0)
        finally:
            if peer is not None:
                os.kill(peer.pid, signal.SIGKILL)
                peer.wait(10)
                assert peer.stdout is not None
                peer.stdout.close()
