"""openloop.py: the peers harness's load generator, an open-loop Poisson source in its own process.

A raw ZeroMQ DEALER connects to ENDPOINT and sends carpool REQUESTs ([1,3,64,64]
float32, ``--timeout-ms`` each) at the times of a seeded Poisson schedule: ``--warmup-s``
seconds that are not counted, then ``--seconds`` that are. Every request's frames are
encoded before the first send (one meta per request id, one shared payload), and each is
sent at its scheduled time whatever the replies do (open loop); replies are read between
sends. A latency runs from the request's scheduled send, not its actual one, so a
generator that falls behind cannot hide the wait (no coordinated omission); how late it
sent is reported on its own (``lag_ms``).

A REPLY that comes later than the request's timeout after its scheduled send counts as
``LATE``, not answered: its client no longer waits for it (carpool answers such a request
``DEADLINE_EXCEEDED``; a server without deadlines runs it anyway). After the last send
it waits for each counted request until its scheduled time plus the timeout plus
``--grace-ms``; what has no answer by then counts as ``lost``. Its own CPU
(``time.process_time``) is reported per counted request (from the first counted send to
its last reply) and in cores (while it sends): a cell where it used more than half a
core is ``void`` (the generator, not the server, may be what was measured). One JSON
object goes to stdout.

Run:  .venv/bin/python bench/peers/openloop.py ENDPOINT --rate 1000 [--seconds 5]
          [--warmup-s 1] [--seed 1] [--timeout-ms 1000] [--model mlp]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import request_frames, tensor

from carpool.common.errors import ErrorCode
from carpool.common.protocol import Command, decode_meta, pack, parse_header
from peers import mlp

#: The share of one core past which the generator's own CPU voids a cell.
VOID_CORES = 0.5


def schedule(rate: float, seconds: float, warmup_s: float, seed: int) -> np.ndarray[Any, Any]:
    """Send times (seconds from the start of the counted window; warm-up ones negative)
    of a Poisson process at ``rate`` per second over ``warmup_s + seconds``."""
    rng = np.random.default_rng(seed)
    span = warmup_s + seconds
    gaps = rng.exponential(1.0 / rate, int(rate * span * 1.2) + 100)
    times = np.cumsum(gaps) - warmup_s
    return times[times < seconds]


def encoded(count: int, model: str, timeout_ms: int) -> list[list[Any]]:
    """The frames of requests 0..count-1: one meta per id, one payload shared by all."""
    head, meta_frame, payload = request_frames(
        model, tensor((1, *mlp.ITEM_SHAPE)), timeout_ms / 1000
    )
    meta = decode_meta(meta_frame)
    meta.pop("client", None)  # no nonce: a request is never matched as a copy
    frame = zmq.Frame(bytes(payload))
    out = []
    for i in range(count):
        meta["id"] = i
        out.append([head, pack(meta), frame])
    return out


def run(
    endpoint: str,
    times: np.ndarray[Any, Any],
    frames: list[list[Any]],
    timeout_ms: int,
    grace_ms: float,
) -> dict[str, Any]:
    """Send on schedule, read replies, and summarise the counted requests."""
    n = len(times)
    done = np.full(n, math.nan)
    sent = np.full(n, math.nan)
    outcome: list[str] = ["lost"] * n
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    reply, error = Command.REPLY, Command.ERROR

    def drain(t0: float) -> None:
        while True:
            try:
                msg = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.perf_counter() - t0
            command = parse_header(msg[0])
            meta = decode_meta(msg[1])
            rid = meta.get("id")
            if not isinstance(rid, int) or not 0 <= rid < n or not math.isnan(done[rid]):
                continue
            done[rid] = now
            if command is reply:
                # A reply after the request's timeout is one its client no longer waits for.
                outcome[rid] = "ok" if now - times[rid] <= timeout_s else "LATE"
            elif command is error:
                try:
                    outcome[rid] = ErrorCode(meta["code"]).name
                except (KeyError, TypeError, ValueError):
                    outcome[rid] = "INTERNAL"

    first = int(np.searchsorted(times, 0.0))  # the first counted request
    timeout_s = timeout_ms / 1000
    wait_s = timeout_s + grace_ms / 1000
    t0 = time.perf_counter() - float(times[0]) + 0.05 if n else time.perf_counter()
    cpu0 = wall0 = math.nan
    try:
        for i in range(n):
            at = float(times[i])
            if i == first:
                cpu0, wall0 = time.process_time(), time.perf_counter()
            while True:
                rem = at - (time.perf_counter() - t0)
                if rem <= 0:
                    break
                if rem >= 0.001:
                    if sock.poll(int(rem * 1000)):
                        drain(t0)
                else:
                    drain(t0)
                    time.sleep(rem)
            sock.send_multipart(frames[i], copy=False)
            sent[i] = time.perf_counter() - t0
        send_cores = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        until = float(times[-1]) + wait_s if n else 0.0
        while np.isnan(done[first:]).any():
            rem = until - (time.perf_counter() - t0)
            if rem <= 0:
                break
            if sock.poll(max(1, int(rem * 1000))):
                drain(t0)
        cpu_s = time.process_time() - cpu0
    finally:
        sock.close()
        ctx.term()
    return summary(times[first:], sent[first:], done[first:], outcome[first:], cpu_s, send_cores)


def summary(
    times: np.ndarray[Any, Any],
    sent: np.ndarray[Any, Any],
    done: np.ndarray[Any, Any],
    outcome: Sequence[str],
    cpu_s: float,
    cores: float,
) -> dict[str, Any]:
    """The counted requests' figures (milliseconds, per second, CPU): ``cpu_s`` is the
    generator's CPU from the first counted send to its last reply, ``cores`` its CPU
    over wall time while it sent the counted requests."""
    counts = Counter(outcome)
    ok = np.array([o == "ok" for o in outcome], dtype=bool)
    lat_ms = (done[ok] - times[ok]) * 1000
    lag_ms = (sent - times) * 1000
    count = len(times)
    window_s = float(times[-1]) if count else 0.0
    seconds = max(window_s, 1e-9)

    def pct(values: np.ndarray[Any, Any], q: float) -> float | None:
        return float(np.percentile(values, q)) if len(values) else None

    answered = int(counts.pop("ok", 0))
    return {
        "sent": count,
        "ok": answered,
        "errors": dict(counts),
        "ok_share": answered / count if count else 0.0,
        "served_per_s": int(ok.sum()) / seconds,
        "offered_per_s": count / seconds,
        "p50_ms": pct(lat_ms, 50),
        "p99_ms": pct(lat_ms, 99),
        "max_ms": pct(lat_ms, 100),
        "lag_p50_ms": pct(lag_ms, 50),
        "lag_p99_ms": pct(lag_ms, 99),
        "cpu_us_per_request": cpu_s / count * 1e6 if count else None,
        "cores": cores,
        "void": cores > VOID_CORES,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="an open-loop Poisson load on a carpool endpoint")
    p.add_argument("endpoint")
    p.add_argument("--rate", type=float, required=True, help="requests per second offered")
    p.add_argument("--seconds", type=float, default=5.0, help="the counted window")
    p.add_argument("--warmup-s", type=float, default=1.0, help="uncounted load before it")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout-ms", type=int, default=1000, help="each request's timeout_ms")
    p.add_argument("--grace-ms", type=float, default=500.0, help="wait past a timeout")
    p.add_argument("--model", default="mlp")
    args = p.parse_args(argv)
    times = schedule(args.rate, args.seconds, args.warmup_s, args.seed)
    frames = encoded(len(times), args.model, args.timeout_ms)
    result = run(args.endpoint, times, frames, args.timeout_ms, args.grace_ms)
    result.update(rate=args.rate, seconds=args.seconds, seed=args.seed)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
