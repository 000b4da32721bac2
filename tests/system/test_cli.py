"""The ``carpool`` command: help, config errors, and a broker and worker as subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.cli import build_parser
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.worker.engines.synthetic import synthetic_output
from carpool.worker.models import locate

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


def _until_registered(
    client: Client,
    broker: subprocess.Popen[bytes],
    worker: subprocess.Popen[bytes],
    tmp_path: Path,
) -> list[dict[str, Any]]:
    """Wait (at most 60 s) until the broker lists a worker; its STATS ``workers``."""
    clock = MonotonicClock()
    until = clock.now() + 60.0
    while True:
        assert broker.poll() is None, _logs(tmp_path)
        assert worker.poll() is None, _logs(tmp_path)
        assert clock.now() < until, "the worker never registered\n" + _logs(tmp_path)
        try:
            workers: list[dict[str, Any]] = client.stats(timeout_s=1.0)["workers"]
        except TimeoutError:
            continue  # the broker is still starting
        if workers:
            return workers
        client.poll(0.05)


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
    """A usage error (exit 2) naming the endpoint, not a zmq.ZMQError traceback."""
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
        workers = _until_registered(client, broker, worker, tmp_path)
        assert [w["name"] for w in workers] == ["w0"]
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        result = client.submit("synthetic", {"x": x}, timeout_s=5.0).result()
    np.testing.assert_array_equal(result["y"], synthetic_output(x))
    assert result.batch_size == 2

    worker.terminate()
    assert worker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)
    broker.terminate()
    assert broker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)


_TGKILL = {"x86_64": 234, "aarch64": 131}  # syscall numbers


def _threads_taking(pid: int, signum: int) -> list[int]:
    """The ids of ``pid``'s threads, other than its main thread, that do not block
    ``signum``: where the kernel may deliver a signal sent to the process."""
    found = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        tid = int(task.name)
        status = (task / "status").read_text()
        blocked = int(
            next(x for x in status.splitlines() if x.startswith("SigBlk:")).split()[1], 16
        )
        if tid != pid and not blocked & (1 << (signum - 1)):
            found.append(tid)
    return found


@pytest.mark.timeout(90)
@pytest.mark.parametrize("command", ["broker", "worker"])
def test_sigterm_stops_it_even_when_another_thread_takes_the_signal(
    tmp_path: Path, spawn: Spawn, command: str
) -> None:
    """The kernel gives a process's signal to any thread that does not block it; numpy's
    OpenBLAS threads do not. Python's handler then waits for the main thread's poll to
    end, and an idle broker must still stop (not wait for systemd's SIGKILL after
    TimeoutStopSec). Here the signal goes to such a thread on purpose."""
    import ctypes
    import platform

    number = _TGKILL.get(platform.machine())
    if number is None:
        pytest.skip(f"no tgkill number for {platform.machine()}")
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    if command == "broker":
        proc = spawn("broker", "--frontend", frontend, "--backend", backend)
    else:
        proc = spawn("worker", "--broker", backend, "--synthetic", "0", "0")
    clock = MonotonicClock()
    until = clock.now() + 30.0
    with Client(frontend) as client:  # (for its poll as a wait; nothing listens for a worker)
        while "INFO" not in _logs(tmp_path):  # started: its handlers are in place
            assert proc.poll() is None, _logs(tmp_path)
            assert clock.now() < until, "it never started\n" + _logs(tmp_path)
            client.poll(0.05)
        client.poll(0.5)  # into its idle poll
    others = _threads_taking(proc.pid, signal.SIGTERM)
    if not others:
        pytest.skip("no thread but the main one takes SIGTERM in this process")
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(number, proc.pid, others[0], signal.SIGTERM) == 0
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)


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
    """The broker gives the batch stop_grace_s (2 s) to finish, then the embedded
    worker's close waits 2 s: about 4 s in all, well inside the broker unit's
    TimeoutStopSec=10s, not the 30 s the batch, whose result nobody can receive, runs."""
    frontend = f"ipc://{tmp_path}/frontend"
    broker = spawn(
        "broker",
        "--frontend",
        frontend,
        "--backend",
        f"ipc://{tmp_path}/backend",
        "--embed-synthetic",
        "0",
        "100",
    )  # fmt: skip (0.1 s a sample: the warm-up's runs, 5 samples in all, take 0.5 s)
    x = np.ones((300, 16), np.float32)  # a batch of 30 s
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
                client.submit("synthetic", {"x": x}, timeout_s=60.0)
            running = any(w["outstanding"] for w in workers)
        broker.terminate()
        # Within the unit's TimeoutStopSec=10s (the hang guard), leaving the batch running.
        assert broker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)
        assert "a batch still runs; not waiting" in _logs(tmp_path)


def test_a_broker_stopped_by_a_fault_inside_its_core_exits_1() -> None:
    """serve() raises BrokerFault after a fault that may have changed the core's state
    (tests/integration/test_raw_peers.py makes one); ``carpool broker`` then exits 1, not
    0, so that systemd's Restart=on-failure restarts it."""
    script = (
        "import sys\n"
        "from carpool.broker.server import BrokerFault, BrokerServer\n"
        "def serve(self, watch=None):\n"
        "    raise BrokerFault('a fault injected in place of the loop')\n"
        "BrokerServer.serve = serve\n"
        "from carpool.cli import main\n"
        "sys.exit(main(['broker', '--frontend', 'tcp://127.0.0.1:0',"
        " '--backend', 'tcp://127.0.0.1:0']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr


# ---------------------------------------------------------------------- one-line errors


def _carpool_env(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CARPOOL, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )


def _write_trace(path: Path, n: int = 5) -> Path:
    lines = (
        f'{{"t_s": {i / 100}, "model": "m", "shape": [1, 16], "timeout_ms": 100}}' for i in range(n)
    )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("command", ["bench", "replay"])
def test_no_broker_at_the_endpoint_is_one_line_and_status_1(
    command: str, nobody: str, tmp_path: Path
) -> None:
    """One line ("no broker answered at ...") and exit 1, not a TimeoutError traceback
    (after three STATS of 0.2 s each, not the default 3 s)."""
    if command == "bench":
        args = ["bench", "--duration-s", "0.1", "--warmup-s", "0", "--no-progress"]
    else:
        args = ["replay", "--trace", str(_write_trace(tmp_path / "t.jsonl"))]
    result = _carpool(*args, "--endpoint", nobody, "--stats-timeout-s", "0.2")
    assert result.returncode == 1, result.stderr
    assert f"carpool: no broker answered at {nobody}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_stats_timeout_that_is_not_positive_is_a_config_error(nobody: str) -> None:
    result = _carpool("bench", "--endpoint", nobody, "--stats-timeout-s", "0")
    assert result.returncode == 2, result.stderr
    assert "--stats-timeout-s must be more than 0, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_record_to_a_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    """A usage error naming the trace, not a FileNotFoundError traceback."""
    out = tmp_path / "missing" / "t.jsonl"
    result = _carpool(
        "record", "--frontend", f"ipc://{tmp_path}/f", "--backend", f"ipc://{tmp_path}/b",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"carpool: cannot write trace {out}: No such file or directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_an_unknown_log_level_is_a_usage_error(where: str, tmp_path: Path) -> None:
    """Before or after the command: a usage error ("invalid choice"), not a traceback."""
    tune = ["tune", "--trace", str(_write_trace(tmp_path / "t.jsonl"))]
    args = ["--log-level", "LOUD", *tune] if where == "before" else [*tune, "--log-level", "LOUD"]
    result = _carpool(*args)
    assert result.returncode == 2, result.stderr
    assert "invalid choice: 'LOUD'" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_log_level_in_the_environment_is_a_usage_error(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    result = _carpool_env("tune", "--trace", str(trace), CARPOOL_LOG_LEVEL="LOUD")
    assert result.returncode == 2, result.stderr
    assert "CARPOOL_LOG_LEVEL must be one of DEBUG, INFO" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_model_error_says_a_path_works(tmp_path: Path) -> None:
    result = _carpool("worker", "--broker", f"ipc://{tmp_path}/backend", "--model", "my")
    assert result.returncode == 2
    assert "--model /path/to/model.onnx" in result.stderr


# ---------------------------------------------------------------------- --log-level


def test_log_level_goes_after_the_command_too() -> None:
    """``carpool tune --log-level DEBUG`` is accepted; the last one given wins."""
    parse = build_parser().parse_args
    assert parse(["tune", "--trace", "t", "--log-level", "debug"]).log_level == "DEBUG"
    assert parse(["--log-level", "ERROR", "worker"]).log_level == "ERROR"
    assert parse(["--log-level", "ERROR", "bench", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parse(["replay", "--trace", "t"]).log_level == "INFO"


def test_log_level_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_LOG_LEVEL", "warning")
    assert build_parser().parse_args(["simulate"]).log_level == "WARNING"
    args = build_parser().parse_args(["simulate", "--log-level", "DEBUG"])
    assert args.log_level == "DEBUG"


# ---------------------------------------------------------------------- bench


def test_bench_help_reads_as_help() -> None:
    """``carpool bench --help`` is written as help (exit status included), not the
    module's docstring with its file name and reST markup."""
    result = _carpool("bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "benchcmd.py" not in result.stdout
    assert "``" not in result.stdout
    assert "exit status: 0 when at least one request was answered, 1 when none" in " ".join(
        result.stdout.split()
    )


def _wait_for_broker(frontend: str, broker: subprocess.Popen[bytes], tmp_path: Path) -> None:
    with Client(frontend, default_timeout_s=5.0) as client:
        clock = MonotonicClock()
        until = clock.now() + 30.0
        while True:
            assert broker.poll() is None, _logs(tmp_path)
            assert clock.now() < until, "the broker never answered\n" + _logs(tmp_path)
            try:
                client.stats(timeout_s=1.0)
                return
            except TimeoutError:
                continue


def test_bench_fails_when_every_request_fails(tmp_path: Path, spawn: Spawn) -> None:
    """Every request failed: exit 1, with the report. A broker just started answers an
    unknown model UNAVAILABLE (register_grace_s: its workers may still be reconnecting)."""
    frontend = f"ipc://{tmp_path}/frontend"
    broker = spawn("broker", "--frontend", frontend, "--backend", f"ipc://{tmp_path}/backend")
    _wait_for_broker(frontend, broker, tmp_path)
    result = _carpool(
        "bench", "--endpoint", frontend, "--model", "nosuch", "--load", "constant",
        "--rate", "20", "--duration-s", "0.5", "--warmup-s", "0", "--no-progress",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr + _logs(tmp_path)
    assert "carpool: no request was answered (errors: UNAVAILABLE 10)" in result.stderr, (
        result.stderr + _logs(tmp_path)
    )
    assert "errors:      UNAVAILABLE 10" in result.stdout  # the report still comes


# ---------------------------------------------------------------------- worker


def test_a_worker_serves_an_onnx_file_under_its_stem(tmp_path: Path, spawn: Spawn) -> None:
    """--model takes a path to an .onnx file as well as a catalogue name."""
    model = tmp_path / "cls.onnx"
    shutil.copyfile(locate("ppocr-cls"), model)
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    broker = spawn("broker", "--frontend", frontend, "--backend", backend)
    worker = spawn("worker", "--broker", backend, "--model", str(model), "--name", "w0")
    with Client(frontend, default_timeout_s=5.0) as client:
        workers = _until_registered(client, broker, worker, tmp_path)
        assert [w["models"] for w in workers] == [["cls"]]
        x = np.zeros((1, 3, 48, 192), np.float32)
        assert client.infer("cls", {"x": x}, timeout_s=5.0)


def test_a_worker_with_no_broker_does_not_say_connected(tmp_path: Path, spawn: Spawn) -> None:
    """With nothing listening it logs that it waits for a broker, once, and never
    "connected to", however often it reconnects."""
    toml = tmp_path / "w.toml"
    toml.write_text("heartbeat_s = 0.25\nliveness = 3\n")  # silent for 0.75 s: reconnect
    endpoint = f"ipc://{tmp_path}/nobody"
    worker = spawn(
        "worker", "--config", str(toml), "--broker", endpoint, "--synthetic", "0", "0",
        "--name", "w0",
    )  # fmt: skip
    clock = MonotonicClock()
    until = clock.now() + 30.0
    while _logs(tmp_path).count("reconnecting") < 2:
        assert worker.poll() is None, _logs(tmp_path)
        assert clock.now() < until, "the worker never reconnected\n" + _logs(tmp_path)
        _pause(worker, 0.1)
    logs = _logs(tmp_path)
    assert "connected to" not in logs
    assert logs.count(f"worker name=w0: READY sent to {endpoint}, waiting for a broker") == 1


def _pause(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``proc`` to end (a bounded pause between polls)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)


def test_an_execution_provider_onnxruntime_lacks_is_a_config_error(tmp_path: Path) -> None:
    """CUDA's provider needs onnxruntime-gpu: said in one line, not ONNX Runtime's silent
    fall-back to the CPU."""
    toml = tmp_path / "w.toml"
    toml.write_text('[[models]]\nname = "ppocr-cls"\nproviders = ["NoSuchExecutionProvider"]\n')
    result = _carpool("worker", "--broker", f"ipc://{tmp_path}/b", "--config", str(toml))
    assert result.returncode == 2, result.stderr
    assert "['NoSuchExecutionProvider'] are not available here" in result.stderr
    assert "CPUExecutionProvider" in result.stderr  # what it has
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------- models


def test_models_check_passes_the_built_in_repository_and_fails_a_broken_one(
    tmp_path: Path,
) -> None:
    result = _carpool("models", "check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.endswith(": 4 model(s), no problems\n")
    (tmp_path / "det").mkdir()
    (tmp_path / "det" / "model.onnx").symlink_to(locate("ppocr-det"))
    (tmp_path / "det" / "model.toml").write_text("[inputs.x.pad]\nmultiple_of = [32, 32]\n")
    result = _carpool("models", "check", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == (
        f"{tmp_path}/det/model.toml: inputs.x.pad.multiple_of: has 2 entries, the input "
        "has 3 dims after the batch dim\n"
    )
    assert "1 problem(s)" in result.stderr


def test_models_list_shows_each_built_in_model() -> None:
    result = _carpool("models", "list")
    assert result.returncode == 0, result.stderr
    assert "ppocr-det: PP-OCRv4 text detector" in result.stdout
    assert (
        "  input      x float32 [B, 3, ?, ?]  buckets: any item shape, padded up to multiples"
        " of [1, 32, 32]"
    ) in result.stdout
    assert "  file       rapidocr-onnxruntime==1.4.4 ch_PP-OCRv4_rec_infer.onnx" in result.stdout


def test_a_worker_serves_a_repository_through_a_broker(tmp_path: Path, spawn: Spawn) -> None:
    """carpool worker --repository DIR serves the models of DIR (here the text-line
    classifier, warmed up at its declared shape, and one named by --model only)."""
    repo = tmp_path / "models"
    (repo / "angle").mkdir(parents=True)
    (repo / "angle" / "model.onnx").symlink_to(locate("ppocr-cls"))
    (repo / "angle" / "model.toml").write_text(
        'description = "text-line angle"\nmax_batch = 4\n[warmup]\nx = [[1, 3, 48, 96]]\n'
    )
    (repo / "other").mkdir()
    (repo / "other" / "model.toml").write_text('path = "missing.onnx"\n')
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    broker = spawn("broker", "--frontend", frontend, "--backend", backend)
    worker = spawn(
        "worker", "--broker", backend, "--repository", str(repo), "--model", "angle",
        "--name", "w0",
    )  # fmt: skip
    with Client(frontend, default_timeout_s=5.0) as client:
        workers = _until_registered(client, broker, worker, tmp_path)
        assert [w["models"] for w in workers] == [["angle"]]
        x = np.zeros((2, 3, 48, 96), np.float32)
        (scores,) = client.infer("angle", {"x": x}, timeout_s=5.0).values()
        assert scores.shape == (2, 2)
        # What the running broker says of the models its workers serve.
        shown = _carpool("models", "show", "--endpoint", frontend, "angle")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines() == [
            "angle",
            "  workers    w0",
            "  max_batch  4",
            "  input      x float32 [B, 3, ?, ?]",
            "  output     save_infer_model/scale_0.tmp_1 float32 [B, 2]",
        ]
        listed = _carpool("models", "show", "--endpoint", frontend, "--json")
        assert listed.returncode == 0, listed.stderr
        (described,) = json.loads(listed.stdout)
        assert (described["name"], described["workers"]) == ("angle", ["w0"])
        missing = _carpool("models", "show", "--endpoint", frontend, "nosuch")
        assert missing.returncode == 1
        assert "'nosuch' is not served by any worker" in missing.stderr


def test_models_show_says_when_no_broker_answers(tmp_path: Path) -> None:
    result = _carpool(
        "models", "show", "--endpoint", f"ipc://{tmp_path}/nobody", "--timeout", "0.3"
    )
    assert result.returncode == 2
    assert result.stderr == f"carpool models show: no broker answered at ipc://{tmp_path}/nobody\n"
