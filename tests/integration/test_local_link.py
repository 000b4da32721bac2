"""Workers on the broker's host over its local endpoint (``unix:PATH``, carpool.common.link):
real unix sockets, real ONNX models, real processes for the crash."""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.core import ToWorker
from carpool.broker.server import BURST, BrokerServer
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.errors import ConfigError, RequestError
from carpool.common.link import MAX_FRAMES, PREAMBLE
from carpool.common.protocol import (
    HEARTBEAT_TO_WORKER,
    Command,
    ModelSpec,
    Ready,
    ReplyMeta,
    TensorMeta,
    encode,
    encode_reply,
)
from carpool.common.protocol import frames as codec
from carpool.common.testing import FakeClock, ServerThread
from carpool.worker.connection import too_large_for_a_link
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.models import locate
from carpool.worker.server import WorkerServer
from tests.conftest import wait_for_workers

CARPOOL = [sys.executable, "-m", "carpool"]


def local_config(tmp_path: Path, **batching: Any) -> BrokerConfig:
    return BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        local_backend=f"unix:{tmp_path}/workers.sock",
        batching=BatchingConfig(**batching),
    )


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as s:
        yield s


def worker_names(client: Client) -> list[str]:
    return sorted(w["name"] for w in client.stats()["workers"])


@pytest.mark.timeout(120)
def test_a_real_model_and_large_tensors_over_the_local_link(
    tmp_path: Path, stack: contextlib.ExitStack
) -> None:
    broker = stack.enter_context(ServerThread(BrokerServer(local_config(tmp_path, max_batch=8))))
    assert broker.local_endpoint == f"unix:{tmp_path}/workers.sock"
    big = SyntheticEngine(item_shape=(1 << 20,), max_batch=2)  # 4 MiB a sample
    worker = WorkerServer(
        broker.local_endpoint,
        {
            "ppocr-cls": lambda: OnnxRuntimeEngine(locate("ppocr-cls"), max_batch=8),
            "big": lambda: big,
        },
        name="local",
        shm_output_bytes=0,  # outputs in frames: the link carries them
    )
    stack.enter_context(ServerThread(worker))
    client = stack.enter_context(Client(broker.frontend_endpoint))
    wait_for_workers(client, 1)
    assert worker_names(client) == ["local"]

    reference = OnnxRuntimeEngine(locate("ppocr-cls"), max_batch=8)
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((1, 3, 48, 192)).astype(np.float32) for _ in range(120)]
    futures = [client.submit("ppocr-cls", {"x": x}, timeout_s=60) for x in inputs]
    name = reference.info.io.outputs[0].name
    for x, future in zip(inputs, futures, strict=True):
        np.testing.assert_allclose(
            future.outputs(timeout_s=60)[name], reference.run({"x": x})[name], rtol=1e-5, atol=1e-6
        )
    reference.close()

    x = rng.standard_normal((2, 1 << 20)).astype(np.float32)  # 8 MiB in, 8 MiB out
    np.testing.assert_array_equal(
        client.infer("big", {"x": x}, timeout_s=30)["y"], synthetic_output(x)
    )
    assert client.stats()["replies"] == 121


@pytest.mark.timeout(60)
def test_zeromq_and_local_workers_share_the_work(
    tmp_path: Path, stack: contextlib.ExitStack
) -> None:
    broker = stack.enter_context(ServerThread(BrokerServer(local_config(tmp_path, max_batch=1))))
    engines = {
        "local": SyntheticEngine(fixed_cost_s=0.02, item_shape=(2,), max_batch=1),
        "remote": SyntheticEngine(fixed_cost_s=0.02, item_shape=(2,), max_batch=1),
    }
    for name, endpoint in (("local", broker.local_endpoint), ("remote", broker.backend_endpoint)):

        def this_engine(engine: SyntheticEngine = engines[name]) -> SyntheticEngine:
            return engine

        server = WorkerServer(endpoint, {"m": this_engine}, name=name, warmup=False)
        stack.enter_context(ServerThread(server))
    client = stack.enter_context(Client(broker.frontend_endpoint))
    wait_for_workers(client, 2)
    assert worker_names(client) == ["local", "remote"]
    transports = {w["name"]: w["transport"] for w in client.stats()["workers"]}
    assert transports == {"local": "local", "remote": "zeromq"}
    xs = [np.full((1, 2), i, np.float32) for i in range(16)]
    futures = [client.submit("m", {"x": x}, timeout_s=20) for x in xs]
    for x, future in zip(xs, futures, strict=True):
        np.testing.assert_array_equal(future.outputs(timeout_s=20)["y"], synthetic_output(x))
    assert engines["local"].batches
    assert engines["remote"].batches
    assert len(engines["local"].batches) + len(engines["remote"].batches) == 16


@pytest.mark.timeout(60)
def test_a_worker_started_before_its_broker_joins_and_rejoins_a_restarted_one(
    tmp_path: Path, stack: contextlib.ExitStack
) -> None:
    config = local_config(tmp_path, max_batch=4)
    config = BrokerConfig(
        frontend=f"ipc://{tmp_path}/frontend",
        backend=f"ipc://{tmp_path}/backend",
        local_backend=config.local_backend,
        batching=config.batching,
    )
    engine = SyntheticEngine(item_shape=(2,), max_batch=4)
    # Nobody listens yet: READY is lost and the worker tries again after its liveness.
    worker = WorkerServer(
        config.local_backend, {"m": lambda: engine}, heartbeat_s=0.1, liveness=3, warmup=False
    )
    stack.enter_context(ServerThread(worker))
    x = np.ones((1, 2), np.float32)
    for _ in range(2):  # the first broker, then a second on the same paths
        with ServerThread(BrokerServer(config)), Client(config.frontend) as client:
            wait_for_workers(client, 1, timeout_s=20)
            assert client.infer("m", {"x": x}, timeout_s=5)["y"][0, 0] == 3.0
        assert not os.path.exists(f"{tmp_path}/workers.sock")  # removed on close


@pytest.mark.timeout(120)
def test_a_killed_local_worker_is_dropped_at_once_not_after_its_heartbeats(
    tmp_path: Path,
) -> None:
    """SIGKILL closes the worker's end of the link: the broker drops the worker when the
    stream ends, long before its liveness window (3 x a 30 s heartbeat) would, and the
    request it held goes back to the queue for the next worker."""
    frontend, local = f"ipc://{tmp_path}/frontend", f"unix:{tmp_path}/workers.sock"
    (tmp_path / "worker.toml").write_text("heartbeat_s = 30.0\n")
    logs = open(tmp_path / "procs.log", "wb")  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str) -> subprocess.Popen[bytes]:
        procs.append(
            subprocess.Popen([*CARPOOL, *args], stdin=subprocess.DEVNULL, stdout=logs, stderr=logs)
        )
        return procs[-1]

    def worker(name: str, sample_ms: str) -> subprocess.Popen[bytes]:
        config = str(tmp_path / "worker.toml")
        return spawn(
            "worker", "--broker", local, "--config", config, "--synthetic", "0", sample_ms,
            "--name", name,
        )  # fmt: skip

    clock = MonotonicClock()

    def wait(what: str, done: Any, client: Client, limit_s: float = 30.0) -> None:
        until = clock.now() + limit_s
        while not done():
            assert clock.now() < until, f"{what} did not happen in {limit_s} s"
            client.poll(0.05)

    try:
        spawn(
            "broker", "--frontend", frontend, "--backend", f"ipc://{tmp_path}/b", "--local", local
        )
        # 0.1 s a sample: its warm-up (5 samples) takes 0.5 s, the request's batch 30 s,
        # still running when the worker is killed.
        doomed = worker("doomed", "100")
        with Client(frontend) as client:
            wait_for_workers(client, 1, timeout_s=60)
            x = np.arange(300 * 16, dtype=np.float32).reshape(300, 16)
            future = client.submit("synthetic", {"x": x}, timeout_s=90)
            wait("dispatch", lambda: client.stats()["workers"][0]["outstanding"] > 0, client)
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait(timeout=10)
            # 30 s is a third of the liveness window: only the link's end can explain it.
            wait("dropping the killed worker", lambda: client.stats()["workers"] == [], client)
            assert client.stats()["requeued"] == 1
            assert not future.done()
            worker("heir", "0")
            np.testing.assert_array_equal(future.outputs(timeout_s=60)["y"], synthetic_output(x))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        logs.close()


def test_a_local_backend_must_be_a_unix_endpoint() -> None:
    with pytest.raises(ConfigError, match="local_backend must be unix:PATH"):
        BrokerConfig(local_backend="ipc:///tmp/x")


def test_a_second_broker_on_a_live_local_endpoint_fails_cleanly(tmp_path: Path) -> None:
    config = local_config(tmp_path)
    with ServerThread(BrokerServer(config)), pytest.raises(ConfigError, match="listening"):
        BrokerServer(config)
    assert not os.path.exists(f"{tmp_path}/workers.sock")  # the first one's, removed


def test_the_local_endpoint_takes_the_configured_group(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name  # one this process belongs to
    config = dataclasses.replace(local_config(tmp_path), local_backend_group=group)
    with ServerThread(BrokerServer(config)):
        st = os.stat(f"{tmp_path}/workers.sock")
        assert st.st_gid == os.getgid()
        assert stat.S_IMODE(st.st_mode) == 0o660
    bad = dataclasses.replace(config, local_backend_group="no-such-group-carpool")
    with pytest.raises(ConfigError, match="no such group"):
        BrokerServer(bad)


def test_a_backend_peer_cannot_speak_for_a_local_worker(
    tmp_path: Path, stack: contextlib.ExitStack
) -> None:
    """zmq lets a peer choose the routing id b"\\x00link-1"; the broker must not take its
    messages (here DISCONNECT) as the local worker's."""
    broker = stack.enter_context(ServerThread(BrokerServer(local_config(tmp_path))))
    engine = SyntheticEngine(item_shape=(2,))
    worker = WorkerServer(broker.local_endpoint, {"m": lambda: engine}, name="l0", warmup=False)
    stack.enter_context(ServerThread(worker))
    spoof: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    stack.callback(spoof.close, 0)
    spoof.setsockopt(zmq.ROUTING_ID, b"\x00link-1")
    spoof.connect(broker.backend_endpoint)
    client = stack.enter_context(Client(broker.frontend_endpoint))
    wait_for_workers(client, 1)
    spoof.send_multipart(encode(Command.DISCONNECT, {"reason": "spoofed"}))
    client.poll(0.3)
    assert worker_names(client) == ["l0"]
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(client.infer("m", {"x": x})["y"], synthetic_output(x))


def _ready(name: str, heartbeat_ms: int = 60_000) -> list[Any]:
    x, y = TensorMeta("x", "float32", (-1, 2)), TensorMeta("y", "float32", (-1, 2))
    spec = ModelSpec("m", (x,), (y,), 4)
    return encode(Command.READY, Ready(name, 2, (spec,), heartbeat_ms).to_wire())


def _wire(*messages: list[Any]) -> bytes:
    """Messages in the link's framing (docs/protocol.md §1), back to back: written with
    one sendall, they arrive in one read."""
    out: list[bytes] = []
    for frames in messages:
        data = [bytes(f) for f in frames]
        sizes = [len(f) for f in data]
        out.append(struct.pack(f"<IQ{len(sizes)}Q", len(sizes), sum(sizes), *sizes))
        out += data
    return b"".join(out)


def _heartbeats_then_disconnect(count: int) -> bytes:
    heartbeat = encode(Command.HEARTBEAT, {})
    return _wire(*[heartbeat] * count, encode(Command.DISCONNECT, {"reason": "done"}))


@pytest.mark.timeout(30)
def test_the_broker_takes_messages_read_past_its_burst(tmp_path: Path) -> None:
    """A worker's burst larger than the broker's per-turn limit arrives in one read; the
    last message (DISCONNECT) must still be handled, though the socket is not readable
    again and the worker sends nothing more."""
    with contextlib.closing(BrokerServer(local_config(tmp_path))) as broker:
        fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fake.connect(broker.local_endpoint[len("unix:") :])
        fake.sendall(PREAMBLE + _wire(_ready("burst")))
        for _ in range(20):
            broker.step(0.05)
            if broker.core.registry.all():
                break
        assert [w.name for w in broker.core.registry.all()] == ["burst"]
        fake.sendall(_heartbeats_then_disconnect(BURST + 40))
        for _ in range(5):
            broker.step(0.05)
        assert list(broker.core.registry.all()) == []
        fake.close()


@pytest.mark.timeout(30)
def test_the_worker_takes_messages_read_past_its_burst(tmp_path: Path) -> None:
    """The same on the worker's side: a fake broker sends heartbeats past the worker's
    per-turn limit, then DISCONNECT, in one write; the worker must connect again."""
    path = str(tmp_path / "w.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(0.01)
    engine = SyntheticEngine(item_shape=(2,), max_batch=4)
    worker = WorkerServer(f"unix:{path}", {"m": lambda: engine}, warmup=False)
    accepted: list[socket.socket] = []

    def accept() -> bool:
        with contextlib.suppress(TimeoutError):
            accepted.append(listener.accept()[0])
            return True
        return False

    try:
        assert accept(), "the worker did not connect"
        accepted[0].sendall(PREAMBLE + _heartbeats_then_disconnect(300))
        for _ in range(60):  # a refusal right after joining: it waits 1 s (back-off)
            worker.step(0.05)
            if accept():
                break
        assert len(accepted) == 2, "the worker never took the DISCONNECT behind the burst"
    finally:
        for conn in accepted:
            conn.close()
        worker.close()
        listener.close()


def test_a_backend_peer_cannot_take_a_local_worker_id_before_it_is_used(
    tmp_path: Path, stack: contextlib.ExitStack
) -> None:
    broker = stack.enter_context(ServerThread(BrokerServer(local_config(tmp_path))))
    spoof: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    stack.callback(spoof.close, 0)
    spoof.setsockopt(zmq.ROUTING_ID, b"\x00link-9")
    spoof.connect(broker.backend_endpoint)
    spoof.send_multipart(_ready("spoof"))
    client = stack.enter_context(Client(broker.frontend_endpoint))
    client.poll(0.3)
    assert worker_names(client) == []


def test_an_endpoint_without_a_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="local_backend must be unix:PATH"):
        BrokerConfig(local_backend="unix:")
    with pytest.raises(ConfigError, match="no socket path"):
        WorkerServer("unix:", {"m": lambda: SyntheticEngine(item_shape=(2,))}, warmup=False)


@pytest.mark.timeout(30)
def test_a_silent_local_worker_loses_its_link_when_the_broker_forgets_it(tmp_path: Path) -> None:
    """A hung worker misses its heartbeats: the core forgets it, and the broker closes
    its link (no descriptor held for it; a worker that wakes up connects anew)."""
    with contextlib.closing(BrokerServer(local_config(tmp_path))) as broker:
        fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fake.connect(broker.local_endpoint[len("unix:") :])
        fake.sendall(PREAMBLE + _wire(_ready("hung", heartbeat_ms=50)))
        for _ in range(20):
            broker.step(0.05)
            if broker.core.registry.all():
                break
        assert [w.name for w in broker.core.registry.all()] == ["hung"]
        fake.settimeout(0.05)
        ended = False
        for _ in range(100):  # liveness 3 x 50 ms; bounded at ~10 s
            broker.step(0.05)
            try:
                while fake.recv(65536):  # the broker's heartbeats, then the end
                    pass
                ended = True
                break
            except TimeoutError:
                continue
        assert ended, "the broker kept the forgotten worker's link open"
        assert list(broker.core.registry.all()) == []
        fake.close()


@pytest.mark.timeout(30)
def test_a_broker_survives_a_header_that_claims_too_much(tmp_path: Path) -> None:
    with contextlib.closing(BrokerServer(local_config(tmp_path))) as broker:
        fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fake.connect(broker.local_endpoint[len("unix:") :])
        fake.sendall(PREAMBLE + _wire(_ready("liar")))
        huge = 1 << 45
        fake.sendall(struct.pack("<IQQ", 1, huge, huge))
        for _ in range(10):
            broker.step(0.05)
        assert list(broker.core.registry.all()) == []  # registered, then dropped
        assert open_links(broker) == []
        fake.close()


def test_nothing_meant_for_a_dropped_local_worker_reaches_a_zeromq_peer(
    tmp_path: Path, stack: contextlib.ExitStack
) -> None:
    """A message the core addressed to a local worker whose link has just gone must not
    fall through to the ZeroMQ backend, where a peer may have taken that routing id."""
    broker = BrokerServer(local_config(tmp_path))
    stack.callback(broker.close)
    rogue: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    stack.callback(rogue.close, 0)
    rogue.setsockopt(zmq.ROUTING_ID, b"\x00link-1")
    rogue.connect(broker.backend_endpoint)
    rogue.send_multipart(encode(Command.HEARTBEAT, {}))  # the ROUTER now knows the id
    broker.step(0.2)
    broker._send([ToWorker(b"\x00link-1", HEARTBEAT_TO_WORKER)])
    assert rogue.poll(300) == 0


def test_a_model_whose_full_batch_a_link_cannot_carry_is_refused() -> None:
    x, y = TensorMeta("x", "float32", (-1, 2)), TensorMeta("y", "float32", (-1, 2))
    fits = ModelSpec("fits", (x,), (y,), 4096)
    outputs = tuple(TensorMeta(f"y{i}", "float32", (-1, 2)) for i in range(31))
    wide = ModelSpec("wide", (x,), outputs, 4096)  # 4096 x (2 + 31) frames in a RESULT
    assert too_large_for_a_link([fits]) is None
    reason = too_large_for_a_link([fits, wide])
    assert reason is not None
    assert "'wide'" in reason
    assert str(MAX_FRAMES) in reason
    assert too_large_for_a_link([dataclasses.replace(wide, max_batch=512)]) is None


def open_links(broker: BrokerServer) -> list[bytes]:
    """The ids of the local workers' links the broker holds open."""
    assert broker.local is not None
    return broker.local.peers


def _read_link_messages(sock: socket.socket, count: int) -> list[list[bytes]]:
    """``count`` messages a fake worker reads off its end of a link (preamble first)."""
    data = b""
    sock.settimeout(5)
    while len(data) < len(PREAMBLE):
        data += sock.recv(65536)
    assert data.startswith(PREAMBLE)
    data = data[len(PREAMBLE) :]
    messages: list[list[bytes]] = []
    while len(messages) < count:
        if len(data) >= 12:
            n, size = struct.unpack_from("<IQ", data)
            table = 12 + 8 * n
            if len(data) >= table + size:
                lengths = struct.unpack_from(f"<{n}Q", data, 12)
                at, frames = table, []
                for length in lengths:
                    frames.append(data[at : at + length])
                    at += length
                messages.append(frames)
                data = data[at:]
                continue
        data += sock.recv(65536)
    return messages


@pytest.mark.timeout(30)
def test_a_worker_that_answered_and_left_keeps_its_answer(
    tmp_path: Path, stack: contextlib.ExitStack
) -> None:
    """A worker sends its RESULT and exits; before the broker reads the link it sends that
    worker another BATCH, which fails (EPIPE). The RESULT sitting in the socket must still
    answer its request: not be dropped with the link, the request rerun or failed."""
    broker = BrokerServer(local_config(tmp_path, max_batch=1))
    stack.callback(broker.close)
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stack.callback(fake.close)
    fake.connect(broker.local_endpoint[len("unix:") :])
    fake.sendall(PREAMBLE + _wire(_ready("leaving")))  # 2 slots
    for _ in range(20):
        broker.step(0.05)
        if broker.core.registry.all():
            break
    client = stack.enter_context(Client(broker.frontend_endpoint))
    x = np.array([[1.0, 2.0]], np.float32)
    first = client.submit("m", {"x": x}, timeout_s=2)
    for _ in range(20):
        broker.step(0.05)
        if broker.core.stats.batch_sizes:
            break
    batch = codec.unpack(_read_link_messages(fake, 1)[0][1])
    reply_meta = ReplyMeta(batch["requests"][0]["id"], (TensorMeta("y", "float32", (1, 2)),), 1)
    reply = encode_reply(reply_meta, [synthetic_output(x)], simple=False)
    result = {"batch": batch["batch"], "rho": 0.1, "compute_ms": 0.1, "frames": [len(reply)]}
    fake.sendall(_wire(encode(Command.RESULT, result, reply)))
    fake.close()  # the worker is gone; its RESULT waits in the broker's end of the link

    second = client.submit("m", {"x": x}, timeout_s=0.5)
    assert broker.frontend.poll(5000)
    broker._drain_clients()  # admitted, and (below) dispatched
    broker._send(broker.core.on_tick(broker.clock.now()))  # before the link is read
    assert broker.core.stats.batch_sizes["m"][1] == 2  # the BATCH that found it gone
    # Lost at once, its RESULT handled first: no further batch goes its way this turn
    # (each would spend an attempt of its requests).
    assert open_links(broker) == []
    assert list(broker.core.registry.all()) == []

    for _ in range(40):
        broker.step(0.05)
        client.poll(0)
        if first.done() and second.done():
            break
    np.testing.assert_array_equal(first.outputs(timeout_s=0)["y"], synthetic_output(x))
    with pytest.raises(RequestError):  # no worker left: an error, not silence
        second.outputs(timeout_s=0)
    assert open_links(broker) == []
    assert list(broker.core.registry.all()) == []


@pytest.mark.timeout(30)
def test_a_local_peer_that_never_says_ready_loses_its_link(tmp_path: Path) -> None:
    """After its join window it loses its link, so it cannot hold a descriptor and a 1 MiB
    buffer in the broker for as long as it likes."""
    clock = FakeClock()
    with contextlib.closing(BrokerServer(local_config(tmp_path), clock=clock)) as broker:
        mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mute.connect(broker.local_endpoint[len("unix:") :])
        mute.sendall(PREAMBLE)
        broker.step(0.05)
        assert len(open_links(broker)) == 1
        clock.advance(9.0)
        broker.step(0.01)
        assert len(open_links(broker)) == 1  # still within its time
        clock.advance(1.5)
        broker.step(0.01)
        assert open_links(broker) == []
        mute.settimeout(5)
        assert mute.recv(65536) == PREAMBLE  # the broker's greeting, then the end
        assert mute.recv(65536) == b""
        mute.close()
