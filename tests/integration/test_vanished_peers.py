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

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

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


def _disconnects_within(monitor: zmq.Socket[bytes], seconds: float) -> int:
    """EVENT_DISCONNECTED events seen on ``monitor`` within ``seconds``."""
    clock = MonotonicClock()
    until = clock.now() + seconds
    seen = 0
    while (left := until - clock.now()) > 0:
        if not monitor.poll(max(1, int(left * 1000))):
            break
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            seen += 1
    return seen


@pytest.mark.parametrize("heartbeat_s", [0.1, 0.0])
def test_a_silent_peer_is_disconnected_and_a_live_idle_one_is_not(heartbeat_s: float) -> None:
    config = dataclasses.replace(
        loopback_config(), peer_heartbeat_s=heartbeat_s, peer_timeout_s=0.5
    )
    server = BrokerServer(config)  # (its sockets are made here; monitored before it serves)
    monitor = server.frontend.get_monitor_socket(zmq.EVENT_DISCONNECTED)
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
            dropped = _disconnects_within(monitor, 2.0)
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
            monitor.close(linger=0)  # (before the broker's context is terminated)
