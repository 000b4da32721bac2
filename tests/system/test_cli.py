"""The ``carpool`` command: help, config errors, and a broker and worker as subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.worker.engines.synthetic import synthetic_output

CARPOOL = [sys.executable, "-m", "carpool"]
STOP_TIMEOUT_S = 10.0

Spawn = Callable[..., subprocess.Popen[bytes]]


def _carpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CARPOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``carpool ARGS...`` subprocesses (stderr to a log file under tmp_path); at
    teardown, SIGTERM those still running, then SIGKILL any that outlive the timeout."""
    started: list[subprocess.Popen[bytes]] = []
    logs = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{len(started)}-{args[0]}.log", "wb")  # noqa: SIM115
        logs.append(log)
        proc = subprocess.Popen(
            [*CARPOOL, *args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for log in logs:
        log.close()


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("*.log")))


def test_help_lists_the_commands() -> None:
    result = _carpool("--help")
    assert result.returncode == 0, result.stderr
    for command in ("broker", "worker", "demo"):
        assert command in result.stdout


def test_broker_help_lists_its_flags() -> None:
    result = _carpool("broker", "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--frontend", "--backend", "--local", "--max-batch", "--max-wait-ms", "--config"):
        assert flag in result.stdout


def test_an_unknown_model_is_a_config_error(tmp_path: Path) -> None:
    result = _carpool("worker", "--broker", f"ipc://{tmp_path}/backend", "--model", "nosuchmodel")
    assert result.returncode == 2
    assert "unknown model 'nosuchmodel'" in result.stderr
    assert "orientation" in result.stderr  # says what the catalogue has
    assert "Traceback" not in result.stderr


def test_an_invalid_worker_setting_is_a_config_error(tmp_path: Path) -> None:
    result = _carpool("worker", "--broker", f"ipc://{tmp_path}/b", "--slots", "0")
    assert result.returncode == 2
    assert "slots must be in 1..1024" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["broker", "--frontend", "tcp://127.0.0.1", "--backend", "tcp://127.0.0.1:*"], "bind"),
        (["worker", "--broker", "tcp://127.0.0.1", "--synthetic", "0", "0"], "connect to"),
    ],
    ids=["broker", "worker"],
)
def test_a_malformed_endpoint_is_a_config_error(args: list[str], says: str) -> None:
    """It was a zmq.ZMQError with a traceback and exit 1."""
    result = _carpool(*args)
    assert result.returncode == 2, result.stderr
    assert f"cannot {says} 'tcp://127.0.0.1'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_the_wire_cannot_carry_is_a_config_error(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('[[models]]\nname = "m"\nengine = "synthetic"\ndtype = "complex64"\n')
    result = _carpool("worker", "--broker", f"ipc://{tmp_path}/b", "--config", str(toml))
    assert result.returncode == 2, result.stderr
    assert "dtype must be one of" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(90)
def test_broker_and_worker_processes_serve_and_stop(tmp_path: Path, spawn: Spawn) -> None:
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--max-wait-ms", "1")
    worker = spawn("worker", "--broker", backend, "--synthetic", "1", "0.1", "--name", "w0")

    with Client(frontend, default_timeout_s=5.0) as client:
        clock = MonotonicClock()
        until = clock.now() + 60.0
        while True:
            assert broker.poll() is None, _logs(tmp_path)
            assert worker.poll() is None, _logs(tmp_path)
            assert clock.now() < until, "the worker never registered\n" + _logs(tmp_path)
            try:
                workers = client.stats(timeout_s=1.0)["workers"]
            except TimeoutError:
                continue  # the broker is still starting
            if [w["name"] for w in workers] == ["w0"]:
                break
            client.poll(0.05)
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        result = client.submit("synthetic", {"x": x}, timeout_s=5.0).result()
    np.testing.assert_array_equal(result["y"], synthetic_output(x))
    assert result.batch_size == 2

    worker.terminate()
    assert worker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)
    broker.terminate()
    assert broker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)


@pytest.mark.timeout(60)
def test_sigusr1_dumps_the_stacks_and_the_broker_goes_on(tmp_path: Path, spawn: Spawn) -> None:
    """What a broker that will not stop is doing: SIGUSR1 writes every thread's stack
    to stderr (the journal, under systemd); the broker keeps serving."""
    frontend = f"ipc://{tmp_path}/frontend"
    broker = spawn("broker", "--frontend", frontend, "--backend", f"ipc://{tmp_path}/backend")
    with Client(frontend, default_timeout_s=5.0) as client:
        clock = MonotonicClock()
        until = clock.now() + 30.0
        while True:  # up and serving (its handlers are installed before it serves)
            assert broker.poll() is None, _logs(tmp_path)
            assert clock.now() < until, "the broker never answered\n" + _logs(tmp_path)
            try:
                client.stats(timeout_s=1.0)
                break
            except TimeoutError:
                continue
        broker.send_signal(signal.SIGUSR1)
        until = clock.now() + 10.0
        while "in serve" not in _logs(tmp_path):
            assert clock.now() < until, "no stack dump\n" + _logs(tmp_path)
            client.poll(0.05)
        assert "Current thread" in _logs(tmp_path)
        assert broker.poll() is None
        assert client.stats(timeout_s=5.0)["workers"] == []  # still serving
    broker.terminate()
    assert broker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)


def test_a_broker_with_an_embedded_worker(tmp_path: Path, spawn: Spawn) -> None:
    frontend = f"ipc://{tmp_path}/frontend"
    broker = spawn(
        "broker", "--frontend", frontend, "--backend", f"ipc://{tmp_path}/backend",
        "--embed-synthetic", "0", "0",
    )  # fmt: skip
    with Client(frontend, default_timeout_s=5.0) as client:
        clock = MonotonicClock()
        until = clock.now() + 60.0
        while True:
            assert broker.poll() is None, _logs(tmp_path)
            assert clock.now() < until, "no embedded worker\n" + _logs(tmp_path)
            try:
                if [w["name"] for w in client.stats(timeout_s=1.0)["workers"]] == ["embedded"]:
                    break
            except TimeoutError:
                continue
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        np.testing.assert_array_equal(client.infer("synthetic", {"x": x})["y"], synthetic_output(x))
    broker.terminate()
    assert broker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)


def test_sigterm_stops_a_broker_promptly_while_an_embedded_batch_runs(
    tmp_path: Path, spawn: Spawn
) -> None:
    """The embedded worker's close() waited up to 30 s for a batch whose result nobody
    could receive any more (the broker's sockets were closed first), past the broker
    unit's TimeoutStopSec=10s. It now waits 2 s."""
    frontend = f"ipc://{tmp_path}/frontend"
    broker = spawn(
        "broker",
        "--frontend",
        frontend,
        "--backend",
        f"ipc://{tmp_path}/backend",
        "--embed-synthetic",
        "8000",
        "0",
    )  # fmt: skip (a batch takes 8 s; the warm-up runs one)
    with Client(frontend, default_timeout_s=30.0) as client:
        clock = MonotonicClock()
        until = clock.now() + 60.0
        running = False
        while not running:
            assert broker.poll() is None, _logs(tmp_path)
            assert clock.now() < until, "the batch never started\n" + _logs(tmp_path)
            try:
                workers = client.stats(timeout_s=1.0)["workers"]
            except TimeoutError:
                continue
            if workers and not any(w["outstanding"] for w in workers):
                client.submit("synthetic", {"x": np.ones((1, 16), np.float32)}, timeout_s=30.0)
            running = any(w["outstanding"] for w in workers)
        started = clock.now()
        broker.terminate()
        assert broker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)
        assert clock.now() - started < 5.0, _logs(tmp_path)
