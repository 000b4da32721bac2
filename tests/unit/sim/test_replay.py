"""``carpool replay --simulate``: the simulated broker batches as ``carpool broker`` would,
with the same flags and defaults."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool import cli
from carpool.broker.config import BatchingConfig
from carpool.sim import workload
from carpool.sim.workload import Arrival


@pytest.fixture(autouse=True)
def restore_process_state() -> Iterator[None]:
    """cli.main installs a root log handler, quiets carpool.broker and (replay) a SIGTERM
    handler: undo all three."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    broker = logging.getLogger("carpool.broker")
    broker_level = broker.level
    sigterm = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, sigterm)
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    broker.setLevel(broker_level)


def _replay(trace: Path, tmp_path: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "replay.json"
    argv = ["--log-level", "WARNING", "replay", "--trace", str(trace), "--simulate"]
    assert cli.main([*argv, "--json", str(out), *flags]) == 0
    (row,) = json.loads(out.read_text(encoding="utf-8"))
    return dict(row)


@pytest.fixture
def burst(tmp_path: Path) -> Path:
    """2000/s for 0.2 s on an engine of 5 ms + 0.5 ms x B: a backlog builds."""
    trace = tmp_path / "burst.jsonl"
    workload.write_trace(trace, [Arrival(i / 2000, "m", (1, 16), 1000) for i in range(400)])
    return trace


def test_the_defaults_are_the_brokers() -> None:
    """replay --simulate's batching defaults are carpool broker's (BatchingConfig())."""
    args = cli.build_parser().parse_args(["replay", "--trace", "t", "--simulate"])
    defaults = BatchingConfig()
    assert args.max_batch == defaults.max_batch
    assert args.max_wait_ms / 1000 == pytest.approx(defaults.max_wait_s)
    assert args.policy == defaults.policy


def test_batches_keep_to_the_default_cap(burst: Path, tmp_path: Path) -> None:
    row = _replay(burst, tmp_path)
    assert row["policy"] == "carpool (sim)"
    assert 2 < row["mean_batch"] <= BatchingConfig().max_batch


def test_max_batch_caps_the_batches(burst: Path, tmp_path: Path) -> None:
    assert _replay(burst, tmp_path, "--max-batch", "2")["mean_batch"] <= 2


def test_policy_and_max_wait_reach_the_simulated_broker(tmp_path: Path) -> None:
    trace = tmp_path / "sparse.jsonl"
    workload.write_trace(trace, [Arrival(i / 20, "m", (1, 16), 5000) for i in range(10)])
    fixed = ["--policy", "fixed", "--max-batch", "8"]
    waits = _replay(trace, tmp_path, *fixed, "--max-wait-ms", "200")
    at_once = _replay(trace, tmp_path, *fixed, "--max-wait-ms", "0")
    assert waits["policy"] == "fixed (sim)"
    assert waits["p50_ms"] > 100  # a lone request waits T_max for company
    assert at_once["p50_ms"] < 20


@pytest.fixture
def sparse_poisson(tmp_path: Path) -> Path:
    """300/s, Poisson, for 2 s: now and then a request finds both slots taken."""
    trace = tmp_path / "poisson.jsonl"
    phases = workload.poisson(300.0, 2.0)
    workload.write_trace(trace, workload.arrivals(phases, timeout_ms=1000, seed=1))
    return trace


def test_the_workers_cpu_per_batch_and_busy_host_reach_the_simulated_fleet(
    sparse_poisson: Path, tmp_path: Path
) -> None:
    """An engine of 0.5 ms a sample and nothing fixed: batching buys nothing. The
    worker's own 2 ms per batch delays each answer; on a host 90% busy it is taken from
    the engine, so the simulated broker waits for fuller batches, as a live one would."""
    engine = ["--alpha-ms", "0", "--beta-ms", "0.5", "--jitter", "0"]
    bare = _replay(sparse_poisson, tmp_path, *engine)
    cpu = _replay(sparse_poisson, tmp_path, *engine, "--cpu-alpha-ms", "2")
    busy = _replay(
        sparse_poisson, tmp_path, *engine, "--cpu-alpha-ms", "2", "--host-busy-pct", "90"
    )
    assert bare["p50_ms"] == pytest.approx(0.5, abs=0.05)  # one sample, at once
    assert cpu["p50_ms"] >= bare["p50_ms"] + 2.0  # the RESULT leaves after the worker's CPU
    assert bare["mean_batch"] < 1.1
    assert busy["mean_batch"] > 1.5 * cpu["mean_batch"]  # batching pays on a busy host


def test_a_batchs_transfer_delays_its_answers_and_lets_batches_fill(
    sparse_poisson: Path, tmp_path: Path
) -> None:
    """A RESULT that reaches the broker 3 ms after its batch ended: each answer comes that
    much later, and the broker, which learns later that the worker is free, sends fuller
    batches (an engine with a fixed cost: batching pays)."""
    engine = ["--alpha-ms", "2", "--beta-ms", "0.2", "--jitter", "0"]
    bare = _replay(sparse_poisson, tmp_path, *engine)
    late = _replay(sparse_poisson, tmp_path, *engine, "--transfer-ms", "3")
    assert late["p50_ms"] >= bare["p50_ms"] + 3.0
    assert late["mean_batch"] > bare["mean_batch"], (late, bare)


def test_transfers_drawn_from_a_recorded_fleets_give_its_tail(
    sparse_poisson: Path, tmp_path: Path
) -> None:
    """--transfer-ms-from: each batch's RESULT is late by a delay drawn from the file's.
    All 3 ms: what --transfer-ms 3 gives; one batch in twenty 30 ms late: the tail moves
    by about that much, the median hardly."""
    engine = ["--alpha-ms", "2", "--beta-ms", "0.2", "--jitter", "0"]
    same, rare = tmp_path / "same.txt", tmp_path / "rare.txt"
    same.write_text("3\n3.0\n\n3\n", encoding="utf-8")
    rare.write_text("0\n" * 19 + "30\n", encoding="utf-8")
    bare = _replay(sparse_poisson, tmp_path, *engine)
    constant = _replay(sparse_poisson, tmp_path, *engine, "--transfer-ms", "3")
    drawn = _replay(sparse_poisson, tmp_path, *engine, "--transfer-ms-from", str(same))
    assert drawn == constant
    tail = _replay(sparse_poisson, tmp_path, *engine, "--transfer-ms-from", str(rare))
    assert tail["p99_ms"] >= bare["p99_ms"] + 20.0, (tail, bare)
    assert tail["p50_ms"] < bare["p50_ms"] + 3.0, (tail, bare)


@pytest.mark.parametrize(
    ("text", "says"),
    [("", "no values"), ("1\n-2\n", "at least 0"), ("1\nnan\n", "at least 0"), ("x\n", "x")],
)
def test_an_unusable_transfers_file_is_a_usage_error(
    burst: Path, tmp_path: Path, text: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "transfers.txt"
    path.write_text(text, encoding="utf-8")
    argv = ["replay", "--trace", str(burst), "--simulate", "--transfer-ms-from", str(path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--transfer-ms-from" in err
    assert says in err
    missing = ["replay", "--trace", str(burst), "--simulate", "--transfer-ms-from", "/nonexistent"]
    assert cli.main(missing) == 2
    assert "No such file" in capsys.readouterr().err


def test_an_invalid_max_batch_is_a_config_error(
    burst: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", str(burst), "--simulate", "--max-batch", "0"]
    assert cli.main(argv) == 2
    assert "max_batch must be in 1..4096" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--alpha-ms", "-5"], "--alpha-ms and --beta-ms must be at least 0"),
        (["--beta-ms", "-1"], "--alpha-ms and --beta-ms must be at least 0"),
        (["--alpha-ms", "nan"], "--alpha-ms and --beta-ms must be at least 0"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--max-wait-ms", "-1"], "max_wait_s must be in 0..60"),
        (["--cpu-alpha-ms", "-1"], "--cpu-beta-ms and --transfer-ms must be at least 0"),
        (["--jitter", "nan"], "--cpu-beta-ms and --transfer-ms must be at least 0"),
        (["--transfer-ms", "-1"], "--cpu-beta-ms and --transfer-ms must be at least 0"),
        (["--host-busy-pct", "101"], "--host-busy-pct must be in 0..100, got 101"),
    ],
)
def test_impossible_simulator_flags_are_a_usage_error(
    burst: Path, flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative or NaN cost, no workers or a negative wait: a usage error naming the
    flag, as carpool tune says of the same values."""
    assert cli.main(["replay", "--trace", str(burst), "--simulate", *flags]) == 2
    captured = capsys.readouterr()
    assert says in captured.err
    assert captured.out == ""  # refused before anything ran


def test_a_one_request_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One arrival is too few to simulate: a usage error, not a throughput measured
    from one request's latency."""
    trace = tmp_path / "one.jsonl"
    workload.write_trace(trace, [Arrival(0.0, "m", (1, 16), 1000)])
    assert cli.main(["replay", "--trace", str(trace), "--simulate"]) == 2
    err = capsys.readouterr().err
    assert f"trace {trace} has only 1 arrival: a simulation needs at least 2" in err


def test_a_trace_not_in_utf8_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error naming the file and line, not a UnicodeDecodeError traceback."""
    trace = tmp_path / "bin.jsonl"
    trace.write_bytes(b"\xff\xfe\n")
    assert cli.main(["replay", "--trace", str(trace), "--simulate"]) == 2
    assert f"{trace}:1: not UTF-8 text" in capsys.readouterr().err


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_of_a_replay_with_no_answers_is_strict(tmp_path: Path) -> None:
    """p50_ms is null, not NaN (which strict JSON parsers refuse)."""
    trace = tmp_path / "late.jsonl"
    workload.write_trace(trace, [Arrival(i / 10, "m", (1, 16), 1) for i in range(3)])
    out = tmp_path / "replay.json"
    argv = ["replay", "--trace", str(trace), "--simulate", "--alpha-ms", "100"]
    assert cli.main([*argv, "--json", str(out)]) == 1  # nothing answered within 1 ms
    (row,) = _strict(out.read_text(encoding="utf-8"))
    assert row["p50_ms"] is None
    assert row["p99_ms"] is None
    assert row["sent"] == 3
