"""workload.py: arrival schedules and JSON-lines traces.

Rates are checked against Poisson counts: a window expecting N arrivals holds N ± ~√N,
so each tolerance below is at least four standard deviations wide.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

from carpool.common.errors import ConfigError
from carpool.sim import workload
from carpool.sim.workload import Arrival, Phase


def count_between(items: list[Arrival], start: float, end: float) -> int:
    return sum(1 for a in items if start <= a.t_s < end)


def assert_rate(count: int, rate_rps: float, duration_s: float) -> None:
    expected = rate_rps * duration_s
    assert abs(count - expected) <= max(5.0, 4.5 * math.sqrt(expected)), (count, expected)


# --------------------------------------------------------------------------- phases


def test_poisson_is_one_phase() -> None:
    assert workload.poisson(250.0, 4.0) == [Phase(4.0, 250.0)]


def test_steps_are_one_phase_per_rate() -> None:
    assert workload.steps([200, 1400, 300], 2.5) == [
        Phase(2.5, 200),
        Phase(2.5, 1400),
        Phase(2.5, 300),
    ]


@pytest.mark.parametrize(
    ("duration_s", "period_s", "burst_s", "expected"),
    [
        # quiet 1.7 s, burst 0.3 s, twice
        (4.0, 2.0, 0.3, [(1.7, 100), (0.3, 900), (1.7, 100), (0.3, 900)]),
        # the last period is cut short inside its quiet part
        (3.0, 2.0, 0.5, [(1.5, 100), (0.5, 900), (1.0, 100)]),
        # ... or inside its burst
        (3.8, 2.0, 0.5, [(1.5, 100), (0.5, 900), (1.5, 100), (0.3, 900)]),
    ],
)
def test_bursts(
    duration_s: float, period_s: float, burst_s: float, expected: list[tuple[float, float]]
) -> None:
    phases = workload.bursts(100, 900, duration_s, period_s, burst_s)
    assert [p.rate_rps for p in phases] == [r for _, r in expected]
    assert [p.duration_s for p in phases] == pytest.approx([d for d, _ in expected])
    assert sum(p.duration_s for p in phases) == pytest.approx(duration_s)


@pytest.mark.parametrize("pieces", [4, 12, 24])
def test_diurnal_is_a_sinusoid_between_low_and_high(pieces: int) -> None:
    phases = workload.diurnal(100.0, 1400.0, 6.0, pieces)
    assert len(phases) == pieces
    assert sum(p.duration_s for p in phases) == pytest.approx(6.0)
    rates = [p.rate_rps for p in phases]
    assert all(100.0 <= r <= 1400.0 for r in rates)
    # Night at both ends, peak in the middle, symmetric; the mean is the midpoint.
    assert rates[0] == min(rates) == pytest.approx(rates[-1])
    assert max(rates) == pytest.approx(rates[pieces // 2 - 1]) == pytest.approx(rates[pieces // 2])
    assert sum(rates) / pieces == pytest.approx(750.0)
    assert rates == pytest.approx(rates[::-1])


# --------------------------------------------------------------------------- arrivals


PATTERNS = {
    "poisson": workload.poisson(800.0, 5.0),
    "steps": workload.steps([200, 1400, 300], 2.0),
    "bursts": workload.bursts(300, 2500, 4.0, 2.0, 0.3),
    "diurnal": workload.diurnal(100, 1400, 6.0),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_arrivals_are_deterministic_per_seed(name: str) -> None:
    phases = PATTERNS[name]
    first = workload.arrivals(phases, seed=7, bulk_share=0.3)
    assert first == workload.arrivals(phases, seed=7, bulk_share=0.3)
    other = workload.arrivals(phases, seed=8, bulk_share=0.3)
    assert other != first
    assert [a.t_s for a in other] != [a.t_s for a in first]


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_arrivals_follow_the_phase_rates(name: str) -> None:
    phases = PATTERNS[name]
    items = workload.arrivals(phases, seed=3)
    times = [a.t_s for a in items]
    assert times == sorted(times)
    total_s = sum(p.duration_s for p in phases)
    assert times[0] > 0.0
    assert times[-1] < total_s
    start = 0.0
    for phase in phases:
        assert_rate(count_between(items, start, start + phase.duration_s), *astuple(phase))
        start += phase.duration_s
    expected_total = sum(p.rate_rps * p.duration_s for p in phases)
    assert_rate(len(items), expected_total / total_s, total_s)


def astuple(phase: Phase) -> tuple[float, float]:
    return phase.rate_rps, phase.duration_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_mean_rate(seed: int) -> None:
    items = workload.arrivals(workload.poisson(1000.0, 10.0), seed=seed)
    assert len(items) / 10.0 == pytest.approx(1000.0, rel=0.05)
    # Exponential gaps: mean 1 ms, and the std equals the mean.
    gaps = [b.t_s - a.t_s for a, b in itertools.pairwise(items)]
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(0.001, rel=0.05)
    assert std == pytest.approx(mean, rel=0.1)


def test_zero_rate_phase_has_no_arrivals_but_keeps_time() -> None:
    items = workload.arrivals([Phase(1.0, 0.0), Phase(1.0, 500.0)], seed=0)
    assert count_between(items, 0.0, 1.0) == 0
    assert_rate(count_between(items, 1.0, 2.0), 500.0, 1.0)


@pytest.mark.parametrize("bulk_share", [0.0, 0.25, 1.0])
def test_arrival_fields(bulk_share: float) -> None:
    items = workload.arrivals(
        workload.poisson(2000.0, 2.0),
        model="resnet",
        shape=(2, 3, 8),
        timeout_ms=75,
        bulk_share=bulk_share,
        seed=5,
    )
    assert {(a.model, a.shape, a.timeout_ms) for a in items} == {("resnet", (2, 3, 8), 75)}
    assert {a.priority for a in items} <= {0, 1}
    bulk = sum(a.priority for a in items)
    expected = bulk_share * len(items)
    assert abs(bulk - expected) <= 4.5 * math.sqrt(len(items) * 0.25) + 1


def test_duration_of() -> None:
    assert workload.duration_of([]) == 0.0
    items = workload.arrivals(workload.poisson(100.0, 1.0), seed=0)
    assert workload.duration_of(items) == items[-1].t_s


# --------------------------------------------------------------------------- traces


def test_trace_round_trip(tmp_path: Path) -> None:
    items = workload.arrivals(workload.steps([300, 900], 0.5), bulk_share=0.5, seed=11)
    path = tmp_path / "trace.jsonl"
    workload.write_trace(path, items)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(items)
    assert json.loads(lines[0]).keys() == {"t_s", "model", "shape", "timeout_ms", "priority"}
    back = workload.read_trace(path)
    assert len(back) == len(items)
    # read_trace makes times relative to the first arrival; write_trace keeps 1 µs.
    assert_same(back, items, items[0].t_s)
    assert back[0].t_s == 0.0
    # Written again, it reads back the same.
    again = tmp_path / "again.jsonl"
    workload.write_trace(again, back)
    assert_same(workload.read_trace(again), back, 0.0)


def assert_same(got: list[Arrival], want: list[Arrival], t0: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.t_s == pytest.approx(w.t_s - t0, abs=2e-6)
        assert (g.model, g.shape, g.timeout_ms, g.priority) == (
            w.model,
            w.shape,
            w.timeout_ms,
            w.priority,
        )


def test_read_trace_sorts_defaults_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"t_s": 5.5, "model": "b", "shape": [2, 4], "timeout_ms": 30}\n'
        "\n"
        '{"t_s": 5.0, "model": "a", "shape": [1, 4], "timeout_ms": 20, "priority": 1}\n'
        "   \n",
        encoding="utf-8",
    )
    assert workload.read_trace(path) == [
        Arrival(0.0, "a", (1, 4), 20, 1),
        Arrival(0.5, "b", (2, 4), 30, 0),
    ]


def test_read_empty_trace(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("", encoding="utf-8")
    assert workload.read_trace(path) == []


GOOD = '{"t_s": 0.0, "model": "m", "shape": [1, 4], "timeout_ms": 50}'


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        '{"t_s": 0.1, "model": "m", "shape": [1, 4]}',  # no timeout_ms
        '{"model": "m", "shape": [1, 4], "timeout_ms": 50}',  # no t_s
        '{"t_s": "soon", "model": "m", "shape": [1, 4], "timeout_ms": 50}',
        '{"t_s": 0.1, "model": "m", "shape": 4, "timeout_ms": 50}',
        '{"t_s": 0.1, "model": "m", "shape": ["a"], "timeout_ms": 50}',
        '{"t_s": 0.1, "model": "m", "shape": [1, 4], "timeout_ms": null}',
        '{"t_s": 0.1, "model": "m", "shape": [1, 4], "timeout_ms": 50, "priority": "hi"}',
        "[0.1, 1, 4]",
        "null",
        '"a string"',
    ],
)
def test_malformed_trace_line_names_the_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n{bad}\n{GOOD}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not a trace line") as info:
        workload.read_trace(path)
    assert f"{path}:4:" in str(info.value)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(
            '{"t_s": 0.1, "model": "m", "shape": [1, 4], "timeout_ms": 50, "priority": 2}',
            id="priority-2",
        ),
        pytest.param('{"t_s": 0.1, "model": "m", "shape": [-1, 4], "timeout_ms": 50}', id="dim-1"),
        pytest.param('{"t_s": 0.1, "model": "m", "shape": [], "timeout_ms": 50}', id="rank-0"),
        pytest.param(
            '{"t_s": 0.1, "model": "m", "shape": [1, 4], "timeout_ms": 0}', id="timeout-0"
        ),
        pytest.param('{"t_s": "nan", "model": "m", "shape": [1, 4], "timeout_ms": 50}', id="t-nan"),
    ],
)
def test_out_of_range_trace_line_names_the_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n{bad}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=":2:"):
        workload.read_trace(path)


def test_missing_trace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read trace"):
        workload.read_trace(tmp_path / "nope.jsonl")


def test_a_trace_not_in_utf8_is_a_config_error_naming_the_line(tmp_path: Path) -> None:
    """A ConfigError with the file and line (a usage error for tune, replay and bench
    --trace), not a UnicodeDecodeError traceback."""
    path = tmp_path / "bin.jsonl"
    path.write_bytes(f"{GOOD}\n".encode() + b"\xff\xfe\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: not UTF-8 text")):
        workload.read_trace(path)


def test_load_trace_refuses_too_few_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError, match="has no arrivals"):
        workload.load_trace(path)
    path.write_text(f"{GOOD}\n", encoding="utf-8")
    assert len(workload.load_trace(path)) == 1
    with pytest.raises(ConfigError, match="has only 1 arrival: a simulation needs at least 2"):
        workload.load_trace(path, 2)
    path.write_text(f"{GOOD}\n{GOOD}\n", encoding="utf-8")
    assert len(workload.load_trace(path, 2)) == 2


def test_load_trace_warns_of_a_long_pause(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`carpool record` appends: two runs in one file read as one run with a long idle
    stretch, and tune's rates count it. A pause of a minute or more is pointed out."""
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"t_s": t, "model": "m", "shape": [1, 4], "timeout_ms": 100})
        for t in (1000.0, 1000.5, 1059.0, 1200.0, 1200.5)
    ]
    path.write_text("\n".join(lines[:3]) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="carpool.sim.workload"):
        workload.load_trace(path)
    assert caplog.records == []  # 58.5 s: under a minute
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="carpool.sim.workload"):
        workload.load_trace(path)
    (record,) = caplog.records
    assert "has no arrival for 141 s (from 59.0 s in)" in record.getMessage()


def test_a_last_line_cut_short_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A recording killed mid-line: the cut line is lost, not the whole trace."""
    path = tmp_path / "cut.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n" + GOOD[:20], encoding="utf-8")
    assert len(workload.read_trace(path)) == 2
    assert "cut short" in caplog.text


def test_a_recording_appended_to_a_cut_trace_starts_on_a_line_of_its_own(
    tmp_path: Path,
) -> None:
    """The cut part is dropped when the next broker opens the trace, so the next run's
    first line is not glued to it and the file stays readable."""
    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer

    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD}\n" + GOOD[:20], encoding="utf-8")
    config = BrokerConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be")
    BrokerServer(config, record=str(path)).close()
    assert path.read_text(encoding="utf-8") == f"{GOOD}\n"  # the cut part is dropped
    with path.open("a", encoding="utf-8") as f:  # what the new run writes next
        f.write(f"{GOOD}\n")
    assert len(workload.read_trace(path)) == 2


def test_a_recorded_engine_limit_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    workload.write_trace(path, [workload.Arrival(0.0, "m", (1, 4), 50, 0, 32)] * 2)
    items = workload.read_trace(path)
    assert workload.engine_limit(items) == 32
    assert workload.engine_limit([workload.Arrival(0.0, "m", (1, 4), 50)]) is None


def _recording_broker(tmp_path: Path, trace: str, name: str = "b") -> Any:
    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer

    config = BrokerConfig(
        frontend=f"ipc://{tmp_path}/{name}-fe", backend=f"ipc://{tmp_path}/{name}-be"
    )
    return BrokerServer(config, record=trace)


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}", encoding="utf-8")
    _recording_broker(tmp_path, str(path)).close()
    assert path.read_text(encoding="utf-8") == f"{GOOD}\n{GOOD}\n"


def test_a_trace_can_be_a_pipe(tmp_path: Path) -> None:
    """--record /dev/stdout | cat: trimming a cut line needs a seek, and a pipe has none;
    the broker starts and records to it all the same (no io.UnsupportedOperation)."""
    read_end, write_end = os.pipe()
    try:
        _recording_broker(tmp_path, f"/proc/self/fd/{write_end}").close()
    finally:
        os.close(read_end)
        os.close(write_end)


def test_two_brokers_cannot_record_to_one_trace_at_once(tmp_path: Path) -> None:
    """Their lines would interleave, and one's start would trim the other's line in
    progress as if it were cut."""
    path = str(tmp_path / "trace.jsonl")
    first = _recording_broker(tmp_path, path, "one")
    try:
        with pytest.raises(ConfigError, match="another broker is recording to it"):
            _recording_broker(tmp_path, path, "two")
    finally:
        first.close()
    _recording_broker(tmp_path, path, "three").close()  # free again once the first closed


def test_a_broker_that_cannot_bind_lets_go_of_its_trace(tmp_path: Path) -> None:
    """The trace is closed and unlocked before the error leaves the constructor, so a
    retry within the except block (or with the exception kept) may record to it."""
    import zmq

    from carpool.broker.config import BrokerConfig
    from carpool.broker.server import BrokerServer

    path = str(tmp_path / "trace.jsonl")
    taken: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        config = BrokerConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"tcp://127.0.0.1:{port}")
        with pytest.raises(ConfigError, match="cannot bind") as failed:
            BrokerServer(config, record=path)
        _recording_broker(tmp_path, path, "retry").close()
        assert failed.value is not None  # (kept alive until here)
    finally:
        taken.close(linger=0)


def test_a_trace_on_a_file_system_without_locks_is_recorded_unlocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flock failing otherwise than 'held' (ENOLCK on NFS without lockd): the trace is
    recorded without a lock, and the log says so."""
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    _recording_broker(tmp_path, str(tmp_path / "trace.jsonl")).close()
    assert "not locked" in caplog.text
