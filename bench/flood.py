"""flood.py: a flood of connections under random routing ids leaves the broker serving.

A fresh ``carpool broker`` process on loopback (libzmq draws where a ROUTER's generated
ids start when the socket is made, so only a fresh process shows what a peer could
predict), then ``--connections`` raw ZMTP peers, ``--held`` open at a time, each under a
random id in the space of the ids the broker's ROUTER generates (a zero byte and 4
random bytes) and each sending STATS. Each round checks that every peer is answered on
its own connection, that a client connecting meanwhile (its id generated) is answered,
and that the broker's request count says it read those messages and that STATS, no more,
no fewer. Prints the connections answered, the rounds and the connections per second;
exits 1 if a check fails or the broker dies.

The test suite runs one round of 1,000 with these peers
(tests/integration/test_routing_ids.py); docs/security.md cites this script's 10,000.

Run: ``.venv/bin/python bench/flood.py [--connections 10000] [--held 1000]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq

from carpool.client import Client

CARPOOL = [sys.executable, "-m", "carpool"]
STATS = b"CP\x01\x04"

# A ZMTP 3.0 peer in a few bytes (rfc.zeromq.org/spec/23) on a plain TCP socket, which
# costs the flood a fraction of what a zmq socket does: the greeting (NULL mechanism) and
# a READY command with the routing id; then, once the broker's greeting and READY have
# come, one message (libzmq ends a handshake in which a message comes before its READY).
GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04  # a frame's flags
# Connections opened before their handshakes are finished: fewer than libzmq's listen
# backlog (ZMQ_BACKLOG, 100), past which the kernel drops a connection's SYN and the
# connect waits 1 s or more to try again.
WAVE = 50


# --------------------------------------------------------------------------- the broker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class BrokerProcess:
    proc: subprocess.Popen[bytes]
    frontend: str
    backend: str
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def broker_process(folder: Path) -> Iterator[BrokerProcess]:
    """A fresh ``carpool broker`` on loopback ports, logging to ``folder``, once it
    answers STATS; stopped on exit."""
    frontend = f"tcp://127.0.0.1:{free_port()}"
    backend = f"tcp://127.0.0.1:{free_port()}"
    log = folder / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CARPOOL, "broker", "--frontend", frontend, "--backend", backend,
             "--log-level", "WARNING"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    broker = BrokerProcess(proc, frontend, backend, log)
    try:
        # Raw sockets, not a Client: an ordinary client would take a generated id.
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as probe:
            probe.setsockopt(zmq.LINGER, 0)
            probe.setsockopt(zmq.ROUTING_ID, b"probe")
            probe.connect(frontend)
            until = time.monotonic() + 30
            probe.send(STATS)
            while not probe.poll(200):
                assert broker.alive(), broker.logs()
                assert time.monotonic() < until, "the broker never answered\n" + broker.logs()
                probe.send(STATS)
        yield broker
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- raw peers


def random_ids(count: int) -> list[bytes]:
    """Ids in the space the broker's ROUTER generates: a zero byte and 4 random bytes."""
    raw = os.urandom(4 * count)
    return [b"\x00" + raw[4 * k : 4 * k + 4] for k in range(count)]


def _zmtp_property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def dealer_hello(routing_id: bytes) -> bytes:
    ready = b"\x05READY" + _zmtp_property(b"Socket-Type", b"DEALER")
    ready += _zmtp_property(b"Identity", routing_id)
    return GREETING + bytes([_COMMAND, len(ready)]) + ready


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError(f"the broker closed a connection ({bytes(data)!r} of {size} bytes)")
        data += chunk
    return bytes(data)


def _zmtp_frame(conn: socket.socket) -> tuple[int, bytes]:
    flags = _recv_exactly(conn, 1)[0]
    size = _recv_exactly(conn, 8 if flags & _LONG else 1)
    return flags, _recv_exactly(conn, int.from_bytes(size, "big"))


def send_after_handshake(conn: socket.socket, body: bytes) -> None:
    """Read the broker's greeting and READY (the handshake is over), then send ``body``
    as a one-frame message."""
    greeting = _recv_exactly(conn, len(GREETING))
    assert greeting[:1] + greeting[9:11] == b"\xff\x7f\x03", greeting
    flags, command = _zmtp_frame(conn)
    assert flags & _COMMAND, (flags, command)
    assert command.startswith(b"\x05READY"), command
    conn.sendall(bytes([0, len(body)]) + body)


def zmtp_message(conn: socket.socket) -> list[bytes]:
    """The next message's frames (commands, such as a heartbeat's PING, skipped)."""
    frames = []
    while True:
        flags, body = _zmtp_frame(conn)
        if flags & _COMMAND:
            continue
        frames.append(body)
        if not flags & _MORE:
            return frames


def open_peers(host: str, port: int, count: int, conns: list[socket.socket]) -> None:
    """``count`` connections under random ids, each sending STATS, added to ``conns``
    and left open: ``WAVE`` opened at a time, then their handshakes finished."""
    for first in range(0, count, WAVE):
        wave = []
        for rid in random_ids(min(WAVE, count - first)):
            conn = socket.create_connection((host, port), timeout=10)
            conns.append(conn)
            wave.append(conn)
            conn.sendall(dealer_hello(rid))
        for conn in wave:
            send_after_handshake(conn, STATS)


# --------------------------------------------------------------------------- the flood


def flood(broker: BrokerProcess, connections: int, held: int) -> tuple[int, int]:
    """Run the flood in rounds of ``held``; returns (peers answered, rounds). Raises
    AssertionError (a check failed) or OSError / EOFError (a connection failed)."""
    host, port = broker.frontend.removeprefix("tcp://").rsplit(":", 1)
    answered = rounds = 0
    with Client(broker.frontend, default_timeout_s=10.0) as client:
        seen = client.stats()["requests"]
        for first in range(0, connections, held):
            count = min(held, connections - first)
            conns: list[socket.socket] = []
            try:
                open_peers(host, int(port), count, conns)
                for conn in conns:
                    assert zmtp_message(conn)[0] == STATS, "not the answer to STATS"
                    answered += 1
                with Client(broker.frontend, default_timeout_s=10.0) as newcomer:
                    n = newcomer.stats()["requests"]
                assert n == seen + count + 1, f"the broker read {n - seen - 1} of {count}"
                seen = n
            finally:
                for conn in conns:
                    conn.close()
            assert broker.alive(), broker.logs()
            rounds += 1
        assert client.stats()["requests"] == seen + 1
    return answered, rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--held", type=int, default=1_000, help="open at a time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, broker_process(Path(tmp)) as broker:
        started = time.perf_counter()
        try:
            answered, rounds = flood(broker, args.connections, args.held)
        except (AssertionError, OSError, EOFError) as exc:
            state = "alive" if broker.alive() else "dead"
            print(f"FAILED: {exc!r}; the broker is {state}\n{broker.logs()}", file=sys.stderr)
            return 1
        took = time.perf_counter() - started
        print(
            f"{answered:,} of {args.connections:,} connections answered on their own "
            f"connection, {args.held:,} held at once ({rounds} rounds): the broker read "
            f"every message and answered a newcomer each round, and lives; "
            f"{took:.1f} s, {answered / took:,.0f} connections/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
