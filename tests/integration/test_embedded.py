"""A worker embedded in the broker's process (BrokerServer(embedded=[WorkerServer(...,
embedded=True)])): real client sockets, no sockets between broker and worker."""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.broker.server import BrokerServer
from carpool.client import Client, InvalidArgument
from carpool.common.protocol import Command, encode
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config, wait_for_workers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def embedded_fleet() -> Iterator[Callable[..., tuple[BrokerServer, list[WorkerServer]]]]:
    with contextlib.ExitStack() as stack:

        def make(
            *engines: dict[str, Callable[[], Any]], **worker_kw: Any
        ) -> tuple[BrokerServer, list[WorkerServer]]:
            workers = [
                stack.enter_context(
                    WorkerServer("embedded", models, name=f"e{i}", embedded=True, **worker_kw)
                )
                for i, models in enumerate(engines)
            ]
            config = loopback_config(max_batch=8, max_wait_s=0.002)
            broker = stack.enter_context(ServerThread(BrokerServer(config, embedded=workers)))
            return broker, workers

        yield make


def test_requests_are_answered_by_the_embedded_engine(embedded_fleet: Any) -> None:
    broker, _ = embedded_fleet({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)})
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        xs = [np.full((1 + i % 3, 4), i, np.float32) for i in range(60)]
        futures = [client.submit("syn", {"x": x}) for x in xs]
        for f, x in zip(futures, xs, strict=True):
            np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))
        stats = client.stats()
        assert [w["name"] for w in stats["workers"]] == ["e0"]
        assert sum(stats["batch_sizes"]["syn"].values()) < 60  # batches formed
        with pytest.raises(InvalidArgument):  # checked by the broker as for any worker
            client.infer("syn", {"x": np.zeros((1, 5), np.float32)})


def test_slow_batches_run_on_the_inference_thread(embedded_fleet: Any) -> None:
    """A 5 ms engine is not run on the broker's thread: finished batches come back through
    the results descriptor the broker polls, and the broker keeps serving meanwhile."""
    engine = {"slow": lambda: SyntheticEngine(item_shape=(4,), fixed_cost_s=0.005, max_batch=8)}
    broker, (worker,) = embedded_fleet(engine)
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        for _ in range(3):  # teach the worker that its batches are long
            client.infer("slow", {"x": np.ones((1, 4), np.float32)}, timeout_s=5)
        assert not worker.core.runs_inline(_job(worker, "slow"))
        xs = [np.full((1, 4), i, np.float32) for i in range(40)]
        futures = [client.submit("slow", {"x": x}) for x in xs]
        for f, x in zip(futures, xs, strict=True):
            np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))
        assert max(int(k) for k in client.stats()["batch_sizes"]["slow"]) > 1


def _job(worker: WorkerServer, model: str) -> Any:
    from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta
    from carpool.worker.core import RunBatch

    meta = BatchMeta(1, model, (TensorMeta("x", "float32", (-1, 4)),), (BatchItem(1, 1, False, 0),))
    return RunBatch(worker.core.epoch, meta, [b""])


def test_heartbeats_keep_the_embedded_worker_registered(embedded_fleet: Any) -> None:
    broker, _ = embedded_fleet(
        {"syn": lambda: SyntheticEngine(item_shape=(4,))}, heartbeat_s=0.05, liveness=3
    )
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        client.poll(0.6)  # twelve heartbeat intervals with no traffic
        assert [w["name"] for w in client.stats()["workers"]] == ["e0"]
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(client.infer("syn", {"x": x})["y"], synthetic_output(x))


def test_an_embedded_and_a_remote_worker_share_the_work(embedded_fleet: Any) -> None:
    broker, _ = embedded_fleet({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)})
    with contextlib.ExitStack() as stack:
        remote = WorkerServer(
            broker.backend_endpoint,
            {"syn": lambda: SyntheticEngine(item_shape=(4,), fixed_cost_s=0.002, max_batch=8)},
            name="remote",
        )
        stack.enter_context(ServerThread(remote))
        with Client(broker.frontend_endpoint) as client:
            wait_for_workers(client, 2)
            transports = {w["name"]: w["transport"] for w in client.stats()["workers"]}
            assert transports == {"e0": "embedded", "remote": "zeromq"}
            xs = [np.full((1, 4), i, np.float32) for i in range(200)]
            futures = [client.submit("syn", {"x": x}) for x in xs]
            for f, x in zip(futures, xs, strict=True):
                np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))
        assert remote.core.batches_done > 0


def test_a_refused_embedded_worker_asks_again_slowly(embedded_fleet: Any) -> None:
    """Two embedded workers whose specs for one model differ: the second is refused
    (DISCONNECT) and registers again at most once a second, not in a loop; the broker
    keeps serving with the first."""
    broker, (_, second) = embedded_fleet(
        {"m": lambda: SyntheticEngine(item_shape=(4,))},
        {"m": lambda: SyntheticEngine(item_shape=(5,))},
    )
    with Client(broker.frontend_endpoint) as client:
        wait_for_workers(client, 1)
        epoch = second.core.epoch
        client.poll(1.2)
        assert 1 <= second.core.epoch - epoch <= 2  # about one READY a second
        assert [w["name"] for w in client.stats()["workers"]] == ["e0"]
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(client.infer("m", {"x": x})["y"], synthetic_output(x))


# ---------------------------------------------------------------- spoofing, sizing, rejoining


def test_a_backend_peer_cannot_speak_for_the_embedded_worker() -> None:
    """zmq lets a peer choose the routing id b"\\x00embedded-0"; the broker must not take
    its messages (here DISCONNECT) as the embedded worker's."""
    with contextlib.ExitStack() as stack:
        w = stack.enter_context(
            WorkerServer(
                "embedded",
                {"syn": lambda: SyntheticEngine(item_shape=(4,))},
                name="e0",
                embedded=True,
            )
        )
        broker = stack.enter_context(ServerThread(BrokerServer(loopback_config(), embedded=[w])))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        spoof = ctx.socket(zmq.DEALER)
        stack.callback(spoof.close, 0)
        spoof.setsockopt(zmq.ROUTING_ID, b"\x00embedded-0")
        spoof.connect(broker.backend_endpoint)
        with Client(broker.frontend_endpoint) as client:
            wait_for_workers(client, 1)
            spoof.send_multipart(encode(Command.DISCONNECT, {"reason": "spoofed"}))
            client.poll(0.3)
            names = [x["name"] for x in client.stats()["workers"]]
            assert names == ["e0"], names


def test_a_large_batch_of_a_fast_model_does_not_run_on_the_broker_thread() -> None:
    """The inline rule predicts a batch's time from its size: after batches of one at
    1.5 ms, a batch of 32 (48 ms) goes to the inference thread, not the broker's."""
    ran: list[tuple[int, int]] = []  # (batch size, thread) of each run

    class Recording(SyntheticEngine):
        def run(self, inputs: Any) -> dict[str, Any]:
            ran.append((len(inputs["x"]), threading.get_ident()))
            return super().run(inputs)

    engine = {"syn": lambda: Recording(item_shape=(4,), per_sample_s=0.0015, max_batch=32)}
    with contextlib.ExitStack() as stack:
        w = stack.enter_context(WorkerServer("embedded", engine, name="e0", embedded=True))
        config = loopback_config(max_batch=32, max_wait_s=0.05)
        broker = stack.enter_context(BrokerServer(config, embedded=[w]))
        client = stack.enter_context(Client(broker.frontend_endpoint))
        x = np.ones((1, 4), np.float32)
        for _ in range(4):  # batches of one: 1.5 ms each
            f = client.submit("syn", {"x": x}, timeout_s=10)
            until = time.monotonic() + 5
            while not f.done() and time.monotonic() < until:
                broker.step(0.01)
                client.poll(0)
        futures = [client.submit("syn", {"x": x}, timeout_s=30) for _ in range(32)]
        client.poll(0.1)  # (no reply can come: the broker is not running) all 32 arrive
        until = time.monotonic() + 10
        while not all(f.done() for f in futures) and time.monotonic() < until:
            broker.step(0.01)
            client.poll(0)
        assert all(f.done() for f in futures)
    broker_thread = threading.get_ident()  # (the test's: it steps the broker)
    large = [thread for size, thread in ran if size > 1]
    assert large, f"no batch of more than one formed: {[size for size, _ in ran]}"
    assert broker_thread not in large, "a large batch ran on the broker's thread"


def _syn_job(worker: WorkerServer) -> Any:
    from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta
    from carpool.worker.core import RunBatch

    meta = BatchMeta(1, "syn", (TensorMeta("x", "float32", (-1, 4)),), (BatchItem(1, 1, False, 0),))
    return RunBatch(worker.core.epoch, meta, [b""])


def test_embed_config_without_models_serves_only_the_flag_models(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """`--embed-config w.toml` (slots only) with `--embed-synthetic`: WorkerConfig's default
    model (the catalogue 'orientation') is not added too."""
    import carpool.worker.factory as wf
    from carpool import cli, roles

    made: list[list[str]] = []

    class Fake:
        def __init__(self, broker: str, models: dict[str, Any], **kw: Any) -> None:
            made.append(list(models))

    monkeypatch.setattr(wf, "WorkerServer", Fake)
    toml = tmp_path / "w.toml"
    toml.write_text("slots = 4\n")
    args = cli.build_parser().parse_args(
        ["broker", "--embed-config", str(toml), "--embed-synthetic", "0", "0"]
    )
    roles.embedded_workers(args)
    assert made == [["synthetic"]]


def test_the_broker_does_not_spin_while_an_embedded_worker_waits_to_rejoin() -> None:
    """After a DISCONNECT the embedded worker waits up to 1 s to say READY again; a batch
    that finishes on its inference thread meanwhile is drained (and dropped), so its
    readable results descriptor does not make every broker turn return at once. The request
    is answered once, after the requeue."""
    import threading

    from carpool.broker.core import ToWorker
    from carpool.common.protocol import BrokerDisconnect

    started, release = threading.Event(), threading.Event()

    class Gate(SyntheticEngine):
        def run(self, inputs: Any) -> dict[str, Any]:
            started.set()
            release.wait(10)
            return super().run(inputs)

    with contextlib.ExitStack() as stack:
        w = stack.enter_context(
            WorkerServer(
                "embedded", {"syn": lambda: Gate(item_shape=(4,))}, embedded=True, warmup=False
            )
        )
        broker = stack.enter_context(BrokerServer(loopback_config(max_wait_s=0.0), embedded=[w]))
        client = stack.enter_context(Client(broker.frontend_endpoint))
        f = client.submit("syn", {"x": np.ones((1, 4), np.float32)}, timeout_s=10)
        until = time.monotonic() + 5
        while not started.is_set() and time.monotonic() < until:
            broker.step(0.01)
            client.poll(0)
        assert started.is_set()  # the first batch of a model runs on the inference thread
        broker._send([ToWorker(b"\x00embedded-0", BrokerDisconnect("test"))])
        assert w.core.rejoining
        release.set()
        assert select.select([w.results_fd], [], [], 5)[0]  # the result waits
        steps = 0
        while w.core.rejoining and time.monotonic() < until:
            broker.step(0.05)
            steps += 1
        assert steps < 40, f"{steps} broker turns while waiting to rejoin"
        until = time.monotonic() + 5
        while not f.done() and time.monotonic() < until:
            broker.step(0.01)
            client.poll(0)
        assert f.done()
        np.testing.assert_array_equal(f.outputs(0)["y"], synthetic_output(np.ones((1, 4))))


def test_an_embedded_worker_takes_shared_memory_both_ways(embedded_fleet: Any) -> None:
    """A client on the broker's host, an embedded worker: 128 KiB inputs and outputs by
    reference (protocol §5.4, §5.5), no socket carries them."""
    from carpool.common.shm import available

    if not available():
        pytest.skip("no usable /dev/shm")
    broker, (worker,) = embedded_fleet(
        {"big": lambda: SyntheticEngine(item_shape=(32768,), max_batch=4)},
        shm_output_bytes=4 << 20,
    )
    with Client(
        broker.frontend_endpoint, shared_memory=4 << 20, shared_memory_outputs=True
    ) as client:
        wait_for_workers(client, 1)
        xs = [np.full((1, 32768), i, np.float32) for i in range(12)]
        futures = [client.submit("big", {"x": x}) for x in xs]
        for f, x in zip(futures, xs, strict=True):
            np.testing.assert_array_equal(f.outputs(10)["y"], synthetic_output(x))
        assert client.core.arena is not None
        assert client.core.arena.used_bytes == 0
    ring = worker._ring._ring
    assert ring is not None
    assert ring.head > 0
