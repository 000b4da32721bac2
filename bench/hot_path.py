"""Where does the broker's time per request go? (the profiling harness for the hot path)

Not one of the six questions: the tool for answering "what next" for questions 1-3.

* ``core``: the broker's Python alone, no sockets. A ``BrokerCore`` in this process (the
  server's deferred mode, one synthetic worker with 2 slots) is fed framed REQUESTs in
  bursts of k (1, 4, 8), a tick per turn as the server does, and a RESULT for every BATCH.
  Prints microseconds per request (including this harness's own msgpack encoding of the
  requests and results, ~10 us) and the mean batch size, for the ``carpool`` and ``fixed``
  policies. With ``--profile`` it prints cProfile's top functions for one setting.
* ``embedded``: a ``BrokerServer`` with an embedded null-engine worker in this process,
  stepped by hand under a DEALER at one request in flight (send, ``step()`` until the
  reply is there, receive): microseconds per round trip with everything hot, the floor
  under the embedded broker's low-load latency. ``--profile`` prints cProfile's top
  functions.
* ``worker``: a ``WorkerServer`` with a null engine in this process, under a ROUTER that
  plays the broker (inproc): a BATCH of ``--burst`` requests (1 by default) sent, the
  worker stepped by hand until its RESULT is there, received. Microseconds per batch with
  everything hot: the worker's share of a worker process's round trip. ``--profile``
  prints cProfile's top functions.
* ``client``: the ``Client`` in this process under a ROUTER that plays the broker
  (inproc): ``--burst`` requests submitted, answered by the ROUTER at once (a REPLY
  packed per request), polled until done. Microseconds per request with everything hot,
  the harness's own ROUTER included: the SDK's share of a round trip and of the client's
  CPU under load. ``--profile`` prints cProfile's top functions.
* ``hops``: one hop's price. Two processes pass 64 bytes back and forth, one at a time,
  over a pipe, over carpool's ``Link`` (a unix socket pair, polled, as the broker's local
  endpoint) and over a pyzmq DEALER/ROUTER pair on ``ipc://``: the p50 round trip of each
  (a ZeroMQ hop wakes the sender's I/O thread, the receiver's, then the receiving thread;
  a pipe or a unix socket wakes the receiving thread).
* ``wake``: what it costs to wake a process whose CPU has been idle. A child pinned to
  one CPU blocks on a pipe; the parent, pinned to the other, spins for a set time (the
  child's CPU idles that long), then writes its clock; the child reads it and sends back
  how long it took to run. The p50 by idle time. On a VM whose guest halts idle CPUs and
  whose host polls a halted vCPU for a while before descheduling it (KVM's halt_poll_ns,
  200 us by default), the price steps up past that window.
* ``spy``: the real processes (``carpool broker``, ``carpool worker --synthetic 0 0``), a
  raw DEALER closed loop (8 in flight by default), CPU per request of broker and worker
  (main thread and whole process), the broker's batch-size distribution, and with
  ``--py-spy`` a ``py-spy record -f raw`` of both summarized as self / inclusive shares.

Run:  .venv/bin/python bench/hot_path.py core [--profile carpool:1] [--json] [--cpu]
      .venv/bin/python bench/hot_path.py embedded [--profile] [--client] [--burst K] [--json]
      .venv/bin/python bench/hot_path.py worker [--profile] [--burst K] [--json]
      .venv/bin/python bench/hot_path.py client [--profile] [--burst K] [--json]
      .venv/bin/python bench/hot_path.py hops
      .venv/bin/python bench/hot_path.py wake
      .venv/bin/python bench/hot_path.py spy [--in-flight 8] [--seconds 6] [--py-spy]
          [--embedded]   (the null-engine worker inside the broker's process)
          [--client]     (the carpool Client drives it, not a raw DEALER)
``--json`` prints the figures as one JSON object (``bench/compare_revs.py`` reads it).
py-spy is not a dependency: ``.venv/bin/pip install py-spy`` first (it needs ptrace).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import inspect
import itertools
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from operator import call
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from common import (
    CpuMeter,
    FleetLoop,
    ProcessGroup,
    dealer,
    quiet_logs,
    raw_loop,
    request_frames,
    tensor,
    wait_workers,
)

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import BrokerCore, Side
from carpool.client import Client
from carpool.common.protocol import (
    Command,
    ModelSpec,
    Ready,
    TensorMeta,
    encode,
    header,
)

# msgpack's pack/unpack: in protocol/frames.py, or in common/codec.py at the older
# revisions this harness also drives (bench/instructions.py, compare_revs.py).
codec: Any
try:
    codec = importlib.import_module("carpool.common.codec")
except ImportError:
    codec = importlib.import_module("carpool.common.protocol.frames")


def _worker_message() -> Callable[[list[Any]], Any]:
    """What ``BrokerCore.on_worker`` takes of a worker's frames: the typed message (one
    decode, as a transport makes it), or at revisions before the transport seam the
    frames themselves (so that bench/compare_revs.py --harness this can measure those)."""
    try:
        from carpool.common.protocol import decode_from_worker
    except ImportError:
        return lambda frames: frames
    return decode_from_worker


def _engine_factory(model: Any) -> Any:
    """A ModelConfig's engine factory: :func:`carpool.worker.factory.engine_factory`, or
    at revisions without that module the config's own ``factory()`` (so that
    bench/compare_revs.py --harness this can measure those)."""
    try:
        from carpool.worker.factory import engine_factory
    except ImportError:
        return model.factory()
    return engine_factory(model)


def _worker_server(config: Any, **kwargs: Any) -> Any:
    """A WorkerConfig's server: :func:`carpool.worker.factory.worker_server`, or at
    revisions without that module the config's own ``server()`` (as above)."""
    try:
        from carpool.worker.factory import worker_server
    except ImportError:
        return config.server(**kwargs)
    return worker_server(config, **kwargs)


def _core(config: BrokerConfig) -> BrokerCore:
    """A core in the server's pump mode (messages queue work, the tick that ends each loop
    turn forms the batches): at revisions whose ``BrokerCore`` has two modes, asked for
    with ``defer_pumps=True``; at later ones its only mode."""
    if "defer_pumps" in inspect.signature(BrokerCore).parameters:
        return BrokerCore(config, defer_pumps=True)  # type: ignore[call-arg]
    return BrokerCore(config)


def _client_message() -> Callable[[list[Any]], Any]:
    """What ``BrokerCore.on_client`` takes of a client's frames (after the routing id):
    the frames themselves where it decodes them (its message parameter is ``frames``: it
    decodes with the layouts it remembers, at its first line, and at revisions before
    the typed client edge), else the typed message of ``decode_from_client`` (the decode
    a transport makes). (Before the typed edge ``on_client`` is the intake's, bound in
    the core's constructor, and takes frames.)"""
    method = getattr(BrokerCore, "on_client", None)
    if method is None or list(inspect.signature(method).parameters)[-1] == "frames":
        return lambda frames: frames
    protocol = importlib.import_module("carpool.common.protocol")
    decode: Callable[[list[Any]], Any] = protocol.decode_from_client
    return decode


def frames_of(out: list[Any]) -> list[tuple[Side, list[Any]]]:
    """The side and the frames a socket is handed for each outgoing message: a client's
    reply comes as frames, a worker's message as a typed message that its transport
    encodes (and wherever the core hands a message with ``to_frames``, that encoder is
    called here)."""
    frames = []
    for o in out:
        message = getattr(o, "message", None)
        frames.append((o.side, o.frames if message is None else message.to_frames()))
    return frames


def core_run(
    k: int,
    policy: str,
    n: int = 20_000,
    timer: Callable[[], float] = time.perf_counter,
    clock: Callable[[], float] = time.monotonic,
    edge: Callable[..., Any] = call,
) -> tuple[float, float]:
    """us per request (by ``timer``: wall time, or with ``time.process_time`` this
    process's CPU time) and mean batch size for bursts of ``k`` requests; ``clock`` is
    the ``now`` the core is given.

    Every call of the socket edge (a client's frames to the frames handed back, a tick,
    a worker's frames to the frames handed back: decode, core, encode) goes through
    ``edge`` and nothing else does: by default ``operator.call``, so that
    bench/instructions.py can count that edge alone (callgrind's
    ``--toggle-collect=_operator_call``), without this harness's own encoding of
    requests and results."""
    core = _core(BrokerConfig(batching=BatchingConfig(policy=policy, max_batch=32)))
    x = TensorMeta("x", "float32", (-1, 16))
    spec = ModelSpec("m", (x,), (TensorMeta("y", "float32", (-1, 16)),), 32)
    ready = encode(Command.READY, Ready("w", 2, (spec,)).to_wire())
    worker_message, client_message = _worker_message(), _client_message()

    def on_client(now: float, identity: bytes, frames: list[Any]) -> list[tuple[Side, list[Any]]]:
        return frames_of(core.on_client(now, identity, client_message(frames)))

    def on_worker(now: float, identity: bytes, frames: list[Any]) -> list[tuple[Side, list[Any]]]:
        return frames_of(core.on_worker(now, identity, worker_message(frames)))

    def on_tick(now: float) -> list[tuple[Side, list[Any]]]:
        return frames_of(core.on_tick(now))

    edge(on_worker, clock(), b"w", ready)
    data = np.zeros((1, 16), np.float32).tobytes()
    inputs = [{"name": "x", "dtype": "float32", "shape": [1, 16]}]
    reply_meta = codec.pack({"id": 1, "outputs": inputs, "batch_size": 1})
    reply = [header(Command.REPLY), reply_meta, data]
    request_header, batch_header = header(Command.REQUEST), header(Command.BATCH)
    rid = done = 0
    pending: list[dict[str, Any]] = []

    def collect(sent: list[tuple[Side, list[Any]]]) -> int:
        answered = 0
        for side, frames in sent:
            if side is Side.FRONTEND:
                answered += 1
            elif frames[0] == batch_header:
                pending.append(codec.unpack(frames[1]))
        return answered

    t0 = timer()
    while done < n:
        sent: list[tuple[Side, list[Any]]] = []
        for _ in range(k):
            rid += 1
            meta = codec.pack({"id": rid, "model": "m", "inputs": inputs, "timeout_ms": 10_000})
            sent += edge(on_client, clock(), b"c", [request_header, meta, data])
        done += collect(sent + edge(on_tick, clock()))
        while pending:
            batch = pending.pop()
            count = len(batch["requests"])
            result = {
                "batch": batch["batch"],
                "rho": 0.3,
                "compute_ms": 0.05,
                "frames": [3] * count,
            }
            frames = encode(Command.RESULT, result, reply * count)
            now = clock()
            done += collect(edge(on_worker, now, b"w", frames) + edge(on_tick, now))
    # The stats as a reader gets them, through the edge too: what a revision counts into
    # them only when they are read (the parts' notes) is counted with the rest.
    stats = edge(lambda: core.stats)
    elapsed = timer() - t0
    sizes = stats.batch_sizes["m"]
    mean = sum(s * c for s, c in sizes.items()) / sum(sizes.values())
    return 1e6 * elapsed / done, mean


def core_main(args: argparse.Namespace) -> int:
    if args.profile:
        policy, k = args.profile.split(":")
        profiler = cProfile.Profile()
        profiler.runcall(core_run, int(k), policy, 10_000)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return 0
    rows = []
    timer = time.process_time if args.cpu else time.perf_counter
    if not args.json:
        what = "CPU" if args.cpu else "wall"
        print(f"BrokerCore alone, deferred mode: {what} us per request (mean batch size)")
    for policy in ("carpool", "fixed"):
        cells = []
        for k in (1, 4, 8):
            us, mean = core_run(k, policy, timer=timer)
            rows.append({"policy": policy, "burst": k, "us_per_request": us, "mean_batch": mean})
            cells.append(f"burst {k}: {us:6.1f} us ({mean:.1f})")
        if not args.json:
            print(f"{policy:8s} " + "   ".join(cells))
    if args.json:  # one line, for bench/compare_revs.py
        print(json.dumps({"mode": "core", "rows": rows}))
    return 0


def embedded_run(n: int, use_client: bool, chunk: int = 500, burst: int = 1) -> list[float]:
    """us per request through an embedded broker stepped in this process, per chunk of
    ``chunk`` requests (the fastest chunk is the floor: the least disturbed), sent
    ``burst`` at a time (all answered before the next burst)."""
    from carpool.broker.server import BrokerServer
    from carpool.worker.config import ModelConfig, WorkerConfig

    model = ModelConfig.synthetic("synthetic", 0, 0, 32)
    worker = _worker_server(WorkerConfig(name="embedded", models=(model,)), embedded=True)
    config = BrokerConfig(frontend="inproc://hot-front", backend="inproc://hot-back")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    chunks: list[float] = []
    x = tensor((1, 16))
    with worker, BrokerServer(config, context=context, embedded=[worker]) as broker:
        if use_client:
            client = Client(config.frontend, context=context)
            for _ in range(n // chunk):
                t0 = time.perf_counter()
                for _ in range(chunk // burst):
                    futures = [client.submit("synthetic", {"x": x}, 10.0) for _ in range(burst)]
                    while client.in_flight:
                        broker.step(0)
                        client.poll(0)
                    for future in futures:
                        future.result(0)
                chunks.append(1e6 * (time.perf_counter() - t0) / chunk)
            client.close()
        else:
            sock = dealer(config.frontend)
            frames = request_frames("synthetic", x)
            for _ in range(n // chunk):
                t0 = time.perf_counter()
                for _ in range(chunk // burst):
                    for _ in range(burst):
                        sock.send_multipart(frames, copy=False)
                    received = 0
                    while received < burst:
                        if not sock.poll(0):
                            broker.step(0)
                            continue
                        sock.recv_multipart(copy=False)
                        received += 1
                chunks.append(1e6 * (time.perf_counter() - t0) / chunk)
            sock.close()
    return chunks


def floor_main(
    run: Callable[[int], list[float]], what: str, unit: str, args: argparse.Namespace
) -> int:
    """Warm ``run`` up, then cProfile it or print its floor and median per ``unit``
    (``--json``: as one JSON object)."""
    quiet_logs()
    run(2000)  # warm-up
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(run, 10_000)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
        return 0
    chunks = run(20_000)
    floor, mid = min(chunks), sorted(chunks)[len(chunks) // 2]
    if args.json:  # one line, for bench/compare_revs.py
        print(json.dumps({"mode": args.mode, "unit": unit, "floor_us": floor, "median_us": mid}))
    else:
        print(f"{what}: floor {floor:.1f} us per {unit}, median {mid:.1f} (chunks of 500)")
    return 0


def embedded_main(args: argparse.Namespace) -> int:
    who = "Client" if args.client else "raw DEALER"
    return floor_main(
        lambda n: embedded_run(n, args.client, burst=args.burst),
        f"embedded broker stepped in-process, {who}, bursts of {args.burst}",
        "request",
        args,
    )


_RUNS = itertools.count()


def worker_run(n: int, chunk: int = 500, burst: int = 1) -> list[float]:
    """us per BATCH of ``burst`` requests through a WorkerServer stepped in this process,
    per chunk of ``chunk`` batches (the fastest chunk is the floor)."""
    from carpool.worker.config import ModelConfig
    from carpool.worker.server import WorkerServer

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"inproc://hot-worker-{next(_RUNS)}"  # an inproc name is freed late
    router.bind(endpoint)
    model = ModelConfig.synthetic("synthetic", 0, 0, 32)
    worker = WorkerServer(
        endpoint, {model.name: _engine_factory(model)}, name="hot", context=context
    )
    chunks: list[float] = []
    payload = tensor((1, 16)).tobytes()
    items = [{"id": i + 1, "n": 1, "simple": False, "queue_ms": 0.123} for i in range(burst)]
    inputs = [{"name": "x", "dtype": "float32", "shape": [-1, 16]}]
    meta = {"batch": 1, "model": "synthetic", "inputs": inputs, "requests": items}
    batch = encode(Command.BATCH, meta, [payload] * burst)
    with worker:
        while not router.poll(0):
            worker.step(0)
        wid = router.recv_multipart()[0]  # READY
        for _ in range(n // chunk):
            t0 = time.perf_counter()
            for _ in range(chunk):
                router.send(wid, zmq.SNDMORE)
                router.send_multipart(batch, copy=False)
                while True:  # until the RESULT (a heartbeat may come first)
                    worker.step(0)
                    if not router.poll(0):
                        continue
                    frames = router.recv_multipart(copy=False)
                    if frames[1].bytes == header(Command.RESULT):
                        break
            chunks.append(1e6 * (time.perf_counter() - t0) / chunk)
    router.close()
    return chunks


def worker_main(args: argparse.Namespace) -> int:
    return floor_main(
        lambda n: worker_run(n, burst=args.burst),
        f"worker stepped in-process under a ROUTER, batches of {args.burst}",
        "batch",
        args,
    )


def client_run(n: int, chunk: int = 500, burst: int = 1) -> list[float]:
    """us per request through a Client under a ROUTER in this process, per chunk of
    ``chunk`` requests sent ``burst`` at a time (the fastest chunk is the floor)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"inproc://hot-client-{next(_RUNS)}"
    router.bind(endpoint)
    x = tensor((1, 16))
    reply_header = header(Command.REPLY)
    outputs = [{"name": "y", "dtype": "float32", "shape": [1, 16]}]
    chunks: list[float] = []
    with Client(endpoint, context=context) as client:
        for _ in range(n // chunk):
            t0 = time.perf_counter()
            for _ in range(chunk // burst):
                futures = [client.submit("synthetic", {"x": x}, 10.0) for _ in range(burst)]
                for _ in range(burst):
                    frames = router.recv_multipart(copy=False)
                    meta = codec.unpack(frames[2].buffer)
                    wire = {
                        "id": meta["id"],
                        "outputs": outputs,
                        "batch_size": burst,
                        "queue_ms": 0.125,
                        "compute_ms": 0.01,
                    }
                    reply: list[zmq.Frame | bytes] = [
                        frames[0],
                        reply_header,
                        codec.pack(wire),
                        frames[3],
                    ]
                    router.send_multipart(reply, copy=False)
                while client.in_flight:
                    client.poll(0)
                for future in futures:
                    future.result(0)
            chunks.append(1e6 * (time.perf_counter() - t0) / chunk)
    router.close()
    return chunks


def client_main(args: argparse.Namespace) -> int:
    return floor_main(
        lambda n: client_run(n, burst=args.burst),
        f"Client in-process under a ROUTER, bursts of {args.burst}",
        "request",
        args,
    )


def _pipe_round_trips(n: int) -> list[float]:
    from_parent, to_child = os.pipe()
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the echo: read 64 bytes, write them back
        try:
            for _ in range(n):
                os.write(to_parent, os.read(from_parent, 64))
        finally:
            os._exit(0)
    out = []
    message = bytes(64)
    for _ in range(n):
        t0 = time.perf_counter()
        os.write(to_child, message)
        os.read(from_child, 64)
        out.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    for fd in (to_child, from_parent, from_child, to_parent):
        os.close(fd)
    return out


def _zmq_round_trips(n: int, endpoint: str) -> list[float]:
    pid = os.fork()
    if pid == 0:  # the echo: a ROUTER sending each message back
        try:
            ctx = zmq.Context()
            router = ctx.socket(zmq.ROUTER)
            router.bind(endpoint)
            for _ in range(n + 1):
                router.send_multipart(router.recv_multipart())
            router.close(linger=1000)
            ctx.term()
        finally:
            os._exit(0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hello")  # connected both ways before timing
    sock.recv()
    out = []
    message = bytes(64)
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(message)
        sock.recv()
        out.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    sock.close(linger=0)
    ctx.term()
    return out


def _link_round_trips(n: int) -> list[float]:
    import select
    import socket

    from carpool.common.link import Link

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the echo: each message back as it came
        try:
            ours.close()
            link = Link(theirs)
            done = 0
            while done < n:
                select.select([link], [], [])
                for message in link.receive():
                    link.send(message)
                    done += 1
        finally:
            os._exit(0)
    theirs.close()
    link = Link(ours)
    out = []
    ping = [bytes(64)]
    for _ in range(n):
        t0 = time.perf_counter()
        link.send(ping)
        while not link.receive():
            select.select([link], [], [])
        out.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    link.close()
    return out


def hops_main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="carpool-hops-") as tmp:
        for rnd in range(3):
            pipe = sorted(_pipe_round_trips(5000)[500:])
            link = sorted(_link_round_trips(5000)[500:])
            ipc = sorted(_zmq_round_trips(5000, f"ipc://{tmp}/hops-{rnd}")[500:])
            print(
                f"round {rnd + 1}: p50 round trip, pipe {1e6 * pipe[len(pipe) // 2]:.0f} us, "
                f"carpool Link {1e6 * link[len(link) // 2]:.0f} us, "
                f"pyzmq ipc {1e6 * ipc[len(ipc) // 2]:.0f} us"
            )
    return 0


def wake_main(args: argparse.Namespace) -> int:
    import struct

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("needs two CPUs")
        return 1
    to_child, from_parent = os.pipe()[::-1]
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # blocks on the pipe; answers how long it took to run once written
        try:
            os.close(to_child)  # else the read below never sees the end
            os.close(from_child)
            os.sched_setaffinity(0, {cpus[1]})
            while data := os.read(from_parent, 8):
                woke = time.perf_counter()
                os.write(to_parent, struct.pack("d", woke - struct.unpack("d", data)[0]))
        finally:
            os._exit(0)
    os.sched_setaffinity(0, {cpus[0]})
    print("idle us  wake p50 us  p90 us")
    for idle_us in (10, 50, 100, 150, 200, 300, 500, 1000, 2000):
        lat = []
        for _ in range(400):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < idle_us / 1e6:
                pass  # spin: this CPU stays busy while the child's idles
            os.write(to_child, struct.pack("d", time.perf_counter()))
            lat.append(1e6 * struct.unpack("d", os.read(from_child, 8))[0])
        lat.sort()
        print(f"{idle_us:7d}  {lat[len(lat) // 2]:11.1f}  {lat[int(len(lat) * 0.9)]:6.1f}")
    os.close(to_child)
    os.waitpid(pid, 0)
    for fd in (from_parent, from_child, to_parent):
        os.close(fd)
    return 0


def summarize(path: Path, top: int = 25) -> None:
    """Self and inclusive shares of a py-spy raw (collapsed stacks) file."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        names = [f.split(" (")[0] for f in stack.split(";")]
        own[names[-1]] += n
        for name in set(names):
            incl[name] += n
    print(f"{path.name}: {total} samples")
    for title, counter in (("self", own), ("inclusive", incl)):
        print(f"  -- {title}")
        for name, n in counter.most_common(top):
            print(f"  {100 * n / total:5.1f}% {name}")


def spy_main(args: argparse.Namespace) -> int:
    quiet_logs()
    x = tensor((1, 16))
    frames = request_frames("synthetic", x)
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if args.py_spy and py_spy is None:
        print("py-spy not found: .venv/bin/pip install py-spy")
        return 2
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    with ProcessGroup("ipc") as group:
        frontend, backend = group.endpoint("front"), group.endpoint("back")
        cap = ["--max-batch", str(args.max_batch)] if args.max_batch else []
        if args.embedded:  # the null-engine worker inside the broker's process
            broker = group.broker(frontend, backend, "--embed-synthetic", "0", "0", *cap)
            procs = {"broker": broker}
        else:
            broker = group.broker(frontend, backend, *cap)
            procs = {"broker": broker, "worker": group.worker(backend, "--synthetic", "0", "0")}
        wait_workers(frontend, 1, group)
        sock = dealer(frontend)
        raw_loop(sock, frames, args.in_flight, 3000, 2.0)  # warm-up
        meters = {name: CpuMeter(proc.pid) for name, proc in procs.items()}
        spies = []
        if args.py_spy and py_spy is not None:  # None was refused above
            for name, proc in procs.items():
                cmd = [py_spy, "record", "-r", "200", "-d", str(int(args.seconds)), "-f", "raw"]
                cmd += ["-o", str(out_dir / f"hot_path_{name}.txt"), "-p", str(proc.pid)]
                spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            time.sleep(1.0)  # py-spy attaches
        before = {k: (m.read(), m.read_main()) for k, m in meters.items()}
        if args.client:  # the carpool Client instead of pre-encoded frames
            with Client(frontend) as client:
                loop = FleetLoop(client, "synthetic", {"x": x}, args.in_flight)
                loop.fill(2.0)
                result = loop.run(10**7, args.seconds)
                loop.drain()
        else:
            result = raw_loop(
                sock, frames, args.in_flight, 10**7, args.seconds, expect_command=Command.REPLY
            )
        after = {k: (m.read(), m.read_main()) for k, m in meters.items()}
        for spy in spies:
            spy.wait()
        print(f"{result.rate:,.0f} req/s, {args.in_flight} in flight, {result.errors} errors")
        for name in meters:
            (u0, s0), (mu0, ms0) = before[name]
            (u1, s1), (mu1, ms1) = after[name]
            whole = 1e6 * (u1 - u0 + s1 - s0) / max(1, result.completed)
            main = 1e6 * (mu1 - mu0 + ms1 - ms0) / max(1, result.completed)
            print(f"{name}: {whole:.0f} us CPU per request ({main:.0f} us in its main thread)")
        with Client(frontend) as client:
            print("batch sizes:", json.dumps(client.stats()["batch_sizes"]))
        sock.close()
    if args.py_spy:
        for name in procs:
            summarize(out_dir / f"hot_path_{name}.txt")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("core", help="BrokerCore alone, in this process")
    c.add_argument("--profile", metavar="POLICY:K", help="cProfile one setting, e.g. carpool:1")
    c.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    c.add_argument("--cpu", action="store_true", help="this process's CPU time, not wall time")
    e = sub.add_parser("embedded", help="an embedded broker stepped in this process")
    e.add_argument("--profile", action="store_true", help="cProfile it")
    e.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    e.add_argument("--client", action="store_true", help="the Client, not a raw DEALER")
    e.add_argument("--burst", type=int, default=1, help="requests sent at a time (1)")
    w = sub.add_parser("worker", help="a worker stepped in this process under a ROUTER")
    w.add_argument("--profile", action="store_true", help="cProfile it")
    w.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    w.add_argument("--burst", type=int, default=1, help="requests per batch (1)")
    cl = sub.add_parser("client", help="the Client in this process under a ROUTER")
    cl.add_argument("--profile", action="store_true", help="cProfile it")
    cl.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    cl.add_argument("--burst", type=int, default=1, help="requests sent at a time (1)")
    sub.add_parser("hops", help="round trip over a pipe, a Link and pyzmq ipc")
    sub.add_parser("wake", help="the price of waking a process on an idle CPU")
    s = sub.add_parser("spy", help="broker and worker processes under a closed loop")
    s.add_argument("--in-flight", type=int, default=8)
    s.add_argument("--seconds", type=float, default=6.0)
    s.add_argument("--py-spy", action="store_true", help="record both with py-spy")
    s.add_argument("--embedded", action="store_true", help="the worker inside the broker")
    s.add_argument("--client", action="store_true", help="drive it with the carpool Client")
    s.add_argument("--max-batch", type=int, default=0, help="the broker's B_max (0: its default)")
    args = p.parse_args(argv)
    mains = {
        "core": core_main,
        "embedded": embedded_main,
        "worker": worker_main,
        "client": client_main,
        "hops": hops_main,
        "wake": wake_main,
        "spy": spy_main,
    }
    return mains[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
