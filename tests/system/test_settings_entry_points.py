"""Settings from the environment through the real entry points (``carpool broker`` and
``carpool worker`` processes): an override takes effect, a bad value or an unknown
variable stops the process at start with a message naming it; and the broker's cap is
the one knob that binds B_max in front of a worker left at its defaults."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from tests.system.test_cli import CARPOOL, _carpool_env

_run = _carpool_env  # carpool ARGS with the environment given on top of the test's

#: Variables a user's own scripts export under CARPOOL_: no setting, nor near one.
USERS_OWN = {"CARPOOL_VENV": "/x", "CARPOOL_PROTOCOL_DOC": "/y", "CARPOOL_HOME": "/z"}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.terminate()
    for proc in started:
        proc.wait(timeout=15)


def _start(
    procs: list[subprocess.Popen[bytes]], *args: str, stderr: int = subprocess.DEVNULL, **env: str
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [*CARPOOL, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        env={**os.environ, **env},
    )
    procs.append(proc)
    return proc


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
        # A name under a role's prefix, or near a known one, beside a user's own names.
        (
            ["broker"],
            {"CARPOOL_BROKER_MAX_BACH": "4", **USERS_OWN},
            "(did you mean CARPOOL_BROKER_BATCHING_MAX_BATCH?)",
        ),
        (
            ["broker"],
            {"CARPOOL_LOGLEVEL": "DEBUG", **USERS_OWN},
            "(did you mean CARPOOL_LOG_LEVEL?)",
        ),
        (["worker"], {"CARPOOL_LOGLEVEL": "DEBUG"}, "(did you mean CARPOOL_LOG_LEVEL?)"),
    ],
)
def test_a_bad_setting_stops_the_process_at_start_naming_it(
    args: list[str], env: dict[str, str], says: str
) -> None:
    result = _run(*args, **env)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert next(iter(env)) in result.stderr
    assert not set(USERS_OWN) & set(re.findall(r"CARPOOL_\w+", result.stderr))


@pytest.mark.timeout(60)
def test_a_users_own_carpool_variables_leave_the_broker_running_with_one_warning_each(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Names under CARPOOL_ that are no setting nor near one (a user's scripts' own) are
    the user's: the broker starts, answers and stops as without them, and says once
    each that it ignores them."""
    any_port = "tcp://127.0.0.1:0"
    broker = _start(
        procs, "broker", "--frontend", any_port, "--backend", any_port,
        stderr=subprocess.PIPE, **USERS_OWN,
    )  # fmt: skip
    assert broker.stderr is not None
    log, listening = "", None
    for line in broker.stderr:  # (EOF, and the loop's end, if the broker exits)
        log += line.decode()
        listening = re.search(r"broker listening frontend=(\S+)", log)
        if listening:
            break
    assert listening, f"the broker did not start (exit {broker.wait()}):\n{log}"
    with Client(listening[1]) as client:
        assert client.stats(timeout_s=10.0)["workers"] == []
    broker.terminate()
    log += broker.communicate(timeout=15)[1].decode()
    assert broker.returncode == 0, log
    for name in USERS_OWN:
        (said,) = (line for line in log.splitlines() if name in line)
        assert f"WARNING carpool: {name}: not a carpool setting" in said, log


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_name_meant_as_a_setting_stops_up_and_demo_before_their_children(
    command: str, tmp_path: Path
) -> None:
    """They start broker and worker processes with their environment: a name those would
    refuse stops them at once (not a broker exiting 2 at each restart)."""
    where = ["--frontend", f"ipc://{tmp_path}/f", "--backend", f"ipc://{tmp_path}/b"]
    result = _run(command, *(where if command == "up" else ()), CARPOOL_LOGLEVEL="DEBUG")
    assert result.returncode == 2, result.stderr
    assert "CARPOOL_LOGLEVEL: unknown carpool environment variable" in result.stderr
    assert "carpool up: broker at" not in result.stdout


def test_a_bad_set_flag_stops_the_broker_naming_the_key() -> None:
    result = _run("broker", "--set", "batching.max_wait_s=100")
    assert result.returncode == 2
    assert "max_wait_s must be in 0..60" in result.stderr
    assert "--set batching.max_wait_s" in result.stderr
