"""The open-loop load generator, carpool bench/record/replay, against a real loopback fleet."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.server import BrokerServer
from carpool.cli import main
from carpool.client import Client
from carpool.common.clock import MonotonicClock, wall_offset_s
from carpool.common.shm import available as shm_available
from carpool.common.testing import FakeClock, ServerThread
from carpool.loadgen import (
    Sample,
    drive,
    first_stats,
    run,
    schedule_end,
    summarize,
    synthetic_inputs,
)
from carpool.sim.workload import Arrival, read_trace, write_trace
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.server import WorkerServer
from tests.conftest import wait_for_workers


def test_summarize_counts_only_the_window_and_checks_stability() -> None:
    samples = [Sample(t / 10, t / 10, t / 10 + 0.01, "ok", t / 10 + 0.05) for t in range(40)]
    samples[15].outcome = "DEADLINE_EXCEEDED"
    samples[30].done_s = samples[30].deadline_s + 0.01  # answered, but late
    report = summarize(samples, warmup_s=1.0, end_s=4.0, batch_sizes={})
    assert report.sent == 30  # scheduled in [1.0, 4.0)
    assert report.ok == 29
    assert report.on_time == 28
    assert report.errors == {"DEADLINE_EXCEEDED": 1}
    assert report.latency_ms["p50"] == pytest.approx(10.0)
    assert report.goodput_rps == pytest.approx(28 / 3.0)
    assert report.stable  # 14 vs 14 on time per half
    assert [s["second"] for s in report.per_second] == [0.0, 1.0, 2.0]


def test_drifting_goodput_is_flagged_unstable() -> None:
    samples = [Sample(t / 10, t / 10, t / 10 + 0.01, "ok", t / 10 + 0.05) for t in range(20)]
    for s in samples[10:]:
        s.outcome = "OVERLOADED"
    assert not summarize(samples, 0.0, 2.0, {}).stable


@pytest.mark.timeout(60)
def test_constant_load_is_sent_on_schedule_and_measured(fleet_factory: Any) -> None:
    engine = SyntheticEngine(fixed_cost_s=0.005, item_shape=(4,), max_batch=8)
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    fleet.add_worker({"syn": lambda: engine}, warmup=False)
    fleet.ready()
    rate, seconds = 100, 2.0
    arrivals = [Arrival(i / rate, "syn", (1, 4), 1000) for i in range(int(rate * seconds))]
    report = run(fleet.broker.frontend_endpoint, arrivals, synthetic_inputs(arrivals), warmup_s=0.5)
    assert report.sent == 150  # 1.5 s of a 100/s schedule after the warm-up
    assert report.ok == report.on_time == 150
    assert report.errors == {}
    # Every request spends at least the engine's 5 ms; the generator cannot report less.
    assert report.latency_ms["p50"] >= 5.0
    # The broker's batch counts cover the whole run, warm-up included.
    total = sum(k * v for k, v in report.batch_sizes["syn"].items())
    assert total == len(arrivals)


@pytest.mark.timeout(120)
def test_record_then_replay_live_and_in_the_simulator(tmp_path: Path, capsys: Any) -> None:
    trace = tmp_path / "trace.jsonl"
    config = BrokerConfig(
        frontend=f"ipc://{tmp_path}/fe",
        backend=f"ipc://{tmp_path}/be",
        batching=BatchingConfig(max_batch=8, max_wait_s=0.001),
    )
    engine = SyntheticEngine(item_shape=(16,), max_batch=8)
    broker = BrokerServer(config, record=str(trace))
    with ServerThread(broker):
        worker = WorkerServer(config.backend, {"synthetic": lambda: engine}, warmup=False)
        with ServerThread(worker), Client(config.frontend) as client:
            wait_for_workers(client, 1)
            for i in range(20):
                client.infer("synthetic", {"x": np.full((1, 16), i, np.float32)}, timeout_s=0.5)
            recorded = read_trace(trace)
            assert len(recorded) == 20
            assert {a.shape for a in recorded} == {(1, 16)}
            assert {a.timeout_ms for a in recorded} == {500}
            assert {a.max_batch for a in recorded} == {8}  # the engine's limit, for tune
            assert recorded[0].t_s == 0.0
            capsys.readouterr()
            assert main(["replay", "--trace", str(trace), "--endpoint", config.frontend]) == 0
            assert "goodput" in capsys.readouterr().out
            assert len(read_trace(trace)) == 40  # the replay was recorded too
    assert main(["replay", "--trace", str(trace), "--simulate"]) == 0
    assert "carpool (sim)" in capsys.readouterr().out
    # tune's grid stops at the recording fleet's engine limit (not at 64, a B_max the
    # fleet's engines do not take).
    assert main(["tune", "--trace", str(trace), "--top", "100"]) == 0
    out = capsys.readouterr().out
    assert "max batch 8 (as the trace recorded)" in out
    assert "B=8 " in out
    assert "B=16 " not in out
    # Times are Unix seconds, so runs appended to one file stay in order across restarts
    # and reboots (the monotonic clock starts afresh at boot and sorted them together).
    first = json.loads(trace.read_text().splitlines()[0])["t_s"]
    now_unix = wall_offset_s() + MonotonicClock().now()
    assert now_unix - 120 < first <= now_unix


@pytest.mark.timeout(60)
def test_bench_command_writes_json_and_csv(fleet_factory: Any, tmp_path: Path, capsys: Any) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    fleet.add_worker({"synthetic": lambda: SyntheticEngine(max_batch=8)}, warmup=False)
    fleet.ready()
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    code = main(
        [
            "bench",
            "--endpoint",
            fleet.broker.frontend_endpoint,
            "--load",
            "constant",
            "--rate",
            "50",
            "--duration-s",
            "1",
            "--warmup-s",
            "0.2",
            "--no-progress",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    for needle in ("throughput", "p99.9", "batches (synthetic, whole run)", "stable"):
        assert needle in text
    report = json.loads(out_json.read_text())
    assert report["sent"] == 50
    assert report["errors"] == {}
    assert out_csv.read_text().startswith("second,sent,goodput,p99_ms")


@pytest.mark.skipif(not shm_available(), reason="no usable /dev/shm")
def test_bench_command_through_shared_memory(fleet_factory: Any, tmp_path: Path) -> None:
    """`carpool bench --shared-memory-mib`: 128 KiB inputs and outputs by reference; every
    request answered, none with an error."""
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    engine = {"synthetic": lambda: SyntheticEngine(item_shape=(32768,), max_batch=8)}
    worker = fleet.add_worker(engine, warmup=False, shm_output_bytes=4 << 20)
    fleet.ready()
    code = main(
        [
            "bench",
            "--endpoint",
            fleet.broker.frontend_endpoint,
            "--load",
            "constant",
            "--rate",
            "40",
            "--shape",
            "1,32768",
            "--duration-s",
            "0.5",
            "--warmup-s",
            "0.1",
            "--no-progress",
            "--shared-memory-mib",
            "4",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["sent"] == 20  # the measured 0.5 s at 40/s
    assert report["errors"] == {}
    ring = worker._ring._ring
    assert ring is not None
    assert ring.head > 0  # outputs went through the worker's ring


# --------------------------------------------------------------------------- measuring a run


class _Answered:
    """A future answered as soon as it is polled for."""

    def __init__(self, rid: int) -> None:
        self.request_id = rid
        self.answered = False

    def done(self) -> bool:
        return self.answered

    def result(self, timeout_s: float | None = None) -> object:
        assert self.answered
        return object()


class _SlowToSend:
    """A client (our own seam) that answers every request at once, but whose sends hold
    the generator up on a fake clock: the first for ``first_s``, or each for ``each_s``."""

    def __init__(self, clock: FakeClock, first_s: float = 0.0, each_s: float = 0.0) -> None:
        self.clock, self.first_s, self.each_s = clock, first_s, each_s
        self.futures: list[_Answered] = []

    def submit(self, model: str, inputs: Any, timeout_s: Any = None, **kw: Any) -> _Answered:
        self.clock.advance(self.each_s + (self.first_s if not self.futures else 0.0))
        self.futures.append(_Answered(len(self.futures) + 1))
        return self.futures[-1]

    def poll(self, timeout_s: float | None = 0.0) -> int:
        self.clock.advance(max(1e-5, min(timeout_s or 0.0, 0.001)))  # a poll takes time
        fresh = [f for f in self.futures if not f.answered]
        for f in fresh:
            f.answered = True
        return len(fresh)


def test_latency_and_deadlines_count_from_the_time_a_request_was_due() -> None:
    """Coordinated omission: the first send holds the generator up 0.5 s; the requests
    due at 10..200 ms go out at ~0.5 s and are answered at once. Measured from their send
    they would take ~0 ms and be on time; from their schedule, as counted here, they take
    300-490 ms, all late."""
    arrivals = [Arrival(i / 100, "m", (1, 4), 100) for i in range(21)]
    inputs = [{"x": np.ones((1, 4), np.float32)}] * len(arrivals)
    clock = FakeClock()
    samples = drive(_SlowToSend(clock, first_s=0.5), arrivals, inputs, clock=clock)  # type: ignore[arg-type]
    report = summarize(samples, 0.0, 0.21, {})
    assert report.latency_ms["p50"] >= 250
    assert report.on_time <= 1
    assert report.max_send_lag_ms > 250
    assert not report.kept_up


def test_the_rate_reported_is_the_rate_delivered() -> None:
    """A generator that can send only 25/s against a 50/s schedule reports under 30/s,
    not 50/s: the rate comes from the sends, not the schedule (from which the
    load-generator check's rate row could not fail), and it did not keep up."""
    arrivals = [Arrival(i / 50, "m", (1, 4), 5000) for i in range(25)]
    inputs = [{"x": np.ones((1, 4), np.float32)}] * len(arrivals)
    clock = FakeClock()
    samples = drive(_SlowToSend(clock, each_s=0.04), arrivals, inputs, clock=clock)  # type: ignore[arg-type]
    report = summarize(samples, 0.0, 0.5, {})
    assert report.scheduled_rps == pytest.approx(50)
    assert report.sent_rps < 30
    assert report.throughput_rps < 30
    assert not report.kept_up


@pytest.mark.timeout(30)
def test_the_generator_ends_when_a_request_is_refused_at_once(
    context: zmq.Context[zmq.Socket[bytes]], nobody: str
) -> None:
    """A broker that takes nothing: the client fails a request it cannot send, and the
    future is done when submit returns. The generator collects such outcomes too, not
    only those a poll completes, so with nothing else in flight it still ends."""
    context.setsockopt(zmq.SNDHWM, 1)
    arrivals = [Arrival(0.0, "m", (1, 4), 100)] * 3 + [Arrival(0.4, "m", (1, 4), 100)]
    inputs = [{"x": np.ones((1, 4), np.float32)}] * len(arrivals)
    with Client(nobody, context=context, grace_s=0.05) as client:
        samples = drive(client, arrivals, inputs, clock=MonotonicClock())
    assert [s.outcome for s in samples] == ["UNAVAILABLE"] * 4


@pytest.mark.timeout(60)
@pytest.mark.skipif(not shm_available(), reason="no usable /dev/shm")
def test_bench_removes_its_shared_memory_region_on_sigterm(nobody: str) -> None:
    """`timeout 60 carpool bench --shared-memory-mib ...`, a CI cancel or systemd sends
    SIGTERM: bench removes its region, which would otherwise stay in /dev/shm (RAM) for
    good."""
    command = ["bench", "--endpoint", nobody, "--shared-memory-mib", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "carpool", *command, "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pattern = f"/dev/shm/carpool-{proc.pid}-*"
    try:
        for _ in range(400):  # until it has made its region (it then waits for STATS)
            if glob.glob(pattern) or proc.poll() is not None:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)
        assert glob.glob(pattern), "bench never made its region"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
        assert glob.glob(pattern) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for path in glob.glob(pattern):
            os.unlink(path)


class _WholeMilliseconds(_SlowToSend):
    """Polls that wait whole milliseconds, rounded up, as zmq_poll's timeout does."""

    def poll(self, timeout_s: float | None = 0.0) -> int:
        self.clock.advance(max(1e-5, math.ceil((timeout_s or 0.0) * 1000) / 1000))
        fresh = [f for f in self.futures if not f.answered]
        for f in fresh:
            f.answered = True
        return len(fresh)


def test_requests_go_out_on_time_though_polls_wait_whole_milliseconds() -> None:
    """A poll waits whole milliseconds, rounded up: waiting for the next send with it
    alone would send up to 1 ms late and (timed from the schedule) add that to every
    latency, +57% on the null fleet's median in the load-generator check."""
    arrivals = [Arrival(0.0123 + i * 0.0071, "m", (1, 4), 1000) for i in range(100)]
    inputs = [{"x": np.ones((1, 4), np.float32)}] * len(arrivals)
    clock = FakeClock()
    samples = drive(_WholeMilliseconds(clock), arrivals, inputs, clock=clock)  # type: ignore[arg-type]
    assert max(s.lag_s for s in samples) < 1e-4


@pytest.mark.timeout(60)
def test_a_broker_that_goes_away_mid_run_leaves_the_run_measured() -> None:
    """The final STATS goes unanswered; the report keeps what was measured (not "no
    broker answered", blamed on the endpoint) and counts every request."""
    import threading

    config = BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        batching=BatchingConfig(max_batch=8, max_wait_s=0.001),
    )
    broker_thread = ServerThread(BrokerServer(config))
    broker = broker_thread.__enter__()
    engine = {"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)}
    with ServerThread(WorkerServer(broker.backend_endpoint, engine, warmup=False)):
        with Client(broker.frontend_endpoint) as client:
            wait_for_workers(client, 1)
        endpoint = broker.frontend_endpoint
        rate = 100
        arrivals = [Arrival(i / rate, "syn", (1, 4), 300) for i in range(150)]
        gone = threading.Timer(0.5, broker_thread.__exit__, (None, None, None))
        gone.start()  # the broker stops half a second into the 1.5 s schedule
        # (The STATS after the run, never answered, waits 1 s rather than 5.)
        report = run(
            endpoint, arrivals, synthetic_inputs(arrivals), warmup_s=0.0, stats_timeout_s=1.0
        )
        gone.join()
    assert report.batch_sizes == {}  # unknown: nobody answered STATS at the end
    assert report.ok > 0  # the first half second was answered and measured
    assert report.ok + sum(report.errors.values()) == 150  # and every request is counted


# ---------------------------------------------------------------------- edges of a run


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_trace_at_one_instant_is_measured_to_its_last_answer() -> None:
    """A one-request trace's window ends at its last answer, not at its only arrival
    (an empty [0, 0), "no request was sent"): the request is counted sent and answered."""
    one = [Arrival(0.0, "m", (1, 4), 1000)]
    samples = [Sample(0.0, 0.0001, 0.004, "ok", 1.0)]
    end = schedule_end(one, samples)
    assert end == pytest.approx(0.004)  # per second of the run, as the simulator counts
    report = summarize(samples, 0.0, end, {})
    assert (report.sent, report.ok, report.on_time) == (1, 1, 1)
    assert report.stable  # one request cannot drift between halves
    burst = [Arrival(0.0, "m", (1, 4), 1000)] * 3
    samples = [Sample(0.0, 0.0001 * i, 0.006 + 0.001 * i, "ok", 1.0) for i in range(3)]
    assert summarize(samples, 0.0, schedule_end(burst, samples), {}).ok == 3
    # A trace with gaps ends one mean gap after its last arrival.
    spread = [Arrival(i / 10, "m", (1, 4), 1000) for i in range(5)]
    assert schedule_end(spread, []) == pytest.approx(0.5)


@pytest.mark.timeout(60)
def test_a_one_request_trace_replays_live(fleet_factory: Any, tmp_path: Path) -> None:
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    fleet.add_worker({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=8)})
    fleet.ready()
    trace, out = tmp_path / "one.jsonl", tmp_path / "r.json"
    write_trace(trace, [Arrival(0.0, "syn", (1, 4), 5000)])
    argv = ["replay", "--trace", str(trace), "--endpoint", fleet.broker.frontend_endpoint]
    assert main([*argv, "--json", str(out)]) == 0
    report = _strict_json(out.read_text(encoding="utf-8"))
    assert (report["sent"], report["ok"], report["on_time"]) == (1, 1, 1)
    assert report["latency_ms"]["p50"] > 0


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--timeout-ms", "0"], "--timeout-ms must be in 1..3600000, got 0"),
        (["--timeout-ms", "-5"], "--timeout-ms must be in 1..3600000, got -5"),
        (["--load", "constant", "--rate", "0"], "--rate must be more than 0, got 0"),
        (["--rate", "0"], "--rate must be more than 0"),
        (["--rate", "-5"], "--rate must be more than 0"),
        (["--rate", "nan"], "--rate must be more than 0"),
        (["--load", "bursts", "--burst-rps", "-1"], "--rate and --burst-rps must be at least 0"),
        (["--duration-s", "0"], "--duration-s must be more than 0, got 0"),
        (["--warmup-s", "-1"], "--warmup-s must be at least 0, got -1"),
        (["--shape", "0,16"], "--shape must have 1..8 dims, each at least 1"),
        (["--shape", "1,x"], "--shape must be comma-separated ints"),
        (["--model", ""], "--model must be a non-empty name"),
        (["--shared-memory-mib", "-1"], "--shared-memory-mib must be at least 0, got -1"),
        (["--rate", "0.01", "--duration-s", "1"], "the schedule has no arrival in the"),
        (  # two would go in the warm-up, none after it: refused before any is sent
            ["--load", "constant", "--rate", "1", "--warmup-s", "2", "--duration-s", "0.5"],
            "the schedule has no arrival in the",
        ),
        (["--load", "constant", "--rate", "0.05", "--duration-s", "1"], "the schedule has no"),
        (["--endpoint", "tcp://127.0.0.1"], "cannot connect to 'tcp://127.0.0.1'"),
    ],
)
def test_bench_refuses_impossible_arguments_before_sending(
    flags: list[str], says: str, nobody: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--timeout-ms 0, --load constant --rate 0, --duration-s 0 or --warmup-s -1: each is
    a usage error (exit 2) with one line, at once, not a traceback or a run that ends in
    "no request was sent" (exit 1, which reads as a dead fleet)."""
    argv = ["bench", "--endpoint", nobody, "--duration-s", "0.2", "--warmup-s", "0"]
    assert main([*argv, "--no-progress", *flags]) == 2
    captured = capsys.readouterr()
    assert f"carpool: {says}" in captured.err
    assert captured.err.count("\n") == 1
    assert captured.out == ""  # no report: nothing was sent


@pytest.mark.timeout(60)
def test_bench_writes_strict_json_and_csv_when_nothing_is_answered(
    fleet_factory: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request NOT_FOUND: the report's "p50" is null (not NaN, which is not JSON)
    and the CSV's cell is empty (not "nan")."""
    fleet = fleet_factory(max_batch=8, max_wait_s=0.001)
    fleet.add_worker({"syn": lambda: SyntheticEngine(item_shape=(16,), max_batch=8)})
    fleet.ready()
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    code = main(
        [
            "bench", "--endpoint", fleet.broker.frontend_endpoint, "--model", "nosuch",
            "--load", "constant", "--rate", "20", "--duration-s", "0.5", "--warmup-s", "0",
            "--no-progress", "--json", str(out_json), "--csv", str(out_csv),
        ]
    )  # fmt: skip
    assert code == 1
    assert "no request was answered (errors: NOT_FOUND 10)" in capsys.readouterr().err
    report = _strict_json(out_json.read_text(encoding="utf-8"))
    assert report["latency_ms"]["p50"] is None
    assert report["per_second"][0]["p99_ms"] is None
    assert out_csv.read_text().splitlines() == ["second,sent,goodput,p99_ms", "0.0,10.0,0.0,"]


class _SlowStats:
    """A client whose first ``misses`` STATS calls get no answer."""

    def __init__(self, misses: int) -> None:
        self.misses = misses
        self.calls: list[float] = []

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        self.calls.append(timeout_s)
        if len(self.calls) <= self.misses:
            raise TimeoutError("no STATS reply from the broker")
        return {"batch_sizes": {}}


def test_the_stats_before_a_run_are_asked_three_times_before_giving_up() -> None:
    late = _SlowStats(misses=2)
    assert first_stats(late, tries=3, timeout_s=3.0) == {"batch_sizes": {}}  # type: ignore[arg-type]
    assert late.calls == [3.0, 3.0, 3.0]
    gone = _SlowStats(misses=3)
    with pytest.raises(TimeoutError):
        first_stats(gone, tries=3, timeout_s=3.0)  # type: ignore[arg-type]
    assert len(gone.calls) == 3
