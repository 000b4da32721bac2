"""The benchmarks' reference servers answer as the scripts expect.

The scripts in bench/ do not run in CI (they take minutes and measure speed); their
baselines stand on the helper processes of ``bench/common.py``. These tests start the
echo server and the bare relays as the scripts do and check what comes back, and that
every script still imports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from carpool.common.protocol import Command, header
from carpool.common.protocol import frames as codec
from tests.bench_scripts import BENCH, load_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """``bench/common.py``, imported as the scripts import it (their directory on the path)."""
    sys.path.insert(0, str(BENCH))
    try:
        import common

        yield common
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_bench_script_imports(bench: ModuleType, script: str) -> None:
    module = load_script(script)
    assert module.__doc__, f"{script} says what it measures in its docstring"


def test_the_in_process_harnesses_run(bench: ModuleType) -> None:
    """hot_path.py's harnesses (core, embedded, worker, client), a few hundred requests
    each: every request answered (they wait for each reply), a time per request out."""
    hot_path = load_script("hot_path.py")
    us, mean_batch = hot_path.core_run(4, "carpool", n=200)
    assert us > 0
    assert 1 <= mean_batch <= 4
    for chunks in (
        hot_path.embedded_run(200, False, chunk=100),
        hot_path.embedded_run(200, True, chunk=100, burst=4),
        hot_path.worker_run(200, chunk=100, burst=2),
        hot_path.client_run(200, chunk=100, burst=4),
    ):
        assert len(chunks) == 2
        assert all(0 < c < 1e6 for c in chunks)


def test_decision_ops_counts_the_brokers_code_and_not_the_simulators(bench: ModuleType) -> None:
    """decision_ops.py's count over a short schedule: each policy's own decision is
    counted, the simulator's loop is not."""
    decision_ops = load_script("decision_ops.py")
    schedule = decision_ops.arrivals(decision_ops.poisson(500, 0.2), timeout_ms=1000, seed=1)
    default, default_batch = decision_ops.counted(schedule, "carpool")
    fixed, fixed_batch = decision_ops.counted(schedule, "fixed")
    assert default["broker/policy.py:DeadlinePolicy.decide"] > 0
    assert "broker/policy.py:FixedPolicy.decide" not in default
    assert fixed["broker/policy.py:FixedPolicy.decide"] > 0
    assert not [k for k in default | fixed if k.startswith("sim/")]
    assert default_batch >= 1
    assert fixed_batch >= 1


def test_sim_vs_live_reads_each_batchs_transfer_from_the_brokers_lines(
    bench: ModuleType, tmp_path: Path
) -> None:
    """sim_vs_live.py: the broker's batch lines after the offset, each batch's round trip
    less its engine time, less the worker's fitted CPU for its size (never below 0)."""
    sim_vs_live = load_script("sim_vs_live.py")
    log = tmp_path / "broker.log"
    line = (
        "batch model=mlp size={n} bucket=- wait_ms=5.10 compute_ms={c} round_trip_ms={rt} "
        "worker=w b_max=16 bound_by=-\n"
    )
    old = line.format(n=1, c="1.00", rt="99.00")
    log.write_text(
        old + line.format(n=4, c="2.00", rt="4.50") + line.format(n=16, c="3.00", rt="3.10"),
        encoding="utf-8",
    )
    times = sim_vs_live.batch_times(log, len(old))
    assert times["batches"] == [(4, pytest.approx(2.5)), (16, pytest.approx(0.1))]
    assert times["batch_wait_ms"] == pytest.approx(5.1)
    fit = {"cpu_alpha_ms": 0.2, "cpu_beta_ms": 0.05}
    assert sim_vs_live.transfers(times["batches"], fit) == [pytest.approx(2.1), 0.0]


def test_core_run_decodes_and_encodes_inside_the_counted_edge(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/instructions.py counts only what runs inside ``operator.call`` in
    ``core_run``: every decode of a client's or a worker's frames (a ``decode_from_client``
    too, where the protocol has one) and every encode of what the core hands back."""
    from carpool.common import protocol

    hot_path = load_script("hot_path.py")
    depth = [0]
    seen = {"client": 0, "worker": 0, "to_frames": 0}

    def counted(fn: Callable[..., Any], *args: Any) -> Any:
        depth[0] += 1
        try:
            return fn(*args)
        finally:
            depth[0] -= 1

    def inside(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            assert depth[0] == 1, f"{name} ran outside the counted edge"
            seen[name] += 1
            return fn(*args)

        return wrapped

    from carpool.broker import core

    worker_decode = inside("worker", protocol.decode_from_worker)
    monkeypatch.setattr(protocol, "decode_from_worker", worker_decode)
    # The client's decoder, whether the harness calls it (a core that takes the typed
    # message) or the core does (its on_client's first line, with its layouts).
    client_decode = inside("client", protocol.decode_from_client)
    monkeypatch.setattr(protocol, "decode_from_client", client_decode)
    monkeypatch.setattr(core, "decode_from_client", client_decode)
    monkeypatch.setattr(hot_path, "frames_of", inside("to_frames", hot_path.frames_of))
    _us, mean_batch = hot_path.core_run(8, "fixed", n=64, edge=counted)
    assert mean_batch > 1
    assert seen["client"] >= 64
    assert seen["worker"] >= 2  # the READY and a RESULT at least
    assert seen["to_frames"] > seen["client"]


def test_frames_of_calls_a_messages_encoder(bench: ModuleType) -> None:
    hot_path = load_script("hot_path.py")
    from carpool.broker.core import Side

    class Message:
        def to_frames(self) -> list[bytes]:
            return [b"BATCH", b"meta"]

    class Out:
        def __init__(self, side: Side, message: Message | None, frames: list[bytes]) -> None:
            self.side, self.message, self.frames = side, message, frames

    sent = hot_path.frames_of([Out(Side.BACKEND, Message(), []), Out(Side.FRONTEND, None, [b"r"])])
    assert sent == [(Side.BACKEND, [b"BATCH", b"meta"]), (Side.FRONTEND, [b"r"])]


@pytest.mark.parametrize("link", ["zmq", "unix"])
def test_echo_and_bare_relays_answer_as_the_scripts_expect(bench: ModuleType, link: str) -> None:
    x = bench.tensor((1, 16))
    frames = bench.request_frames("synthetic", x)
    request_meta = codec.unpack(frames[1])
    with bench.ProcessGroup("ipc") as group:
        echo, front, back = (group.endpoint(n) for n in ("echo", "bare-front", "bare-back"))
        if link == "unix":
            back = f"unix:{group.tmp}/bare-link"
        group.echo(echo)
        group.bare_fleet(front, back)
        bench.wait_echo(echo, group)
        bench.wait_echo(front, group)  # through both bare processes once they are connected

        sock = bench.dealer(echo)
        try:
            sock.send_multipart(frames)
            assert sock.poll(10_000)
            assert sock.recv_multipart() == [bytes(f) for f in frames]  # back as it was sent
        finally:
            sock.close()

        sock = bench.dealer(front)
        try:
            sock.send_multipart(frames)
            assert sock.poll(10_000)
            reply = sock.recv_multipart()
            # A REPLY to that request: its id, the input's descriptor, the payload back.
            assert reply[0] == header(Command.REPLY)
            meta = codec.unpack(reply[1])
            assert meta["id"] == request_meta["id"]
            assert meta["outputs"] == request_meta["inputs"]
            assert reply[2] == x.tobytes()
            # The closed loop the scripts run, several in flight: every reply comes back.
            result = bench.raw_loop(sock, frames, 4, 40, 20.0, expect_command=Command.REPLY)
            assert (result.completed, result.errors) == (40, 0)
        finally:
            sock.close()
