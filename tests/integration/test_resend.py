"""A request sent again, CANCEL, and the stopping broker's ``retry`` (protocol.md §6.1,
§6.3, §6.5, §11), over real loopback sockets: raw pyzmq DEALERs speak the protocol to a
broker on a thread and a worker whose synthetic engine runs a batch only once the test
lets it (so a request is surely at the worker, or queued behind it, when the test acts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.broker.config import BatchingConfig, CurveConfig
from carpool.broker.server import BrokerServer
from carpool.common.clock import MonotonicClock
from carpool.common.curve import ClientKeys, connect_keys, create_keypair, load_keypair
from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    Cancel,
    Command,
    ErrorReply,
    decode_meta,
    parse_header,
    request_frames,
    request_wire,
    tensor_wire,
)
from carpool.common.testing import ServerThread
from carpool.worker.engines.base import Array
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)

NONCE = bytes(range(16))
OTHER = bytes(range(100, 116))
Socket = zmq.Socket[bytes]


class Gated(SyntheticEngine):
    """Runs a batch only once the test opens the gate; counts the batches it ran."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(item_shape=(4,), max_batch=1)
        self.gate = gate
        self.runs: list[float] = []

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        assert self.gate.wait(30)
        self.runs.append(float(inputs["x"][0, 0]))
        return super().run(inputs)


@dataclasses.dataclass
class Setup:
    broker: BrokerServer
    engine: Gated
    context: zmq.Context[Socket]
    keys: dict[str, ClientKeys] = dataclasses.field(default_factory=dict)

    def dealer(self, who: str | None = None) -> Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if who is not None:
            connect_keys(sock, self.keys[who])
        sock.connect(self.broker.frontend_endpoint)
        return sock

    def until(self, what: str, done: Callable[[], bool], limit_s: float = 10.0) -> None:
        clock = MonotonicClock()
        end = clock.now() + limit_s
        while not done():
            assert clock.now() < end, f"{what} did not happen in {limit_s} s"
            clock.sleep(0.005)


@contextlib.contextmanager
def setup(
    context: zmq.Context[Socket], tmp_path: Path | None = None, **config: Any
) -> Iterator[Setup]:
    """A broker (CURVE on with ``tmp_path``: keys for clients alice and mallory) and a
    gated worker of one slot; the gate opens on exit, so that everything can stop."""
    gate = threading.Event()
    engine = Gated(gate)
    batching = BatchingConfig(max_batch=1, max_wait_s=0.0, policy="fixed")
    base = dataclasses.replace(loopback_config(), batching=batching)
    keys: dict[str, ClientKeys] = {}
    worker_keys = None
    if tmp_path is not None:
        pairs = {n: create_keypair(tmp_path / "clients", n)[1] for n in ("alice", "mallory")}
        broker_secret = create_keypair(tmp_path / "broker", "broker")[1]
        worker_secret = create_keypair(tmp_path / "workers", "w")[1]
        public = load_keypair(broker_secret).public
        keys = {n: ClientKeys(public, load_keypair(p)) for n, p in pairs.items()}
        worker_keys = ClientKeys(public, load_keypair(worker_secret))
        config["curve"] = CurveConfig(
            enabled=True,
            server_key=str(broker_secret),
            clients=str(tmp_path / "clients"),
            workers=str(tmp_path / "workers"),
        )
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(
            ServerThread(BrokerServer(dataclasses.replace(base, **config)))
        )
        worker = WorkerServer(
            broker.backend_endpoint, {"m": lambda: engine}, slots=1, warmup=False, curve=worker_keys
        )
        stack.enter_context(ServerThread(worker))
        stack.callback(gate.set)
        s = Setup(broker, engine, context, keys)
        s.until("the worker's registration", lambda: bool(broker.core.registry.specs.get("m")))
        yield s


def request(rid: int, value: float, nonce: bytes | None = NONCE) -> list[Any]:
    x = np.full((1, 4), value, np.float32)
    meta = request_wire(rid, "m", [tensor_wire("x", "float32", [1, 4])], 10_000, client=nonce)
    return request_frames(meta, [x.tobytes()])


def answer(sock: Socket, timeout_s: float = 10.0) -> tuple[Command, dict[str, Any], list[bytes]]:
    assert sock.poll(int(timeout_s * 1000)), "no answer"
    frames = sock.recv_multipart()
    return parse_header(frames[0]), decode_meta(frames[1]), frames[2:]


def output(frames: list[bytes]) -> list[float]:
    return list(np.frombuffer(frames[0], np.float32))


def expected(value: float) -> list[float]:
    return list(synthetic_output(np.full((1, 4), value, np.float32))[0])


def test_a_copy_from_a_new_connection_gets_the_one_answer_and_the_worker_ran_it_once(
    context: zmq.Context[Socket],
) -> None:
    with setup(context) as s:
        first = s.dealer()
        first.send_multipart(request(7, 1.0))
        s.until("the dispatch", lambda: s.broker.core.inflight_batches == 1)
        first.close()  # the connection is lost before the reply
        again = s.dealer()
        again.send_multipart(request(7, 1.0))
        s.until("the match", lambda: s.broker.core.stats.resent == 1)
        s.engine.gate.set()
        command, meta, frames = answer(again)
        assert (command, meta["id"], output(frames)) == (Command.REPLY, 7, expected(1.0))
        assert not again.poll(200)  # one answer
        assert s.engine.runs == [1.0]
        assert s.broker.core.stats.departed == 0
        again.close()


def test_a_peer_with_the_same_id_and_another_nonce_or_none_never_gets_that_answer(
    context: zmq.Context[Socket],
) -> None:
    with setup(context) as s:
        first = s.dealer()
        first.send_multipart(request(7, 1.0))
        s.until("the dispatch", lambda: s.broker.core.inflight_batches == 1)
        first.close()
        other, plain = s.dealer(), s.dealer()
        other.send_multipart(request(7, 2.0, OTHER))
        plain.send_multipart(request(7, 3.0, None))
        s.until("both queued", lambda: s.broker.core.queued == 2)
        s.engine.gate.set()
        for sock, value in ((other, 2.0), (plain, 3.0)):
            command, meta, frames = answer(sock)
            assert (command, meta["id"], output(frames)) == (Command.REPLY, 7, expected(value))
            assert not sock.poll(200)
            sock.close()
        assert sorted(s.engine.runs) == [1.0, 2.0, 3.0]
        assert s.broker.core.stats.resent == 0
        s.until("the first reply dropped", lambda: s.broker.core.stats.departed == 1)


def test_cancel_answers_a_queued_request_cancelled_and_leaves_the_rest_alone(
    context: zmq.Context[Socket],
) -> None:
    with setup(context) as s:
        client, stranger = s.dealer(), s.dealer()
        for rid in (1, 2, 3):
            client.send_multipart(request(rid, float(rid)))
        s.until("one running, two queued", lambda: s.broker.core.queued == 2)
        client.send_multipart(Cancel(2, NONCE).to_frames())
        command, meta, _ = answer(client)
        error = ErrorReply.from_wire(meta)
        assert (command, error.request_id, error.code) == (Command.ERROR, 2, ErrorCode.CANCELLED)
        assert s.broker.core.stats.cancelled == 1
        before = s.broker.core.stats.requests
        client.send_multipart(Cancel(1, NONCE).to_frames())  # at the worker: nothing
        stranger.send_multipart(Cancel(3, OTHER).to_frames())  # another nonce's: nothing
        s.until("both read", lambda: s.broker.core.stats.requests == before + 2)
        s.engine.gate.set()
        replies = [answer(client) for _ in range(2)]
        assert sorted((c, m["id"]) for c, m, _ in replies) == [
            (Command.REPLY, 1),
            (Command.REPLY, 3),
        ]
        assert not client.poll(200)
        assert not stranger.poll(0)
        assert s.engine.runs == [1.0, 3.0]
        assert s.broker.core.stats.cancelled == 1
        client.close()
        stranger.close()


def test_under_curve_the_same_nonce_from_another_key_matches_nothing(
    context: zmq.Context[Socket], tmp_path: Path
) -> None:
    with setup(context, tmp_path) as s:
        alice = s.dealer("alice")
        alice.send_multipart(request(7, 1.0))
        alice.send_multipart(request(8, 8.0))
        s.until("one running, one queued", lambda: s.broker.core.queued == 1)
        alice.close()
        mallory = s.dealer("mallory")
        before = s.broker.core.stats.requests
        mallory.send_multipart(request(7, 2.0))  # alice's nonce and id: its own request
        mallory.send_multipart(Cancel(8, NONCE).to_frames())  # nothing: not its key's
        s.until("both read", lambda: s.broker.core.stats.requests == before + 2)
        assert s.broker.core.queued == 2
        assert s.broker.core.stats.resent == 0
        again = s.dealer("alice")
        again.send_multipart(request(7, 1.0))
        s.until("alice's copy matched", lambda: s.broker.core.stats.resent == 1)
        assert s.broker.core.stats.cancelled == 0
        s.engine.gate.set()
        command, meta, frames = answer(again)
        assert (command, meta["id"], output(frames)) == (Command.REPLY, 7, expected(1.0))
        command, meta, frames = answer(mallory)
        assert (command, meta["id"], output(frames)) == (Command.REPLY, 7, expected(2.0))
        assert not mallory.poll(200)
        assert sorted(s.engine.runs) == [1.0, 2.0, 8.0]
        again.close()
        mallory.close()


def test_a_stopping_brokers_unavailable_for_a_request_that_did_not_run_carries_retry(
    context: zmq.Context[Socket],
) -> None:
    with setup(context, stop_grace_s=0.5) as s:
        client = s.dealer()
        client.send_multipart(request(1, 1.0))
        client.send_multipart(request(2, 2.0))
        s.until("one running, one queued", lambda: s.broker.core.queued == 1)
        s.broker.stop()
        s.until("the stop", lambda: s.broker.core.stopping)
        client.send_multipart(request(3, 3.0))
        errors = {}
        for _ in range(3):  # 3 at once, then after the grace 2 (queued) and 1 (running)
            command, meta, _ = answer(client)
            assert command is Command.ERROR
            error = ErrorReply.from_wire(meta)
            errors[error.request_id] = (error.code, error.retry)
        assert errors == {
            1: (ErrorCode.UNAVAILABLE, False),  # at the worker: it may have run
            2: (ErrorCode.UNAVAILABLE, True),
            3: (ErrorCode.UNAVAILABLE, True),
        }
        client.close()
