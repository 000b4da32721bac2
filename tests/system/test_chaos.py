"""Chaos under steady load: a broker process and three worker processes serve a client
that sends at a fixed rate while one worker is SIGKILLed mid-batch, another SIGSTOPped
(and SIGCONTed later) and the broker stopped with SIGTERM and started again on the same
endpoints. Every request gets exactly one answer, before its timeout: no future resolves
twice, none waits for the SDK's own expiry, no reply comes for a request the SDK had
already failed, and every answer that is a result holds that request's own outputs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from carpool.client import Client, RequestError
from carpool.client.calls import ReplyFuture
from carpool.common.errors import Unavailable
from carpool.worker.engines.synthetic import synthetic_output

pytestmark = pytest.mark.timeout(90)

CARPOOL = [sys.executable, "-m", "carpool"]
RATE_RPS = 200
#: The load goes on for one request timeout after the thaw (THAW_AT_S + TIMEOUT_S).
LOAD_S = 10.0
TIMEOUT_S, GRACE_S = 2.0, 0.5
#: Each batch costs 30 ms + 1 ms a sample: a worker is mid-batch most of the time.
SYNTHETIC_MS = ("30", "1")
#: What happens when, in seconds from the start of the load.
KILL_AT_S, FREEZE_AT_S, RESTART_AT_S, THAW_AT_S = 1.5, 3.0, 5.0, 8.0
#: The broker expects model "synthetic", so that after its restart it holds requests for
#: it until a worker registers again (protocol.md §11.1); a short stop grace.
BROKER_TOML = "stop_grace_s = 1.0\n\n[models.synthetic]\n"


class Fleet:
    """The broker and worker processes, each logging to a file under ``tmp_path``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.frontend, self.backend = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
        self.config = tmp_path / "broker.toml"
        self.config.write_text(BROKER_TOML)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.tmp_path / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                [*CARPOOL, *args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        return proc

    def broker(self, name: str) -> subprocess.Popen[bytes]:
        return self.start(
            name,
            "broker",
            "--config",
            str(self.config),
            "--frontend",
            self.frontend,
            "--backend",
            self.backend,
        )

    def worker(self, name: str) -> subprocess.Popen[bytes]:
        return self.start(
            name, "worker", "--broker", self.backend, "--synthetic", *SYNTHETIC_MS, "--name", name
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
            for log in sorted(self.tmp_path.glob("*.log"))
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # (a frozen one could not stop)
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How many times each ReplyFuture (by id) was resolved."""
    times: Counter[int] = Counter()
    resolve = ReplyFuture._set

    def counting(self: ReplyFuture, outcome: object) -> None:
        times[id(self)] += 1
        resolve(self, outcome)  # type: ignore[arg-type]

    monkeypatch.setattr(ReplyFuture, "_set", counting)
    return times


def _until_registered(client: Client, count: int, fleet: Fleet) -> None:
    until = time.monotonic() + 60
    while True:
        assert time.monotonic() < until, "the workers never registered\n" + fleet.logs()
        try:
            if len(client.stats(timeout_s=1.0)["workers"]) >= count:
                return
        except TimeoutError:  # (the broker not up yet)
            continue
        client.poll(0.05)


def _mid_batch(client: Client, name: str, until_s: float) -> bool:
    """Wait (until ``until_s`` at most) for worker ``name`` to hold a batch."""
    while time.monotonic() < until_s:
        for worker in client.stats(timeout_s=1.0)["workers"]:
            if worker["name"] == name and worker["outstanding"]:
                return True
        client.poll(0.002)
    return False


def _kind(exc: RequestError) -> str:
    if isinstance(exc, Unavailable):
        text = str(exc)
        for words in ("no reply from the broker", "stopping", "stopped", "connection"):
            if words in text:
                return f"Unavailable ({words})"
    return type(exc).__name__


def test_every_request_is_answered_once_through_worker_faults_and_a_broker_restart(
    fleet: Fleet, settled: Counter[int]
) -> None:
    broker = fleet.broker("broker-1")
    workers = [fleet.worker(f"w{k}") for k in range(3)]
    with Client(fleet.frontend, default_timeout_s=TIMEOUT_S, grace_s=GRACE_S) as client:
        _until_registered(client, 3, fleet)
        sent: list[tuple[np.ndarray, ReplyFuture]] = []
        events: dict[str, float] = {}
        start = time.monotonic()
        n = 0
        while (now := time.monotonic()) - start < LOAD_S:
            t = now - start
            if "kill" not in events and t >= KILL_AT_S:
                events["kill mid-batch"] = float(_mid_batch(client, "w0", now + 1.0))
                workers[0].kill()
                events["kill"] = t
            elif "freeze" not in events and t >= FREEZE_AT_S:
                workers[1].send_signal(signal.SIGSTOP)
                events["freeze"] = t
            elif "stop" not in events and t >= RESTART_AT_S:
                broker.send_signal(signal.SIGTERM)
                events["stop"] = t
            elif "restart" not in events and "stop" in events and broker.poll() is not None:
                assert broker.returncode == 0, fleet.logs()
                broker = fleet.broker("broker-2")
                events["restart"] = t
            elif "thaw" not in events and t >= THAW_AT_S:
                workers[1].send_signal(signal.SIGCONT)
                events["thaw"] = t
            due = start + n / RATE_RPS
            if now < due:
                client.poll(min(due - now, 0.002))
                continue
            x = np.full((1, 16), n % 1000, np.float32)
            sent.append((x, client.submit("synthetic", {"x": x})))
            n += 1
        outcomes: Counter[str] = Counter()
        never_answered = 0
        for x, future in sent:
            try:
                result = future.result(TIMEOUT_S + GRACE_S + 2.0)
            except TimeoutError:
                never_answered += 1
                continue
            except RequestError as exc:
                outcomes[_kind(exc)] += 1
                continue
            ok = np.array_equal(result.outputs["y"], synthetic_output(x))
            outcomes["ok" if ok else "wrong output"] += 1
        late = client.core.late_replies
        lost = client.core.lost_connections
        switches = client.core.switches
    twice = sum(1 for _, future in sent if settled[id(future)] > 1)
    report = (
        f"sent {len(sent)}, outcomes {dict(outcomes)}, answered twice {twice}, never "
        f"answered {never_answered}, late replies {late}, connections lost {lost}, "
        f"connections left {switches}, events {events}"
    )
    print(report)
    assert set(events) >= {"kill", "freeze", "stop", "restart", "thaw"}, report
    assert sum(outcomes.values()) + never_answered == len(sent), report
    assert twice == 0, report
    assert never_answered == 0, report
    assert outcomes["Unavailable (no reply from the broker)"] == 0, report  # SDK expiry
    assert outcomes["wrong output"] == 0, report
    assert late == 0, report
    # The broker's stop: the client left its connection at the first refusal, and read it
    # until the stopping broker had answered every request sent on it (none lost).
    assert (switches, lost) == (1, 0), report
    assert outcomes["ok"] > len(sent) / 2, report
    assert broker.poll() is None, fleet.logs()
