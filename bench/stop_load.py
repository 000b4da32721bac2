"""stop_load.py: requests lost to broker stops, by kind of client (protocol.md §11).

A broker process (``carpool broker --embed-synthetic``, on ``ipc://`` endpoints, or
``tcp://127.0.0.1`` with ``--transport tcp``) is
stopped with SIGTERM and started again, ``--rounds`` times, while clients send at a
steady rate in all (``--rate``, split evenly among them):

- ``follows``: a raw DEALER written from protocol.md §11: on ``UNAVAILABLE`` with
  ``retry`` it sends nothing more on that socket, opens a new one and sends there
  again, with the same ``id`` and ``client``, each request refused so; it reads the old
  socket until that connection closes, then sends again what was still unanswered on it;
  and on ``OVERLOADED`` it sends the request again after ``retry_after_ms`` (§12: the
  requests it sent while no broker was up reach the next one at once; with a
  ``--window`` past the broker's per-client limit, some are refused so);
- ``ignores``: a raw DEALER that keeps sending on its one socket and never sends again;
- ``sdk``: the blocking carpool ``Client`` (which follows the rule itself).

Each client has at most ``--window`` requests unanswered. Each broker is stopped once
it serves: it has answered ``--per-round`` results to every client, for requests first
sent after it started; the clients send until the last broker has done the same and
each has sent ``--min-sent`` requests. A request is *lost* when it has no answer (a
result or an error) by the end: a wait for every answer, the requests' timeout and 5 s
at most, after the clients stop sending. The report gives, per stop, the requests each
kind lost (by the broker generation they were first sent to), those answered
``UNAVAILABLE`` with ``retry`` (which ``ignores`` does not send again), and how long the
stopping broker took to exit.

Run: ``.venv/bin/python bench/stop_load.py [--rounds 5] [--rate 1000]``; against
another revision, put its ``src`` first: ``PYTHONPATH=/path/to/checkout/src``.
Tests: tests/system/test_stop_raw_clients.py runs :func:`run_stops` and asserts its
counts (``follows`` and ``sdk`` lose nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from carpool.client import Client, RequestError

MODEL = "synthetic"
X = np.ones((1, 16), np.float32)
TIMEOUT_MS = 15_000
_REQUEST, _REPLY, _ERROR = b"CP\x01\x01", b"CP\x01\x02", b"CP\x01\x03"
_OVERLOADED = 4


def endpoints(workdir: Path, transport: str) -> tuple[str, str]:
    """The frontend and backend every broker of a run binds (the same each restart)."""
    if transport == "ipc":
        return f"ipc://{workdir}/fe", f"ipc://{workdir}/be"
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    return f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"


def start_broker(ends: tuple[str, str], log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "carpool",
            "broker",
            "--frontend",
            ends[0],
            "--backend",
            ends[1],
            "--embed-synthetic",
            "1",
            "0.05",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


@dataclass
class _Sent:
    frames: list[bytes]
    sock: zmq.Socket[bytes]
    generation: int  # the broker it was first sent to (0, 1, ...)


@dataclass
class RawClient:
    """A DEALER client of the raw protocol; ``follows``: it keeps protocol.md §11's rule."""

    context: zmq.Context[zmq.Socket[bytes]]
    endpoint: str
    follows: bool
    nonce: bytes = field(default_factory=lambda: os.urandom(16))
    sent: int = 0
    pending: dict[int, _Sent] = field(default_factory=dict)
    answered: Counter[str] = field(default_factory=Counter)
    retired: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = field(default_factory=list)
    later: list[tuple[float, int]] = field(default_factory=list)  # (when, id): OVERLOADED
    results: Counter[int] = field(default_factory=Counter)  # by generation first sent to

    def __post_init__(self) -> None:
        self.sock, self.monitor = self._open()

    def _open(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        return sock, monitor

    def send(self, generation: int) -> None:
        self.sent += 1
        rid = self.sent
        meta = {
            "id": rid,
            "model": MODEL,
            "timeout_ms": TIMEOUT_MS,
            "client": self.nonce,
            "inputs": [{"name": "x", "dtype": "float32", "shape": list(X.shape)}],
        }
        frames = [_REQUEST, msgpack.packb(meta), X.tobytes()]
        self.pending[rid] = _Sent(frames, self.sock, generation)
        self.sock.send_multipart(frames, zmq.NOBLOCK)

    def _again(self, rid: int) -> None:
        """Send a pending request again on the current socket (same id and client)."""
        sent = self.pending[rid]
        sent.sock = self.sock
        self.sock.send_multipart(sent.frames, zmq.NOBLOCK)

    def sockets(self) -> list[zmq.Socket[bytes]]:
        return [self.sock, *(s for s, _ in self.retired)]

    def on_message(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        header, meta = frames[0], msgpack.unpackb(frames[1])
        rid = meta.get("id")
        if rid not in self.pending:
            self.answered["late or unknown"] += 1
            return
        if header == _REPLY:
            self.answered["result"] += 1
            self.results[self.pending[rid].generation] += 1
        elif header == _ERROR and self.follows and meta.get("code") == _OVERLOADED:
            self.answered["overloaded (sent again)"] += 1
            wait_s = meta.get("retry_after_ms", 50) / 1000
            heapq.heappush(self.later, (time.monotonic() + wait_s, rid))
            return
        elif header == _ERROR and meta.get("retry") is True:
            if not self.follows:
                self.answered["retry (not sent again)"] += 1
            else:
                if sock is self.sock:  # the first on this socket: it retires
                    self.retired.append((self.sock, self.monitor))
                    self.sock, self.monitor = self._open()
                self._again(rid)
                return
        else:
            self.answered[f"error {meta.get('code')}"] += 1
        del self.pending[rid]

    def due(self, now: float) -> None:
        """Send again the requests refused OVERLOADED whose wait is over."""
        while self.later and self.later[0][0] <= now:
            rid = heapq.heappop(self.later)[1]
            if rid in self.pending:
                self._again(rid)

    def on_closed(self) -> None:
        """A retired socket's connection closed: what is still unanswered on it is sent
        again on the current socket, and the old socket closes."""
        for sock, monitor in list(self.retired):
            if not monitor.poll(0):
                continue
            monitor.recv_multipart()
            for rid, sent in self.pending.items():
                if sent.sock is sock:
                    self._again(rid)
            self.retired.remove((sock, monitor))
            monitor.close(linger=0)
            sock.close(linger=0)

    def close(self) -> None:
        for sock, monitor in [(self.sock, self.monitor), *self.retired]:
            monitor.close(linger=0)
            sock.close(linger=0)


@dataclass
class Stop:
    """One stop: how long the broker took to exit, and its generation's losses."""

    exit_s: float
    lost: dict[str, int]


KINDS = ("follows", "ignores", "sdk")
#: The longest any one step waits for what it waits on (a broker that serves, a stopping
#: one that exits, the last answers): past it, the run fails (a hang, not a slow machine).
HANG_S = 60.0


class Hang(RuntimeError):
    """A step of the run waited :data:`HANG_S` for an event that did not come."""


def run_stops(
    rounds: int = 5,
    rate_rps: float = 1000.0,
    per_round: int = 100,
    min_sent: int = 1200,
    window: int = 500,
    kinds: tuple[str, ...] = KINDS,
    transport: str = "ipc",
) -> dict[str, Any]:
    """Stop and restart a broker ``rounds`` times under load from clients of ``kinds``
    (``rate_rps`` in all, split evenly, each client with at most ``window`` requests
    unanswered); returns the counts.

    Each broker is stopped once it has answered ``per_round`` results to each client,
    for requests first sent after it started (so it serves, with traffic flowing through
    it, when it is told to stop). The clients send until the last broker has done the
    same and each has sent ``min_sent`` requests, then wait for every answer: each step
    waits for its event, :data:`HANG_S` at most (:class:`Hang`).
    """
    workdir = Path(tempfile.mkdtemp(prefix="carpool-stops-"))
    ends = endpoints(workdir, transport)
    endpoint = ends[0]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    log = (workdir / "broker.log").open("wb")
    brokers = [start_broker(ends, log)]
    clients = {
        kind: RawClient(context, endpoint, follows=kind == "follows")
        for kind in kinds
        if kind != "sdk"
    }
    share_rps = rate_rps / len(kinds)
    sdk_futures: list[tuple[int, Any]] = []
    generation = [0]
    sending = threading.Event()
    sending.set()
    sdk_error: list[BaseException] = []

    def sdk_loop() -> None:
        try:
            with Client(endpoint, default_timeout_s=TIMEOUT_S, grace_s=1.0) as client:
                due = time.monotonic()
                unanswered: list[Any] = []
                while sending.is_set():
                    now = time.monotonic()
                    if len(unanswered) >= window:
                        unanswered = [f for f in unanswered if not f.done()]
                    if now < due or len(unanswered) >= window:
                        client.poll(max(0.0, min(due - now, 0.002)))
                        due = max(due, now) if len(unanswered) >= window else due
                        continue
                    future = client.submit(MODEL, {"x": X})
                    sdk_futures.append((generation[0], future))
                    unanswered.append(future)
                    due += 1 / share_rps
                for _, future in sdk_futures:  # each resolves by its own deadline
                    with contextlib.suppress(RequestError):
                        future.result(TIMEOUT_S + 5)
        except BaseException as exc:  # surfaced after the run
            sdk_error.append(exc)

    sdk_results = _SdkResults(sdk_futures)
    stops: list[float] = []
    try:
        _until_serving(context, endpoint)
        sdk = threading.Thread(target=sdk_loop, daemon=True)
        if "sdk" in kinds:
            sdk.start()
        poller = zmq.Poller()
        due = time.monotonic()
        stopped_at: float | None = None
        waits_since = due  # when the step now waited on began (the hang guard)

        def serves(gen: int) -> bool:
            """The broker of ``gen`` answered ``per_round`` results to every client."""
            raw = all(c.results[gen] >= per_round for c in clients.values())
            return raw and ("sdk" not in kinds or sdk_results.count(gen) >= per_round)

        while True:
            now = time.monotonic()
            if stopped_at is None and len(stops) < rounds and serves(generation[0]):
                brokers[-1].send_signal(signal.SIGTERM)
                stopped_at = waits_since = now
            if stopped_at is not None and brokers[-1].poll() is not None:
                stops.append(time.monotonic() - stopped_at)
                generation[0] += 1
                brokers.append(start_broker(ends, log))
                stopped_at = None
                waits_since = time.monotonic()
            if (
                len(stops) == rounds
                and stopped_at is None
                and serves(generation[0])
                and all(c.sent >= min_sent for c in clients.values())
                and ("sdk" not in kinds or len(sdk_futures) >= min_sent)
            ):
                break
            if now - waits_since > HANG_S:
                raise Hang(f"step {len(stops)} of {rounds}: {HANG_S} s without its event")
            if now >= due:
                for client in clients.values():
                    if len(client.pending) < window:
                        client.send(generation[0])
                due = max(due + 1 / share_rps, now - 0.1)  # (a stall leaves no burst)
            for client in clients.values():
                client.due(now)
            _read(poller, clients, max(0.0, min(due - time.monotonic(), 0.002)))
        sending.clear()
        until = time.monotonic() + TIMEOUT_S + 5  # (each answer comes by its deadline)
        while any(c.pending for c in clients.values()) and time.monotonic() < until:
            _read(poller, clients, 0.01)
            for client in clients.values():
                client.due(time.monotonic())
        if "sdk" in kinds:
            sdk.join(TIMEOUT_S + 10)
    finally:
        sending.clear()
        for broker in brokers:
            if broker.poll() is None:
                broker.send_signal(signal.SIGTERM)
                broker.wait(15)
        for client in clients.values():
            client.close()
        context.destroy(linger=0)
        log.close()
    if sdk_error:
        raise sdk_error[0]
    lost: dict[str, Counter[int]] = {kind: Counter() for kind in kinds}
    for kind, client in clients.items():
        for sent in client.pending.values():
            lost[kind][sent.generation] += 1
    sdk_answers: Counter[str] = Counter()
    for gen, future in sdk_futures:
        try:
            future.result(0)
            sdk_answers["result"] += 1
        except RequestError as exc:
            given_up = any(text in str(exc) for text in _GIVEN_UP)
            sdk_answers["given up" if given_up else type(exc).__name__] += 1
            if given_up:  # the SDK's own answer: no broker's came
                lost["sdk"][gen] += 1
        except TimeoutError:
            sdk_answers["unresolved"] += 1
            lost["sdk"][gen] += 1
    return {
        "rounds": rounds,
        "rate_rps": rate_rps,
        "transport": transport,
        "stops": [
            {"exit_s": round(s, 3), "lost": {k: lost[k][i] for k in lost}}
            for i, s in enumerate(stops)
        ],
        "lost_after_last_stop": {k: lost[k][len(stops)] for k in lost},
        "sent": {**{k: c.sent for k, c in clients.items()}, "sdk": len(sdk_futures)},
        "answers": {
            **{k: dict(c.answered) for k, c in clients.items()},
            "sdk": dict(sdk_answers),
        },
    }


TIMEOUT_S = TIMEOUT_MS / 1000
#: What the SDK says when it fails a request itself, no broker having answered it.
_GIVEN_UP = ("connection to the broker closed", "no reply from the broker")


class _SdkResults:
    """The SDK's results by the generation its requests were first sent to (read from the
    futures its thread appends; a future is answered by that thread)."""

    def __init__(self, futures: list[tuple[int, Any]]) -> None:
        self._futures = futures
        self._seen = 0
        self._open: list[tuple[int, Any]] = []
        self._results: Counter[int] = Counter()

    def count(self, gen: int) -> int:
        added = self._futures[self._seen :]
        self._seen += len(added)
        still = []
        for sent, future in [*self._open, *added]:
            if not future.done():
                still.append((sent, future))
                continue
            with contextlib.suppress(RequestError):
                future.result(0)
                self._results[sent] += 1
        self._open = still
        return self._results[gen]


def _read(poller: zmq.Poller, clients: dict[str, RawClient], wait_s: float) -> None:
    """Take what waits on every client's sockets (polling at most ``wait_s``)."""
    owners: dict[zmq.Socket[bytes], RawClient] = {}
    for client in clients.values():
        for sock in client.sockets():
            owners[sock] = client
            poller.register(sock, zmq.POLLIN)
        for _, monitor in client.retired:
            owners[monitor] = client
            poller.register(monitor, zmq.POLLIN)
    try:
        events = dict(poller.poll(max(0, int(wait_s * 1000))))
        for sock in events:
            client = owners[sock]
            if sock in client.sockets():
                while sock.poll(0):
                    client.on_message(sock, sock.recv_multipart())
            else:
                client.on_closed()
    finally:
        for sock in owners:
            poller.unregister(sock)


def _until_serving(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
    probe = RawClient(context, endpoint, follows=True)
    try:
        until = time.monotonic() + 30
        while time.monotonic() < until:
            probe.send(0)
            if probe.sock.poll(500):
                probe.on_message(probe.sock, probe.sock.recv_multipart())
                if probe.answered["result"]:
                    return
        raise RuntimeError("the broker did not answer within 30 s")
    finally:
        probe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=1000.0, help="requests/s, all clients")
    parser.add_argument("--per-round", type=int, default=100, help="results a broker serves")
    parser.add_argument("--min-sent", type=int, default=1200, help="requests, each client")
    parser.add_argument("--window", type=int, default=500, help="unanswered, each client")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    args = parser.parse_args()
    counts = run_stops(
        args.rounds,
        args.rate,
        args.per_round,
        args.min_sent,
        args.window,
        transport=args.transport,
    )
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
