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
    """It simulated BatchingConfig(max_batch=64); carpool broker's default is 8."""
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


def test_an_invalid_max_batch_is_a_config_error(
    burst: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", str(burst), "--simulate", "--max-batch", "0"]
    assert cli.main(argv) == 2
    assert "max_batch must be in 1..4096" in capsys.readouterr().err
