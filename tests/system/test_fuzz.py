"""A live broker process fuzzed on both sockets, with valid traffic interleaved.

The broker (``carpool broker --embed-synthetic``) runs as a subprocess. Hypothesis, with a
fixed number of examples and a derandomized search, makes what it receives:

* on the client socket, from several DEALERs and a REQ: random multipart frames, headers
  with random msgpack metas, requests whose fields have random types and values, in the
  framed and the simple form; and mutations of valid requests (bit flips, truncations,
  frames added, dropped or repeated, other dtypes, shapes, ids, timeouts, huge numbers,
  payloads of the wrong size);
* on the worker socket, from raw DEALERs that pretend to be workers (on a fresh socket
  now and then): random READY, RESULT, FAILED, HEARTBEAT and DISCONNECT metas, and
  garbage; valid READYs for models of their own, whose BATCHes (asked for by the
  DEALERs) they answer with RESULTs mutated as above; RESULTs and FAILEDs for batches
  they were never sent (among them the ids of batches the embedded worker holds).

Every example also sends a valid request through a carpool Client, whose answer is
checked against the synthetic engine's known output. The fuzzing workers never announce
the model those valid requests use with its spec: a peer allowed on the worker socket
that serves a model can answer its batches as it likes, and keeping such peers out is
authentication's part, not the parser's.

Asserted: the broker never exits, every valid request is answered with the right
output, the broker still serves once the fuzzing stops, and it exits with status 0 on
SIGTERM.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.client import Client, ReplyFuture
from carpool.common.clock import MonotonicClock
from carpool.worker.engines.synthetic import synthetic_output

CARPOOL = [sys.executable, "-m", "carpool", "--log-level", "ERROR"]
MODEL = "synthetic"
ITEM = 16
STOP_TIMEOUT_S = 10.0
#: How long the REQ socket waits for an answer before it is replaced.
REQ_WAIT_MS = 200
#: Examples per phase: each sends one to five fuzzed messages (the mutation phase:
#: 1 + VARIANTS) and one valid request.
EXAMPLES = 150
VARIANTS = 4
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

COMMANDS = [0x01, 0x02, 0x03, 0x04, 0x10, 0x11, 0x12, 0x13, 0x14, 0x15]
DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"]
DTYPES += ["float16", "float32", "float64", "complex64", "<f4", "object", ""]
#: Model names of fuzzed requests and of the fuzzing workers' READYs: never ``MODEL``
#: from a worker (module docstring).
WORKER_MODELS = ["fz", "fz2", "fz3"]

# --------------------------------------------------------------------------- strategies

huge_ints = st.sampled_from([-(2**63), -1, 0, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1])
ints = st.one_of(st.integers(-(2**63), 2**64 - 1), huge_ints, st.integers(-3, 40))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=24),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
names = st.one_of(st.sampled_from(["x", "y", "a", ""]), st.text(max_size=6))
shapes = st.one_of(
    st.lists(st.integers(-2, 40), min_size=0, max_size=9),
    st.lists(ints, min_size=1, max_size=3),
    st.just([1, ITEM]),
    values,
)
descriptors = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(names, values),
        "dtype": st.one_of(st.sampled_from(DTYPES), values),
        "shape": shapes,
        "shm": st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {"region": st.text(max_size=20), "offset": ints, "key": st.text(max_size=40)}
            ),
            values,
        ),
        "data": st.binary(max_size=200),
    },
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``strategy``, or any value at all in its place."""
    return st.one_of(strategy, values)


request_metas = st.fixed_dictionaries(
    {},
    optional={
        "id": maybe(ints),
        "model": maybe(st.sampled_from([MODEL, *WORKER_MODELS, ""])),
        "inputs": maybe(st.lists(descriptors, max_size=3)),
        "timeout_ms": maybe(ints),
        "priority": maybe(st.integers(-1, 2)),
        "shm_outputs": maybe(st.booleans()),
        "v": maybe(st.integers(0, 2)),
        "extra": values,
    },
)
headers = st.one_of(
    st.builds(
        lambda version, command: b"CP" + bytes([version, command]),
        st.sampled_from([1, 1, 1, 0, 2, 255]),
        st.one_of(st.sampled_from(COMMANDS), st.integers(0, 255)),
    ),
    st.binary(max_size=6),
)
metas = st.one_of(
    st.builds(msgpack.packb, request_metas),
    st.builds(msgpack.packb, values),
    st.binary(max_size=64),
    st.just(b"\xc1"),  # never used in msgpack
    st.just(b"\xc7\x01\x05x"),  # an extension type
)
payloads = st.one_of(
    st.binary(max_size=256),
    st.integers(0, 70).map(lambda n: bytes(4 * n)),
    st.just(bytes(4 * ITEM)),
)
framed = st.builds(
    lambda hdr, meta, rest: [hdr, meta, *rest], headers, metas, st.lists(payloads, max_size=4)
)
simple = st.builds(msgpack.packb, request_metas).map(lambda frame: [frame])
raw_frames = st.lists(st.binary(max_size=64), min_size=1, max_size=6)
client_messages = st.one_of(framed, framed, simple, raw_frames, st.just([b""]))

# Mutations of a valid framed request: (kind, where, value).
mutations = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 7)),
        st.tuples(st.just("truncate"), st.integers(0, 3), st.integers(0, 80)),
        st.tuples(st.just("extra"), st.integers(0, 4), payloads),
        st.tuples(st.just("drop"), st.integers(0, 3), st.none()),
        st.tuples(st.just("repeat"), st.integers(0, 3), st.none()),
        st.tuples(st.just("payload"), st.integers(0, 4 * ITEM * 4), st.none()),
        st.tuples(
            st.just("field"),
            st.sampled_from(["id", "model", "timeout_ms", "priority", "inputs", "v"]),
            values,
        ),
        st.tuples(st.just("dtype"), st.sampled_from(DTYPES), st.none()),
        st.tuples(st.just("shape"), shapes, st.none()),
        st.tuples(st.just("samples"), st.one_of(ints, st.integers(0, 40)), st.none()),
        st.tuples(st.just("delimiter"), st.none(), st.none()),
    ),
    min_size=1,
    max_size=3,
)

specs = st.fixed_dictionaries(
    {},
    optional={
        "name": maybe(st.sampled_from(WORKER_MODELS)),
        "inputs": maybe(st.lists(descriptors, max_size=2)),
        "outputs": maybe(st.lists(descriptors, max_size=2)),
        "max_batch": maybe(st.integers(-1, 40)),
        "preferred_batch": maybe(st.lists(st.integers(-1, 40), max_size=3)),
    },
)
worker_metas = {
    0x10: st.fixed_dictionaries(
        {},
        optional={
            "name": maybe(st.text(max_size=8)),
            "slots": maybe(st.integers(-1, 2000)),
            "heartbeat_ms": maybe(st.sampled_from([5, 10, 50, 1000, 600_001])),
            "models": maybe(st.lists(specs, max_size=3)),
        },
    ),
    0x11: st.fixed_dictionaries({}, optional={"rho": maybe(st.floats())}),
    0x13: st.fixed_dictionaries(
        {},
        optional={
            "batch": maybe(st.integers(0, 300)),
            "frames": maybe(st.lists(st.integers(-1, 4), max_size=4)),
            "rho": maybe(st.floats()),
            "compute_ms": maybe(st.floats()),
        },
    ),
    0x14: st.fixed_dictionaries(
        {},
        optional={
            "batch": maybe(st.integers(0, 300)),
            "code": maybe(st.integers(-1, 300)),
            "message": maybe(st.text(max_size=10)),
            "rho": maybe(st.floats()),
        },
    ),
    0x15: st.fixed_dictionaries({}, optional={"reason": maybe(st.text(max_size=10))}),
}
worker_framed = st.sampled_from(sorted(worker_metas)).flatmap(
    lambda command: st.builds(
        lambda meta, rest, version: [
            b"CP" + bytes([version, command]),
            msgpack.packb(meta),
            *rest,
        ],
        worker_metas[command],
        st.lists(payloads, max_size=4),
        st.sampled_from([1, 1, 1, 1, 2]),
    )
)
worker_messages = st.one_of(
    worker_framed,
    worker_framed,
    worker_framed,
    framed,
    raw_frames,
)


def _not_the_model(frames: list[bytes]) -> bool:
    """A message that does not name ``MODEL`` (module docstring)."""
    return MODEL.encode() not in b"".join(frames)


frame_steps = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 7)),
        st.tuples(st.just("truncate"), st.integers(0, 5), st.integers(0, 80)),
        st.tuples(st.just("extra"), st.integers(0, 6), payloads),
        st.tuples(st.just("drop"), st.integers(0, 5), st.none()),
        st.tuples(st.just("repeat"), st.integers(0, 5), st.none()),
    ),
    max_size=2,
)
#: What a fuzzing worker does in one step of the worker phase.
worker_actions = st.one_of(
    st.tuples(st.just("fuzz"), worker_messages.filter(_not_the_model)),
    st.tuples(
        st.just("ready"),
        st.tuples(st.sampled_from(WORKER_MODELS), st.integers(1, 4), st.sampled_from([10, 1000])),
    ),
    st.tuples(st.just("ask"), st.tuples(st.sampled_from(WORKER_MODELS), st.integers(1, 9))),
    st.tuples(st.just("answer"), frame_steps),
    st.tuples(
        st.just("forge"),
        st.tuples(st.sampled_from([0x13, 0x14]), st.integers(-2, 4), frame_steps),
    ),
)


# --------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    """The broker process, its fuzzing peers and the valid traffic with its answers."""

    broker: subprocess.Popen[bytes]
    log: Path
    frontend: str
    backend: str
    context: zmq.Context[zmq.Socket[bytes]]
    client: Client
    dealers: list[zmq.Socket[bytes]] = field(default_factory=list)
    req: zmq.Socket[bytes] | None = None
    workers: list[zmq.Socket[bytes]] = field(default_factory=list)
    valid: list[tuple[ReplyFuture, np.ndarray[Any, Any]]] = field(default_factory=list)
    batches: list[list[dict[str, Any]]] = field(default_factory=list)
    sent: int = 0
    seed: int = 0

    def socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        sock.connect(endpoint)
        return sock

    def send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.Again):  # a full pipe: the broker reads more slowly
            sock.send_multipart(frames, copy=False)
        self.sent += 1

    def send_req(self, frames: list[bytes]) -> None:
        """Send from the REQ socket and wait a little for its answer; a REQ whose answer
        does not come (a request that a fuzzing worker holds) is replaced, as a REQ
        client does."""
        assert self.req is not None
        self.send(self.req, frames)
        if self.req.poll(REQ_WAIT_MS):
            self.req.recv_multipart()
        else:
            self.req.close(linger=0)
            self.req = self.socket(zmq.REQ, self.frontend)

    def send_client(self, which: int, frames: list[bytes]) -> None:
        """Send from DEALER ``which``, or from the REQ socket past the DEALERs."""
        if which < len(self.dealers):
            self.send(self.dealers[which], frames)
        else:
            self.send_req(frames)

    def drain(self) -> None:
        """Read whatever the broker sent the fuzzing peers (so no pipe fills)."""
        for sock in self.dealers:
            while sock.poll(0):
                sock.recv_multipart()
        for index, sock in enumerate(self.workers):
            while sock.poll(0):
                frames = sock.recv_multipart()
                if frames[0] == b"CP\x01\x12":  # a BATCH, for "answer"
                    self.batches[index].append(msgpack.unpackb(frames[1]))

    def new_worker(self, index: int) -> None:
        """A fresh socket (a new registration) for worker ``index``."""
        self.workers[index].close(linger=0)
        self.workers[index] = self.socket(zmq.DEALER, self.backend)
        self.batches[index].clear()

    def last_batch_id(self) -> int:
        """The id of the broker's latest batch (ids are consecutive from 1)."""
        sizes = self.client.stats()["batch_sizes"]
        return sum(sum(counts.values()) for counts in sizes.values())

    def submit_valid(self) -> None:
        self.seed += 1
        rng = np.random.default_rng(self.seed)
        x = rng.standard_normal((int(rng.integers(1, 4)), ITEM)).astype(np.float32)
        self.valid.append((self.client.submit(MODEL, {"x": x}, timeout_s=30.0), x))
        self.client.poll(0)

    def check_valid(self) -> int:
        """Every valid request so far answered with the engine's output; how many."""
        for future, x in self.valid:
            assert self.broker.poll() is None, self.logs()
            np.testing.assert_array_equal(future.result(30.0)["y"], synthetic_output(x))
        count = len(self.valid)
        self.valid.clear()
        return count

    def logs(self) -> str:
        return f"broker exited with {self.broker.poll()}\n{self.log.read_text()}"


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    frontend, backend = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    log_path = tmp_path / "broker.log"
    with open(log_path, "wb") as log:
        broker = subprocess.Popen(
            [
                *CARPOOL, "broker", "--frontend", frontend, "--backend", backend,
                "--embed-synthetic", "1", "0.1", "--max-wait-ms", "1",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with Client(frontend, context=context, default_timeout_s=30.0) as client:
            rig = Rig(broker, log_path, frontend, backend, context, client)
            _until_serving(rig)
            rig.dealers = [rig.socket(zmq.DEALER, frontend) for _ in range(3)]
            rig.req = rig.socket(zmq.REQ, frontend)
            rig.workers = [rig.socket(zmq.DEALER, backend) for _ in range(3)]
            rig.batches = [[] for _ in rig.workers]
            yield rig
            for sock in [*rig.dealers, rig.req, *rig.workers]:
                sock.close(linger=0)
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()
        context.destroy(linger=0)


def _until_serving(rig: Rig) -> None:
    """Wait (at most 60 s) until the embedded worker has registered."""
    clock = MonotonicClock()
    until = clock.now() + 60.0
    while True:
        assert rig.broker.poll() is None, rig.logs()
        assert clock.now() < until, "the embedded worker never registered\n" + rig.logs()
        try:
            if rig.client.stats(timeout_s=1.0)["workers"]:
                return
        except TimeoutError:
            continue
        rig.client.poll(0.05)


# --------------------------------------------------------------------------- mutation


def _valid_frames(rid: int, samples: int = 1) -> tuple[dict[str, Any], list[bytes]]:
    meta: dict[str, Any] = {
        "id": rid,
        "model": MODEL,
        "timeout_ms": 5000,
        "inputs": [{"name": "x", "dtype": "float32", "shape": [samples, ITEM]}],
    }
    data = np.arange(samples * ITEM, dtype=np.float32).tobytes()
    return meta, [b"CP\x01\x01", msgpack.packb(meta), data]


def mutate(rid: int, steps: list[tuple[str, Any, Any]]) -> list[bytes]:
    """A valid request with ``steps`` applied, in order."""
    meta, frames = _valid_frames(rid)
    for kind, where, value in steps:
        if kind in ("field", "dtype", "shape", "samples"):
            if kind == "field":
                meta[where] = value
            elif kind == "dtype":
                meta["inputs"] = [{"name": "x", "dtype": where, "shape": [1, ITEM]}]
            elif kind == "shape":
                meta["inputs"] = [{"name": "x", "dtype": "float32", "shape": where}]
            else:
                meta["inputs"] = [{"name": "x", "dtype": "float32", "shape": [where, ITEM]}]
            frames[1:2] = [msgpack.packb(meta)]
        elif kind == "payload" and len(frames) > 2:
            frames[2] = bytes(where)
        elif kind == "delimiter":
            frames.insert(0, b"")
        else:
            mutate_frames(frames, [(kind, where, value)])
    return frames


def mutate_frames(frames: list[bytes], steps: list[tuple[str, Any, Any]]) -> list[bytes]:
    """``frames`` with frame-level ``steps`` applied, in place."""
    for kind, where, value in steps:
        if kind == "flip" and frames:
            k = where % len(frames)
            frame = bytearray(frames[k])
            if frame:
                frame[(where // len(frames)) % len(frame)] ^= 1 << value
            frames[k] = bytes(frame)
        elif kind == "truncate" and frames:
            k = where % len(frames)
            frames[k] = frames[k][: value % (len(frames[k]) + 1)]
        elif kind == "extra":
            frames.insert(min(where, len(frames)), value)
        elif kind == "drop" and len(frames) > 1:
            del frames[where % len(frames)]
        elif kind == "repeat" and frames:
            k = where % len(frames)
            frames.insert(k, frames[k])
    return frames


def one_more_change(frames: list[bytes], rand: random.Random) -> list[bytes]:
    """``frames`` with one more random bit flipped, or one frame cut short."""
    if frames:
        k = rand.randrange(len(frames))
        if rand.random() < 0.3:
            mutate_frames(frames, [("truncate", k, rand.randrange(80))])
        else:
            at = rand.randrange(max(1, len(frames[k])))
            mutate_frames(frames, [("flip", k + len(frames) * at, rand.randrange(8))])
    return frames


FZ_SPEC = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 4]}],
    "max_batch": 8,
}


def ready(model: str, slots: int, heartbeat_ms: int) -> list[bytes]:
    """A valid READY for a model only the fuzzing workers serve."""
    meta = {"name": "fuzz", "slots": slots, "heartbeat_ms": heartbeat_ms, "models": []}
    meta["models"] = [{"name": model, **FZ_SPEC}]
    return [b"CP\x01\x10", msgpack.packb(meta)]


def ask(model: str, rid: int) -> list[bytes]:
    """A valid request for a model only the fuzzing workers serve."""
    meta = {"id": rid, "model": model, "timeout_ms": 2000}
    meta["inputs"] = [{"name": "x", "dtype": "float32", "shape": [1, 4]}]
    return [b"CP\x01\x01", msgpack.packb(meta), bytes(16)]


def result(batch: dict[str, Any]) -> list[bytes]:
    """A valid RESULT for a BATCH a fuzzing worker received (zeros for outputs)."""
    replies: list[list[bytes]] = []
    for item in batch.get("requests", []):
        n = item.get("n", 1)
        meta = {"id": item.get("id"), "outputs": [{"name": "y", "dtype": "float32"}]}
        meta["outputs"][0]["shape"] = [n, 4]
        replies.append([b"CP\x01\x02", msgpack.packb(meta), bytes(16 * n)])
    meta = {"batch": batch.get("batch"), "frames": [len(r) for r in replies], "rho": 0.5}
    return [b"CP\x01\x13", msgpack.packb(meta), *(f for r in replies for f in r)]


def forged(command: int, batch_id: int) -> list[bytes]:
    """A RESULT or FAILED for a batch the sender was never given."""
    if command == 0x14:
        meta = {"batch": batch_id, "code": 6, "message": "forged"}
        return [b"CP\x01\x14", msgpack.packb(meta)]
    reply = {"id": 0, "outputs": [{"name": "y", "dtype": "float32", "shape": [1, ITEM]}]}
    frames = [b"CP\x01\x02", msgpack.packb(reply), bytes(4 * ITEM)]
    return [b"CP\x01\x13", msgpack.packb({"batch": batch_id, "frames": [3]}), *frames]


# --------------------------------------------------------------------------- the test


@pytest.mark.timeout(180)
def test_a_fuzzed_broker_stays_up_and_answers_valid_requests_correctly(rig: Rig) -> None:
    answered = 0

    @FUZZ
    @given(
        st.lists(st.tuples(st.integers(0, 3), client_messages), min_size=1, max_size=5),
    )
    def clients(messages: list[tuple[int, list[bytes]]]) -> None:
        for which, frames in messages:
            rig.send_client(which, frames)
        rig.submit_valid()
        rig.drain()

    @FUZZ
    @given(st.integers(0, 3), st.integers(0, 2**64 - 1), mutations, st.randoms())
    def mutated(
        which: int, rid: int, steps: list[tuple[str, Any, Any]], rand: random.Random
    ) -> None:
        rig.send_client(which, mutate(rid, steps))
        for _ in range(VARIANTS):  # and cheap variants: one more flip or cut each
            frames = one_more_change(mutate(rid, steps), rand)
            rig.send_client(rand.randrange(4), frames)
        rig.submit_valid()
        rig.drain()

    @FUZZ
    @given(
        st.lists(
            st.tuples(st.integers(0, 2), st.integers(0, 9), worker_actions),
            min_size=1,
            max_size=5,
        )
    )
    def workers(actions: list[tuple[int, int, tuple[str, Any]]]) -> None:
        latest = rig.last_batch_id()
        rig.submit_valid()  # its batch is in flight while forged answers arrive
        for which, fresh, (kind, what) in actions:
            if fresh == 0:
                rig.new_worker(which)
            if kind == "fuzz":
                frames = what
            elif kind == "ready":
                frames = ready(*what)
            elif kind == "ask":
                rig.send(rig.dealers[which], ask(what[0], what[1]))
                continue
            elif kind == "answer":
                if not rig.batches[which]:
                    continue
                frames = mutate_frames(result(rig.batches[which].pop(0)), what)
            else:
                command, offset, steps = what
                frames = mutate_frames(forged(command, latest + offset), steps)
            rig.send(rig.workers[which], frames)
        rig.drain()

    for phase in (clients, mutated, workers):
        phase()
        assert rig.broker.poll() is None, rig.logs()
        answered += rig.check_valid()
    assert answered == rig.seed >= 3 * EXAMPLES  # every valid request, answered right
    assert rig.sent >= 3 * EXAMPLES

    # Still serving: a request, and STATS, once the fuzzing has stopped.
    x = np.ones((2, ITEM), np.float32)
    np.testing.assert_array_equal(rig.client.infer(MODEL, {"x": x})["y"], synthetic_output(x))
    stats = rig.client.stats()
    assert [w["name"] for w in stats["workers"] if w["models"] == [MODEL]] == ["embedded"]
    # The fuzzing reached what it meant to: refused input, forged answers dropped.
    assert stats["errors"]["INVALID_ARGUMENT"] > EXAMPLES
    assert stats["late_results"] > 0
    rig.broker.terminate()
    assert rig.broker.wait(timeout=STOP_TIMEOUT_S) == 0, rig.logs()
    assert "Traceback" not in rig.log.read_text(), rig.logs()
