"""common.py: what the benchmarks in bench/ share — processes, closed loops, stats, tables.

The scripts next to this file import it as ``common`` (Python puts a script's directory
first on ``sys.path``). It is also the helper process that some benchmarks start::

    python bench/common.py echo ENDPOINT
        a plain pyzmq ROUTER that sends every multipart message straight back

    python bench/common.py relay FRONTEND TARGET
        zmq.proxy between a ROUTER on FRONTEND and a DEALER connected to TARGET (an echo
        server behind it makes a broker's topology, four socket transfers per request,
        with no Python per message)

    python bench/common.py bare-broker FRONTEND BACKEND
    python bench/common.py bare-worker BACKEND
        the echo server's loop as a broker (client messages to the one worker, tagged with
        the client's id; its answers back) and as a worker (a REPLY for each request, its
        payload sent back as the output): the fleet's processes and four hops with no
        carpool code, for the round trip the floor of that topology in Python (not for
        the rate: they forward each request alone). A BACKEND of ``unix:PATH``
        links the two by a unix stream socket (length-prefixed msgpack lists of frames)
        instead of a ROUTER/DEALER pair: the same relays with the broker-worker hops
        outside libzmq's I/O threads. That link is a latency probe for small messages
        and few in flight: both ends write blocking, so large messages in both
        directions at once can wedge it (then the group's SIGKILL ends them)

    python bench/common.py workers BROKER --count N --models JSON
        N carpool WorkerServers with SyntheticEngines, on threads of ONE process and one
        zmq context (so 32 workers do not mean 32 processes on a 2-core machine)

The helpers exit on SIGTERM or SIGINT, and by themselves when their parent goes away.

Every process started through :class:`ProcessGroup` is stopped when the group exits:
SIGTERM to all, a bounded wait, then SIGKILL for what is left. Endpoints are ``ipc://``
paths in the group's temporary directory (removed on exit) or ``tcp://127.0.0.1`` ports.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np
import psutil
import zmq
from numpy.typing import NDArray

HERE = Path(__file__).resolve()
OUT = HERE.parent / "out"
CARPOOL = [sys.executable, "-m", "carpool", "--log-level", "WARNING"]
#: How long a started process may take to stop after SIGTERM before it is killed.
STOP_TIMEOUT_S = 10.0
#: How long processes may take to come up (imports, engine warm-up, registration).
START_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------- arguments


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has."""
    text = doc or ""
    p = argparse.ArgumentParser(
        description=text.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a smoke run (under about a minute)")
    p.add_argument(
        "--transport",
        choices=("ipc", "tcp"),
        default="ipc",
        help="ipc:// in a temp dir (default) or tcp://127.0.0.1",
    )
    p.add_argument("--reps", type=int, help="repetitions of each measurement (median reported)")
    return p


def quiet_logs() -> None:
    """In-process carpool code (clients, engines) logs warnings only."""
    logging.getLogger("carpool").setLevel(logging.WARNING)


# ---------------------------------------------------------------------- processes


class ProcessGroup:
    """Processes of one benchmark and the temp dir for their ipc endpoints.

    Use as a context manager; on exit every process is stopped (SIGTERM, wait, SIGKILL)
    and the temp dir removed.
    """

    def __init__(self, transport: str = "ipc") -> None:
        self.transport = transport
        self.tmp = Path(tempfile.mkdtemp(prefix="carpool-bench-"))
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def endpoint(self, name: str) -> str:
        if self.transport == "ipc":
            return f"ipc://{self.tmp}/{name}"
        return f"tcp://127.0.0.1:{free_port()}"

    def start(self, name: str, cmd: Sequence[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.procs.append((name, proc))
        return proc

    def broker(
        self,
        frontend: str,
        backend: str,
        *flags: str,
        config: Mapping[str, int | float | str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """``carpool broker`` as a process; ``config`` becomes its TOML file."""
        cmd = [*CARPOOL, "broker", "--frontend", frontend, "--backend", backend, *flags]
        if config:
            path = self.tmp / f"broker-{len(self.procs)}.toml"
            path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
            cmd += ["--config", str(path)]
        return self.start("broker", cmd)

    def worker(self, backend: str, *flags: str) -> subprocess.Popen[bytes]:
        """``carpool worker`` as a process, e.g. flags ``--synthetic 0 0``."""
        return self.start("worker", [*CARPOOL, "worker", "--broker", backend, *flags])

    def worker_host(
        self, backend: str, count: int, models: Sequence[SyntheticModel], *, slots: int = 2
    ) -> subprocess.Popen[bytes]:
        """``count`` synthetic workers on threads of one helper process."""
        spec = json.dumps([m.to_json() for m in models])
        cmd = [sys.executable, str(HERE), "workers", backend, "--count", str(count)]
        return self.start(f"workers x{count}", [*cmd, "--models", spec, "--slots", str(slots)])

    def echo(self, endpoint: str) -> subprocess.Popen[bytes]:
        """The plain pyzmq ROUTER echo server as a process."""
        return self.start("echo", [sys.executable, str(HERE), "echo", endpoint])

    def bare_fleet(self, frontend: str, backend: str) -> list[subprocess.Popen[bytes]]:
        """The bare broker and bare worker (see the module docstring) as two processes;
        :func:`wait_echo` on ``frontend`` returns once they are connected."""
        me = [sys.executable, str(HERE)]
        return [
            self.start("bare broker", [*me, "bare-broker", frontend, backend]),
            self.start("bare worker", [*me, "bare-worker", backend]),
        ]

    def relay(self, frontend: str, target: str) -> subprocess.Popen[bytes]:
        """A ``zmq.proxy`` (ROUTER ``frontend`` <-> DEALER connected to ``target``) as a
        process: a broker's topology with no Python per message."""
        return self.start("relay", [sys.executable, str(HERE), "relay", frontend, target])

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} (pid {proc.pid}) exited with {proc.returncode}")

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop one process of the group now."""
        stop_all([proc])
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    def close(self) -> None:
        stop_all([p for _, p in reversed(self.procs)])
        self.procs.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process, wait up to STOP_TIMEOUT_S in all, then SIGKILL the rest."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    until = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when this process dies, even by
    SIGKILL, so no broker or worker outlives an interrupted benchmark."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_workers(frontend: str, count: int, group: ProcessGroup | None = None) -> None:
    """Wait until the broker at ``frontend`` lists at least ``count`` workers."""
    from carpool.client import Client

    until = time.monotonic() + START_TIMEOUT_S
    with Client(frontend) as client:
        while True:
            if group is not None:
                group.check_alive()
            with contextlib.suppress(TimeoutError):
                if len(client.stats(timeout_s=1.0)["workers"]) >= count:
                    return
            if time.monotonic() > until:
                raise RuntimeError(f"fewer than {count} workers registered at {frontend}")
            time.sleep(0.1)


def wait_echo(endpoint: str, group: ProcessGroup | None = None) -> None:
    """Wait until the echo server at ``endpoint`` answers."""
    sock = dealer(endpoint)
    try:
        until = time.monotonic() + START_TIMEOUT_S
        sock.send(b"ping")
        while not sock.poll(100):
            if group is not None:
                group.check_alive()
            if time.monotonic() > until:
                raise RuntimeError(f"no echo from {endpoint}")
        sock.recv()
    finally:
        sock.close()


class CpuMeter:
    """CPU seconds (user, system) of one process, all of its threads."""

    def __init__(self, pid: int | None = None) -> None:
        self.process = psutil.Process(pid)

    def read(self) -> tuple[float, float]:
        t = self.process.cpu_times()
        return t.user, t.system

    def read_main(self) -> tuple[float, float]:
        """CPU seconds (user, system) of the process's main thread only: for carpool's
        servers the thread that runs all of their Python. The rest of the process is
        libzmq's I/O thread (the kernel's copies into and out of sockets land there)."""
        for t in self.process.threads():
            if t.id == self.process.pid:
                return t.user_time, t.system_time
        raise RuntimeError(f"no main thread listed for pid {self.process.pid}")


# ---------------------------------------------------------------------- payloads


@dataclass(frozen=True, slots=True)
class SyntheticModel:
    """A SyntheticEngine model for the worker host: cost fixed + per_sample·B, item shape."""

    name: str = "synthetic"
    fixed_ms: float = 0.0
    per_sample_ms: float = 0.0
    item_shape: tuple[int, ...] = (16,)
    max_batch: int = 8
    output_items: int = 0  # 0: output shaped like the input; n: [B, n]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fixed_ms": self.fixed_ms,
            "per_sample_ms": self.per_sample_ms,
            "item_shape": list(self.item_shape),
            "max_batch": self.max_batch,
            "output_items": self.output_items,
        }


def tensor(shape: tuple[int, ...], seed: int = 0) -> NDArray[np.float32]:
    """A float32 input of ``shape`` with varied values (so a wrong answer shows)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def request_frames(model: str, x: NDArray[Any], timeout_s: float = 10.0) -> list[Any]:
    """The frames Client.submit would send for ``{"x": x}``, encoded once (for raw loops)."""
    from carpool.client.core import ClientCore

    _, frames = ClientCore().request(0.0, model, {"x": x}, timeout_s)
    return frames


# ---------------------------------------------------------------------- closed loops


@dataclass(slots=True)
class LoopResult:
    """One measurement of a closed loop."""

    completed: int
    errors: int
    elapsed_s: float
    latencies_s: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.completed / self.elapsed_s if self.elapsed_s > 0 else 0.0


class FleetLoop:
    """A closed loop through the carpool Client: keep ``in_flight`` requests outstanding.

    :meth:`run` returns after ``requests`` replies or ``max_s`` seconds, whichever comes
    first; it sends at most as many as it still has to count, and leaves what is out in
    flight, so calls can follow one another (fill, warm up, measure); :meth:`fill` tops up
    to ``in_flight`` first; :meth:`drain` waits for what is still out.

    Replies are matched in submission order (pop done futures from the left), which is
    cheap with 10,000 outstanding; with ``latencies`` every outstanding future is checked
    after each poll instead, so out-of-order replies get their own completion times. A
    latency runs from just before ``submit`` (encoding included) to the return of the
    ``poll`` that decoded the reply.
    """

    def __init__(
        self,
        client: Any,
        model: str,
        inputs: Mapping[str, NDArray[Any]],
        in_flight: int,
        *,
        timeout_s: float = 10.0,
        latencies: bool = False,
    ) -> None:
        self.client = client
        self.model = model
        self.inputs = inputs
        self.in_flight = in_flight
        self.timeout_s = timeout_s
        self.latencies = latencies
        self._pending: deque[tuple[Any, float]] = deque()
        from carpool.client import RequestError  # (not per reply: an import costs ~1.5 us)

        self._request_error = RequestError

    def _settle(self, future: Any) -> bool:
        try:
            future.result(0)
        except self._request_error:
            return False
        return True

    def fill(self, max_s: float) -> int:
        """Submit until ``in_flight`` requests are out (bounded by ``max_s``), pumping
        replies on the way so none wait unread; returns how many were sent."""
        client = self.client
        until = time.perf_counter() + max_s
        sent = 0
        while client.in_flight < self.in_flight and time.perf_counter() < until:
            t0 = time.perf_counter()
            f = client.submit(self.model, self.inputs, self.timeout_s)
            self._pending.append((f, t0))
            sent += 1
            if sent % 100 == 0:
                client.poll(0)
        return sent

    def run(self, requests: int, max_s: float) -> LoopResult:
        client = self.client
        start = time.perf_counter()
        until = start + max_s
        last = start
        completed = errors = 0
        lat: list[float] = []
        pending = self._pending
        while completed < requests:
            now = time.perf_counter()
            if now >= until:
                break
            # Top up; never send more than this run can still count.
            room = min(self.in_flight - client.in_flight, requests - completed)
            for _ in range(max(0, room)):
                t0 = time.perf_counter()
                f = client.submit(self.model, self.inputs, self.timeout_s)
                pending.append((f, t0))
            if not client.poll(min(0.1, until - now)):
                continue
            last = time.perf_counter()
            if self.latencies:
                keep: deque[tuple[Any, float]] = deque()
                for f, t0 in pending:
                    if not f.done():
                        keep.append((f, t0))
                    elif self._settle(f):
                        completed += 1
                        lat.append(last - t0)
                    else:
                        errors += 1
                self._pending = pending = keep
            else:
                while pending and pending[0][0].done():
                    f, t0 = pending.popleft()
                    if self._settle(f):
                        completed += 1
                    else:
                        errors += 1
        return LoopResult(completed, errors, last - start, lat)

    def drain(self, max_s: float = 15.0) -> None:
        until = time.perf_counter() + max_s
        while self.client.in_flight and time.perf_counter() < until:
            self.client.poll(0.1)
        self._pending.clear()


def raw_loop(
    sock: zmq.Socket[bytes],
    frames: Sequence[Any],
    in_flight: int,
    requests: int,
    max_s: float,
    *,
    expect_command: int | None = None,
    latencies: bool = False,
) -> LoopResult:
    """The same closed loop on a bare DEALER: send pre-encoded ``frames``, count replies.

    Replies are taken in order (true for the echo server). With ``expect_command`` a reply
    whose header frame names another command counts as an error. Outstanding replies are
    drained (bounded) before returning.
    """
    start = time.perf_counter()
    until = start + max_s
    last = start
    sent = received = errors = 0
    sent_at: deque[float] = deque()
    lat: list[float] = []
    while received < requests:
        now = time.perf_counter()
        if now >= until:
            break
        while sent - received < in_flight and sent < requests:
            sent_at.append(time.perf_counter())
            sock.send_multipart(frames, copy=False)
            sent += 1
        if not sock.poll(math.ceil(1000 * min(0.1, until - now))):
            continue
        while True:
            try:
                reply = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            # A round trip ends when the reply has been received (as for the Client and
            # paced loops), not when the poll says one is there.
            last = time.perf_counter()
            received += 1
            t0 = sent_at.popleft()
            if expect_command is not None and reply[0].bytes[3] != expect_command:
                errors += 1
            elif latencies:
                lat.append(last - t0)
    measured = received
    drain_until = time.perf_counter() + 15.0
    while received < sent and time.perf_counter() < drain_until:
        if sock.poll(100):
            sock.recv_multipart()
            received += 1
    return LoopResult(measured - errors, errors, last - start, lat)


def dealer(endpoint: str) -> zmq.Socket[bytes]:
    """A DEALER like the Client's (linger 0) on the shared context; close it when done."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


# ---------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else math.nan


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        parts = [
            r[0].ljust(widths[0]),
            *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)),
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _cell(v: object) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ---------------------------------------------------------------------- output


def write_json(name: str, data: Mapping[str, Any]) -> Path:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}")
    return path


def _jsonable(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON: {type(obj).__name__}")


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None (with a note) if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    return plt


def save_plot(fig: Any, name: str) -> Path:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


# ---------------------------------------------------------------------- helper processes


class _Stopper:
    """Set on SIGTERM/SIGINT; also reports a vanished parent."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.parent = os.getppid()
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()

    def should_stop(self) -> bool:
        return self.event.is_set() or os.getppid() != self.parent


def _helper_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    """A socket of the helper processes: no linger, 10,000 messages queued each way."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    return sock


def _answer_each(
    sock: zmq.Socket[Any],
    stopper: _Stopper,
    answer: Callable[[list[zmq.Frame]], Sequence[Any]] | None = None,
) -> None:
    """The echo server's loop: wait for messages, then for each of up to 256 waiting send
    ``answer(message)`` (the message itself without ``answer``)."""
    while not stopper.should_stop():
        if not sock.poll(100):
            continue
        for frames in _waiting(sock):
            sock.send_multipart(frames if answer is None else answer(frames), copy=False)


def _waiting(sock: zmq.Socket[Any]) -> Iterator[list[zmq.Frame]]:
    """Up to 256 messages waiting on ``sock``, received without blocking."""
    for _ in range(256):
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


def _echo_main(endpoint: str) -> int:
    stopper = _Stopper()
    ctx = zmq.Context()
    sock = _helper_socket(ctx, zmq.ROUTER)
    sock.bind(endpoint)
    try:
        _answer_each(sock, stopper)
    finally:
        sock.close()
        ctx.term()
    return 0


_LINK_LEN = struct.Struct("<I")


def _link_send(sock: socket.socket, frames: Sequence[Any]) -> None:
    """One message on a bare unix link: a 4-byte length, then a msgpack list of frames."""
    import msgpack

    body = msgpack.packb([bytes(f) for f in frames])
    sock.sendall(_LINK_LEN.pack(len(body)) + body)


def _link_recv(sock: socket.socket) -> list[bytes] | None:
    """The next message of a bare unix link (blocking: the relays' messages are small);
    None when the peer has gone."""
    import msgpack

    head = _recv_exactly(sock, _LINK_LEN.size)
    if head is None:
        return None
    body = _recv_exactly(sock, _LINK_LEN.unpack(head)[0])
    return None if body is None else list(msgpack.unpackb(body))


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buf)


def _bare_broker_unix_main(frontend: str, path: str, stopper: _Stopper) -> int:
    """The bare broker with its worker on a unix stream socket at ``path``."""
    ctx = zmq.Context()
    front = _helper_socket(ctx, zmq.ROUTER)
    front.bind(frontend)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(0.2)
    conn: socket.socket | None = None
    try:
        while conn is None and not stopper.should_stop():
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
        if conn is None:
            return 0
        conn.settimeout(None)
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)
        while not stopper.should_stop():
            events = dict(poller.poll(100))
            if conn.fileno() in events:
                msg = _link_recv(conn)
                if msg is None:
                    return 0
                front.send_multipart(msg, copy=False)
            if front in events:
                for frames in _waiting(front):
                    _link_send(conn, frames)
    finally:
        if conn is not None:
            conn.close()
        listener.close()
        front.close()
        ctx.term()
    return 0


def _bare_broker_main(frontend: str, backend: str) -> int:
    """Client [id, *frames] -> worker [id, *frames]; worker [id, *frames] -> client."""
    stopper = _Stopper()
    if backend.startswith("unix:"):
        return _bare_broker_unix_main(frontend, backend[len("unix:") :], stopper)
    ctx = zmq.Context()
    front, back = _helper_socket(ctx, zmq.ROUTER), _helper_socket(ctx, zmq.ROUTER)
    front.bind(frontend)
    back.bind(backend)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    worker: bytes | None = None
    held: list[list[Any]] = []  # client messages from before the worker said hello
    try:
        while not stopper.should_stop():
            events = dict(poller.poll(100))
            if back in events:
                for frames in _waiting(back):
                    if len(frames) == 2 and frames[1].bytes == b"hello":
                        worker = frames[0].bytes
                        for msg in held:
                            back.send_multipart([worker, *msg], copy=False)
                        held.clear()
                    else:
                        front.send_multipart(frames[1:], copy=False)
            if front in events:
                for frames in _waiting(front):
                    if worker is None:
                        held.append(frames)
                    else:
                        back.send_multipart([worker, *frames], copy=False)
    finally:
        front.close()
        back.close()
        ctx.term()
    return 0


def _bare_worker_main(backend: str) -> int:
    """[client, header, meta, *payloads] -> [client, REPLY, reply meta, *payloads]; any
    other message goes back as it came (the ping of :func:`wait_echo`)."""
    import msgpack

    from carpool.common.protocol import Command, header

    stopper = _Stopper()
    reply = header(Command.REPLY)

    def answer(frames: Sequence[Any]) -> list[Any]:
        if len(frames) < 4:
            return list(frames)
        meta = msgpack.unpackb(frames[2])
        out = {"id": meta["id"], "outputs": meta["inputs"], "batch_size": 1}
        return [frames[0], reply, msgpack.packb(out), *frames[3:]]

    if backend.startswith("unix:"):
        link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        until = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                link.connect(backend[len("unix:") :])
                break
            except OSError:
                if stopper.should_stop() or time.monotonic() > until:
                    return 1
                time.sleep(0.05)
        try:
            while not stopper.should_stop():
                if not select.select([link], [], [], 0.1)[0]:
                    continue
                msg = _link_recv(link)
                if msg is None:
                    return 0
                _link_send(link, answer(msg))
        finally:
            link.close()
        return 0
    ctx = zmq.Context()
    sock = _helper_socket(ctx, zmq.DEALER)
    sock.connect(backend)
    sock.send(b"hello")
    try:
        _answer_each(sock, stopper, answer)
    finally:
        sock.close()
        ctx.term()
    return 0


def _relay_main(frontend: str, target: str) -> int:
    stopper = _Stopper()
    ctx = zmq.Context()
    front, back = _helper_socket(ctx, zmq.ROUTER), _helper_socket(ctx, zmq.DEALER)
    front.bind(frontend)
    back.connect(target)
    # zmq.proxy never returns; it runs on a daemon thread and the process exits under it.
    threading.Thread(target=zmq.proxy, args=(front, back), daemon=True).start()
    while not stopper.should_stop():
        stopper.event.wait(0.2)
    os._exit(0)


def _workers_main(broker: str, count: int, models: list[dict[str, Any]], slots: int) -> int:
    from carpool.common.memory import tune_allocator
    from carpool.common.testing import ServerThread
    from carpool.worker.engines.synthetic import SyntheticEngine
    from carpool.worker.server import WorkerServer

    tune_allocator()  # as `carpool worker` does
    stopper = _Stopper()
    factories = {
        m["name"]: functools.partial(
            SyntheticEngine,
            fixed_cost_s=m["fixed_ms"] / 1000,
            per_sample_s=m["per_sample_ms"] / 1000,
            item_shape=tuple(m["item_shape"]),
            max_batch=m["max_batch"],
            output_items=m.get("output_items", 0),
        )
        for m in models
    }
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with contextlib.ExitStack() as stack:
            for i in range(count):
                if stopper.should_stop():
                    break
                server = WorkerServer(
                    broker, factories, name=f"bench-{i}", slots=slots, context=ctx
                )
                stack.enter_context(ServerThread(server))
            while not stopper.should_stop():
                stopper.event.wait(0.2)
    finally:
        ctx.term()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="helper processes of the benchmarks")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("echo", help="a ROUTER that echoes every message")
    e.add_argument("endpoint")
    r = sub.add_parser("relay", help="zmq.proxy: ROUTER frontend <-> DEALER to a target")
    r.add_argument("frontend")
    r.add_argument("target")
    b = sub.add_parser("bare-broker", help="the echo's loop as a broker (one worker)")
    b.add_argument("frontend")
    b.add_argument("backend")
    bw = sub.add_parser("bare-worker", help="the echo's loop as a worker")
    bw.add_argument("backend")
    w = sub.add_parser("workers", help="synthetic workers on threads of one process")
    w.add_argument("broker", help="the broker's backend endpoint")
    w.add_argument("--count", type=int, default=1)
    w.add_argument("--models", default="[{}]", help="JSON list of SyntheticModel fields")
    w.add_argument("--slots", type=int, default=2)
    args = p.parse_args(argv)
    logging.getLogger("carpool").setLevel(logging.WARNING)
    if args.command == "echo":
        return _echo_main(args.endpoint)
    if args.command == "relay":
        return _relay_main(args.frontend, args.target)
    if args.command == "bare-broker":
        return _bare_broker_main(args.frontend, args.backend)
    if args.command == "bare-worker":
        return _bare_worker_main(args.backend)
    models = [SyntheticModel(**m).to_json() for m in json.loads(args.models)]
    return _workers_main(args.broker, args.count, models, args.slots)


if __name__ == "__main__":
    sys.exit(main())
