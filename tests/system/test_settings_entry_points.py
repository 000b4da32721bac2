"""Settings from the environment through the real entry points (``carpool broker`` and
``carpool worker`` processes): an override takes effect, a bad value or an unknown
variable stops the process at start with a message naming it; and the broker's cap is
the one knob that binds B_max in front of a worker left at its defaults."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from tests.system.test_cli import CARPOOL, _carpool_env

_run = _carpool_env  # carpool ARGS with the environment given on top of the test's


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.terminate()
    for proc in started:
        proc.wait(timeout=15)


def _start(procs: list[subprocess.Popen[bytes]], *args: str, **env: str) -> None:
    procs.append(
        subprocess.Popen(
            [*CARPOOL, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
    )


def _stats_once_a_worker_is_in(frontend: str, procs: list[subprocess.Popen[bytes]]) -> Any:
    clock = MonotonicClock()
    until = clock.now() + 60.0
    with Client(frontend) as client:
        while clock.now() < until:
            assert all(p.poll() is None for p in procs)
            try:
                stats = client.stats(timeout_s=1.0)
            except TimeoutError:
                continue
            if stats["workers"]:
                return stats
            client.poll(0.05)
    raise AssertionError("no worker registered")


def test_environment_overrides_reach_both_processes_and_the_broker_cap_binds(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    frontend, backend = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b"
    # Endpoints and the batching cap from the environment; the flag wins over it.
    _start(
        procs, "broker", "--policy", "fixed", "--max-batch", "16",
        CARPOOL_BROKER_FRONTEND=frontend, CARPOOL_BROKER_BACKEND=backend,
        CARPOOL_BROKER_BATCHING_MAX_BATCH="4",
    )  # fmt: skip
    _start(procs, "worker", "--synthetic", "1", "0", CARPOOL_WORKER_BROKER=backend,
           CARPOOL_WORKER_NAME="named-by-env")  # fmt: skip
    stats = _stats_once_a_worker_is_in(frontend, procs)
    (worker,) = stats["workers"]
    assert worker["name"] == "named-by-env"
    # The worker took the default of its engine (any batch): the broker's 16 binds.
    assert worker["lanes"]["synthetic"]["b_max"] == 16
    assert worker["lanes"]["synthetic"]["max_batch_bound_by"] == "broker"
    assert stats["max_batch_bound_by"] == {"synthetic": "broker"}


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["broker"], {"CARPOOL_BROKER_BATCHING_MAX_BATCH": "0"}, "max_batch must be in 1..4096"),
        (["broker"], {"CARPOOL_BROKER_PEER_TIMEOUT_S": "soon"}, "not a TOML value"),
        (["worker", "--synthetic", "1", "0"], {"CARPOOL_WORKER_SLOTS": "0"}, "slots must be in"),
        (["worker"], {"CARPOOL_WORKER_HEARTBEAT_S": "true"}, "heartbeat_s: expected float"),
        (["broker"], {"CARPOOL_MAX_BATCH": "3"}, "CARPOOL_MAX_BATCH: unknown"),
        (["worker"], {"CARPOOL_WORKER_SLOT": "3"}, "CARPOOL_WORKER_SLOT: unknown"),
    ],
)
def test_a_bad_setting_stops_the_process_at_start_naming_it(
    args: list[str], env: dict[str, str], says: str
) -> None:
    result = _run(*args, **env)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert next(iter(env)) in result.stderr


def test_a_bad_set_flag_stops_the_broker_naming_the_key() -> None:
    result = _run("broker", "--set", "batching.max_wait_s=100")
    assert result.returncode == 2
    assert "max_wait_s must be in 0..60" in result.stderr
    assert "--set batching.max_wait_s" in result.stderr
