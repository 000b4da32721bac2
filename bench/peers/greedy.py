"""greedy.py: the floor, a one-process ZeroMQ server that batches whatever has arrived.

A ROUTER bound to ENDPOINT speaks carpool's client protocol for framed REQUESTs
(docs/protocol.md §6.1, §6.2): it reads each request's header and meta with
carpool.common.protocol's decoders, runs what has arrived, up to ``--max-batch``
requests, as one ONNX Runtime batch on one thread, and answers each with a REPLY built by
carpool's encoders. It never waits for a batch to fill: no timer, no policy, no second
process, no hop. Deadlines are not checked (every request is run and answered).

STATS (§6.4) is answered with a map shaped like carpool's: ``requests``, ``replies``,
``errors`` (code name -> count) and ``batch_sizes`` (model -> requests per batch, as a
decimal string -> batches), so the harness reads both the same way. Anything else gets
ERROR ``INVALID_ARGUMENT``. It exits on SIGTERM or SIGINT, and when its parent goes.

Run:  .venv/bin/python bench/peers/greedy.py ENDPOINT --model FILE.onnx [--name mlp]
          [--max-batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    Command,
    ErrorReply,
    decode_meta,
    encode_error,
    header,
    pack,
    parse_header,
    reply_frames,
    reply_wire,
    tensor_wire,
)
from peers import mlp

_STATS = header(Command.STATS)


class Greedy:
    """The server's state: the socket, the engine, and its counters."""

    def __init__(self, sock: zmq.Socket[bytes], model: str, engine: Any, max_batch: int) -> None:
        self.sock = sock
        self.model = model
        self.engine = engine
        self.max_batch = max_batch
        self.requests = 0
        self.replies = 0
        self.errors: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()

    def stats(self) -> dict[str, Any]:
        """The STATS map (carpool's field names, this server's counters)."""
        return {
            "requests": self.requests,
            "replies": self.replies,
            "errors": dict(self.errors),
            "batch_sizes": {self.model: {str(k): v for k, v in self.batch_sizes.items()}},
        }

    def error(self, peer: bytes, request_id: int | None, code: ErrorCode, message: str) -> None:
        self.errors[code.name] += 1
        self.sock.send_multipart([peer, *encode_error(ErrorReply(request_id, code, message))])

    def take(self, frames: Sequence[zmq.Frame]) -> tuple[bytes, int, np.ndarray[Any, Any]] | None:
        """A request to run (peer, id, input), or None once it is answered here."""
        self.requests += 1
        peer = frames[0].bytes
        body = frames[1:]
        meta: dict[str, Any] = {}
        try:
            command = parse_header(body[0].buffer)
            if len(body) > 1:
                meta = decode_meta(body[1].buffer)
            if command is Command.STATS:
                self.sock.send_multipart(
                    [peer, _STATS, pack({**self.stats(), "id": meta.get("id")})]
                )
                return None
            if command is not Command.REQUEST or len(body) != 3:
                raise ProtocolError("a REQUEST with one input, or STATS")
            (spec,) = meta["inputs"]
            if meta["model"] != self.model or spec["dtype"] != "float32":
                raise ProtocolError(f"model {self.model!r} takes float32")
            shape = [int(d) for d in spec["shape"]]
            x = np.frombuffer(body[2].buffer, np.float32).reshape(shape)
            return peer, int(meta["id"]), x
        except (ProtocolError, KeyError, TypeError, ValueError, IndexError) as exc:
            rid = meta.get("id") if isinstance(meta.get("id"), int) else None
            self.error(peer, rid, ErrorCode.INVALID_ARGUMENT, str(exc))
            return None

    def run(self, batch: list[tuple[bytes, int, np.ndarray[Any, Any]]]) -> None:
        """One engine call for ``batch``, then a REPLY to each request."""
        x = batch[0][2] if len(batch) == 1 else np.concatenate([b[2] for b in batch])
        t0 = time.perf_counter()
        (y,) = self.engine.run(None, {mlp.INPUT_NAME: x})
        compute_ms = (time.perf_counter() - t0) * 1000
        samples = int(x.shape[0])
        self.batch_sizes[len(batch)] += 1
        row = 0
        for peer, rid, xi in batch:
            n = int(xi.shape[0])
            out = np.ascontiguousarray(y[row : row + n])
            row += n
            wire = reply_wire(
                rid,
                [tensor_wire(mlp.OUTPUT_NAME, "float32", list(out.shape))],
                samples,
                0,
                compute_ms,
            )
            self.sock.send_multipart([peer, *reply_frames(wire, [out])], copy=False)
            self.replies += 1

    def loop(self, stop: list[bool]) -> None:
        """Wait for requests; run what has arrived (up to max_batch); repeat until stopped."""
        batch: list[tuple[bytes, int, np.ndarray[Any, Any]]] = []
        while not stop:
            if not self.sock.poll(100):
                continue
            while len(batch) < self.max_batch:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                item = self.take(frames)
                if item is not None:
                    batch.append(item)
            if batch:
                self.run(batch)
                batch = []


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the floor: a one-process greedy ONNX server")
    p.add_argument("endpoint", help="where to bind (tcp://127.0.0.1:PORT)")
    p.add_argument("--model", required=True, help="the ONNX file")
    p.add_argument("--name", default="mlp", help="the model's name in requests")
    p.add_argument("--max-batch", type=int, default=16, help="requests per batch at most")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    args = p.parse_args(argv)
    stop: list[bool] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.append(True)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    engine = mlp.runner(Path(args.model), args.threads)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.bind(args.endpoint)
    try:
        Greedy(sock, args.name, engine, args.max_batch).loop(stop)
    finally:
        sock.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
