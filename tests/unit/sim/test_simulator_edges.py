"""The simulator and ``carpool tune`` at their edges: mixed models, traces at one instant,
long timeouts, unsorted arrivals, empty workloads, impossible settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool.broker.config import BatchingConfig
from carpool.cli import main
from carpool.common.errors import ConfigError
from carpool.sim.compare import grid_search
from carpool.sim.simulator import EngineCost, SimWorker, simulate
from carpool.sim.workload import Arrival, read_trace

GPU = [SimWorker("w", EngineCost(0.005, 0.0005))]
FIXED = BatchingConfig(max_batch=8, max_wait_s=0.002, policy="fixed")


def test_models_of_different_ranks_are_all_served() -> None:
    """Each model is declared with its own rank, so requests of two models of different
    ranks are all served (none INVALID_ARGUMENT), as a live fleet serves them."""
    arrivals = [
        Arrival(0.01 * i, "vec" if i % 2 else "img", (1, 16) if i % 2 else (1, 3, 8, 8), 50)
        for i in range(20)
    ]
    result = simulate(arrivals, GPU, FIXED)
    assert dict(result.errors) == {}
    assert result.on_time == 20


def test_tune_ranks_by_answers_in_time_on_a_trace_at_one_instant() -> None:
    """100 requests at one instant: the goodput of a zero span is still positive, and the
    best-ranked setting is one that answers the most requests in time."""
    arrivals = [Arrival(0.0, "m", (1, 16), 50) for _ in range(100)]
    points = grid_search(arrivals, GPU)
    assert points[0].result.on_time == max(p.result.on_time for p in points)
    assert points[0].result.goodput_rps > 0


def test_a_single_arrival_answered_in_time_has_a_goodput() -> None:
    result = simulate([Arrival(0.0, "m", (1, 16), 50)], GPU, FIXED)
    assert result.on_time == 1
    assert result.goodput_rps > 0


def test_requests_with_long_timeouts_are_answered_past_a_minute() -> None:
    """The run lasts until every request is answered, even a minute or more after the
    last arrival: none is NO_REPLY."""
    arrivals = [Arrival(0.0, "m", (1, 16), 600_000) for _ in range(200)]
    slow = [SimWorker("w", EngineCost(1.0, 0.0))]
    result = simulate(arrivals, slow, BatchingConfig(max_batch=1, max_wait_s=0.0, policy="fixed"))
    assert "NO_REPLY" not in result.errors
    assert result.on_time == 200


def test_unsorted_arrivals_do_not_run_time_backwards() -> None:
    arrivals = [Arrival(0.01 * i, "m", (1, 16), 50) for i in range(10)]
    result = simulate(arrivals[::-1], GPU, FIXED)
    assert result.span_s > 0
    assert min(result.latencies_s) >= 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rate", "0"], "has 0 arrivals"),
        (["--load", "steps", "--rates", "0,0"], "has 0 arrivals"),
        # Seed 1 draws one arrival in a second at 1/s: no rate to report (as a trace).
        (["--rate", "1", "--duration-s", "1", "--seed", "1"], "has 1 arrival;"),
    ],
    ids=["rate", "steps", "one"],
)
def test_simulate_refuses_an_empty_workload(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No arrival, or one, is a usage error: no IndexError traceback, and no rate
    reported from a single arrival."""
    assert main(["simulate", "--no-oracle", *args]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert "a simulation needs at least 2" in err


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    lines = [{"t_s": 0.01 * i, "model": "m", "shape": [1, 16], "timeout_ms": 50} for i in range(5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "extra",
    [
        ["--engine-max-batch", "0"],
        ["--workers", "0"],
        ["--slots", "0"],
        ["--sla-ms", "0"],
        ["--alpha-ms", "-5"],
        ["--beta-ms", "nan"],
        ["--top", "0"],
        ["--top", "-2"],
    ],
)
def test_tune_refuses_impossible_settings(
    tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each is a usage error (exit 2, "must be at least"), never a traceback or a
    recommended setting that misses every deadline."""
    assert main(["tune", "--trace", str(_trace(tmp_path)), *extra]) == 2
    assert "must be at least" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["tune"], ["simulate", "--no-oracle"]])
def test_a_one_request_trace_is_refused(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One arrival is too few to measure a throughput from: a usage error, and no
    setting is recommended."""
    path = tmp_path / "one.jsonl"
    path.write_text('{"t_s": 0.0, "model": "m", "shape": [1, 16], "timeout_ms": 50}\n')
    assert main([*command, "--trace", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"trace {path} has only 1 arrival: a simulation needs at least 2" in captured.err
    assert "recommended" not in captured.out


def test_simulate_json_is_strict_when_nothing_is_answered(tmp_path: Path) -> None:
    """p50_ms and the like are null, not NaN (which strict JSON parsers refuse)."""
    out = tmp_path / "sim.json"
    argv = ["simulate", "--no-oracle", "--rate", "50", "--duration-s", "0.5"]
    assert main([*argv, "--alpha-ms", "1000", "--sla-ms", "5", "--json", str(out)]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    rows = json.loads(out.read_text(encoding="utf-8"), parse_constant=refuse)
    assert rows
    assert all(row["p50_ms"] is None and row["p99_ms"] is None for row in rows)


def test_tune_recommends_nothing_when_nothing_is_answered_in_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", "--trace", str(_trace(tmp_path)), "--alpha-ms", "100"]) == 1
    assert "nothing to recommend" in capsys.readouterr().out


def test_a_trace_shape_must_be_a_list(tmp_path: Path) -> None:
    """A string such as "16" is a ConfigError, not read as one dim per character."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"t_s": 0, "model": "m", "shape": "16", "timeout_ms": 50}\n')
    with pytest.raises(ConfigError, match="shape"):
        read_trace(path)


@pytest.mark.parametrize(
    ("period_s", "burst_s"),
    [(0.0, 0.0), (-1.0, 0.1), (0.2, 0.3)],
    ids=["zero", "negative", "short"],
)
def test_bursts_need_a_period_that_holds_its_burst(
    period_s: float, burst_s: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """A period of 0 (phases without end) or one shorter than its burst (quiet phases
    of negative length, arrivals before time 0) is a usage error."""
    args = ["--load", "bursts", "--period-s", str(period_s), "--burst-s", str(burst_s)]
    assert main(["simulate", "--no-oracle", "--duration-s", "1", *args]) == 2
    assert "bursts need" in capsys.readouterr().err


def test_the_grid_tries_the_engines_own_limit() -> None:
    """An engine of 48 is tried at 48 too, not only at the powers of two below it."""
    arrivals = [Arrival(0.001 * i, "m", (1, 16), 50) for i in range(50)]
    workers = [SimWorker("w", EngineCost(0.005, 0.0005), max_batch=48)]
    sizes = {p.max_batch for p in grid_search(arrivals, workers)}
    assert sizes == {1, 2, 4, 8, 16, 32, 48}


def test_simulate_applies_sla_ms_to_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--sla-ms applies with --trace too: at 1 ms most requests miss, at 1000 ms none."""
    trace = _trace(tmp_path)
    rows = []
    for sla in ("1000", "1"):
        out = tmp_path / f"sim-{sla}.json"
        argv = ["simulate", "--no-oracle", "--trace", str(trace), "--sla-ms", sla]
        assert main([*argv, "--json", str(out)]) == 0
        rows.append({r["policy"]: r for r in json.loads(out.read_text())})
    assert rows[0]["carpool"]["miss_rate"] == 0.0
    assert rows[1]["carpool"]["miss_rate"] > 0.5


@pytest.mark.parametrize("command", [["tune"], ["simulate", "--no-oracle"]])
def test_an_sla_over_the_protocols_limit_is_refused(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An SLA past the protocol's limit is a usage error, not a run in which every
    simulated request is refused INVALID_ARGUMENT."""
    argv = [*command, "--trace", str(_trace(tmp_path)), "--sla-ms", "3600001"]
    assert main(argv) == 2
    assert "--sla-ms must be at least 1 and at most 3600000" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rate", "--duration-s"])
def test_an_infinite_workload_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An infinite rate or duration is a usage error, not a run without end."""
    assert main(["simulate", "--no-oracle", flag, "inf"]) == 2
    assert "must be finite" in capsys.readouterr().err


def test_tune_says_why_nothing_was_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Requests of 4 samples on an engine of 2: every one is refused INVALID_ARGUMENT,
    and the report names those errors."""
    path = tmp_path / "big.jsonl"
    lines = [{"t_s": 0.01 * i, "model": "m", "shape": [4, 16], "timeout_ms": 50} for i in range(5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["tune", "--trace", str(path), "--engine-max-batch", "2"]) == 1
    assert "the best setting's errors: INVALID_ARGUMENT 5" in capsys.readouterr().out


def test_replay_in_the_simulator_takes_an_engine_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """replay --simulate takes --engine-max-batch, as the README says."""
    trace = str(_trace(tmp_path))
    assert main(["replay", "--trace", trace, "--simulate", "--engine-max-batch", "2"]) == 0
    assert main(["replay", "--trace", trace, "--simulate", "--engine-max-batch", "0"]) == 2
    assert "--engine-max-batch must be at least 1" in capsys.readouterr().err
