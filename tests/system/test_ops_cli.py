"""``carpool status``, ``carpool top`` and ``--metrics`` through the real entry point,
against a broker and a worker running as subprocesses on loopback."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from tests.system.test_cli import CARPOOL, Spawn, _carpool, _until_registered, spawn

__all__ = ["spawn"]  # (the fixture, used by name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveFleet:
    def __init__(self, spawn: Spawn, tmp_path: Path) -> None:
        self.frontend = f"tcp://127.0.0.1:{free_port()}"
        backend = f"tcp://127.0.0.1:{free_port()}"
        self.broker_metrics = f"127.0.0.1:{free_port()}"
        self.broker = spawn(
            "broker",
            "--frontend",
            self.frontend,
            "--backend",
            backend,
            "--metrics",
            self.broker_metrics,
        )
        self.worker = spawn(
            "worker", "--broker", backend, "--name", "w-ops", "--synthetic", "1", "0.1"
        )
        self.client = Client(self.frontend)
        _until_registered(self.client, self.broker, self.worker, tmp_path)

    def status(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _carpool("status", "--endpoint", self.frontend, "--timeout", "2", *args)


@pytest.fixture
def live(spawn: Spawn, tmp_path: Path) -> Iterator[LiveFleet]:
    fleet = LiveFleet(spawn, tmp_path)
    with fleet.client:
        yield fleet


@pytest.mark.timeout(120)
def test_status_exit_codes_healthy_then_no_worker_then_unreachable(live: LiveFleet) -> None:
    done = live.status()
    assert done.returncode == 0, done.stderr
    assert "synthetic" in done.stdout
    assert "w-ops" in done.stdout
    assert "\x1b[" not in done.stdout  # piped: plain text
    # B_max with the limit that binds it (the worker's default takes any batch).
    assert re.search(r"\b\d+ \((broker|adaptive)\)", done.stdout), done.stdout
    report: dict[str, Any] = json.loads(live.status("--json").stdout)
    assert report["max_batch_bound_by"]["synthetic"] in ("broker", "adaptive")
    assert report["reachable"] is True
    assert report["problems"] == []
    assert report["models"]["synthetic"]["workers"] == 1

    # The worker goes: its model stays known (forget_unserved_s) with no live worker.
    live.worker.terminate()
    live.worker.wait(timeout=10)
    clock = MonotonicClock()
    until = clock.now() + 30
    while live.client.stats()["workers"]:
        assert clock.now() < until, "the worker never left the broker's table"
        live.client.poll(0.05)
    done = live.status("--json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["models"]["synthetic"]["workers"] == 0
    assert any("synthetic" in p for p in report["problems"])

    live.broker.terminate()
    live.broker.wait(timeout=10)
    done = live.status("--timeout", "0.5")  # (the last --timeout given wins)
    assert done.returncode == 2
    assert "no answer from the broker within 0.5 s" in done.stderr


@pytest.mark.timeout(120)
def test_top_redraws_in_place_under_a_terminal(live: LiveFleet) -> None:
    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "40", "TERM": "xterm-256color"}
    args = ["top", "--endpoint", live.frontend, "--interval", "0.2", "--count", "3"]
    proc = subprocess.Popen(
        [*CARPOOL, *args], stdin=terminal, stdout=terminal, stderr=terminal, env=env
    )
    os.close(terminal)
    output = b""
    clock = MonotonicClock()
    until = clock.now() + 60
    try:
        while clock.now() < until:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the terminal closed: the process ended
                    break
                if not chunk:
                    break
                output += chunk
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(controller)
    text = output.decode(errors="replace")
    assert "synthetic" in text
    assert "w-ops" in text
    assert "req/s" in text
    # Redrawn in place: the cursor goes back up over the previous frame (rich Live).
    assert "\x1b[2K" in text or "\x1b[1A" in text or "\x1b[A" in text


@pytest.mark.timeout(120)
def test_the_broker_flag_serves_metrics(live: LiveFleet) -> None:
    with urllib.request.urlopen(f"http://{live.broker_metrics}/metrics", timeout=5) as reply:
        names = {f.name for f in text_string_to_metric_families(reply.read().decode())}
    assert {"carpool_requests", "carpool_batch_size", "carpool_model_workers"} <= names
    with urllib.request.urlopen(f"http://{live.broker_metrics}/readyz", timeout=5) as reply:
        assert reply.status == 200


def test_status_refuses_half_a_key_pair() -> None:
    done = _carpool("status", "--curve-server-key", "x.key", "--timeout", "1")
    assert done.returncode == 2
    assert "curve" in done.stderr
