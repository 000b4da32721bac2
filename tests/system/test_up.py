"""``carpool up`` through its entry point: N workers register, a killed worker is started
again, SIGTERM stops every child; flags it refuses before starting anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from carpool.client import Client
from carpool.common.curve import create_keypair
from tests.system.upfleet import SYNTHETIC, UpFleet

pytestmark = pytest.mark.timeout(180)

JOINED = "worker joined name=worker-1 "


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[UpFleet]:
    up = UpFleet(tmp_path, "--workers", "2", *SYNTHETIC)
    yield up
    if up.proc.poll() is None:
        up.stop()


@pytest.mark.slow
def test_workers_register_a_killed_one_is_restarted_and_sigterm_stops_all(
    fleet: UpFleet,
) -> None:
    with Client(fleet.frontend) as client:
        fleet.until_workers(client, ["worker-0", "worker-1"])
        first = fleet.children()
        os.kill(first["worker-1"].pid, signal.SIGKILL)
        restarted = fleet.until(
            "worker-1 started again",
            lambda: (kid := fleet.children().get("worker-1")) and kid.pid != first["worker-1"].pid,
        )
        assert restarted
        # The new one registered (the broker says so in its log: STATS names no pids).
        fleet.until("worker-1 joined again", lambda: fleet.output().count(JOINED) == 2)
        fleet.until_workers(client, ["worker-0", "worker-1"])
        assert fleet.children()["worker-0"].pid == first["worker-0"].pid  # untouched
        assert fleet.children()["broker"].pid == first["broker"].pid
        x = np.ones((1, 16), np.float32)
        y = client.infer("synthetic", {"x": x}, timeout_s=10.0)
        assert y["y"].tolist() == [[3.0] * 16]
    assert len(fleet.seen) == 4  # broker, two workers, one worker again
    assert fleet.stop() == 0
    assert fleet.left == [], f"children still running after SIGTERM\n{fleet.output()}"
    out = fleet.output()
    assert "worker-1 exited (status -9); starting it again in 0.5 s" in out
    for name in ("broker", "worker-0", "worker-1"):
        assert f"{name} exited (status 0)" in out, out  # each drained on its SIGTERM


def _up(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "carpool", "up", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--workers", "0"], "--workers must be in 1..16, got 0"),
        (["--workers", "4", "--max-workers", "2"], "--workers must be in 1..2, got 4"),
        (["--metrics-base", "65530", "--max-workers", "8"], "must lie in 1..65535"),
        (["--page", "0.0.0.0:0"], "needs --page-token-file"),
        (["--page", "nonsense"], "HOST:PORT is needed"),
        (["--traffic", "10"], "--traffic feeds the page"),
        (["--page", "127.0.0.1:0", "--traffic", "5", "--model", "m"], "needs --traffic-shape"),
        (["--curve-worker-key", "k.key_secret"], "needs --curve-server-key"),
    ],
    ids=["none", "above-max", "ports", "non-loopback", "address", "no-page", "shape", "curve"],
)
def test_a_bad_flag_is_refused_before_any_process_starts(
    tmp_path: Path, args: list[str], says: str
) -> None:
    result = _up("--frontend", f"ipc://{tmp_path}/f", "--backend", f"ipc://{tmp_path}/b", *args)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr
    assert "started broker" not in result.stderr


def test_a_page_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-of-the-operators-own\n")
    token.chmod(0o644)
    result = _up("--page", "127.0.0.1:0", "--page-token-file", str(token))
    assert result.returncode == 2
    assert "chmod 600" in result.stderr


@pytest.mark.slow
def test_a_fleet_with_curve_serves_its_page_and_traffic_with_the_operators_key(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    for folder, name in [("broker", "broker"), ("workers", "w"), ("operators", "ops")]:
        create_keypair(keys / folder, name)
    (keys / "clients").mkdir(mode=0o700)
    broker_secret = keys / "broker" / "broker.key_secret"
    fleet = UpFleet(
        tmp_path,
        *("--workers", "1", *SYNTHETIC, "--curve", "--curve-server-key", str(broker_secret)),
        *("--curve-clients", str(keys / "clients"), "--curve-workers", str(keys / "workers")),
        *("--curve-operators", str(keys / "operators")),
        *("--curve-worker-key", str(keys / "workers" / "w.key_secret")),
        *("--curve-client-key", str(keys / "operators" / "ops.key_secret")),
        *("--page", "127.0.0.1:0", "--traffic", "20"),
    )
    try:
        url, _ = fleet.page_url()

        def served() -> dict | None:
            with urllib.request.urlopen(url + "api/fleet", timeout=10) as reply:
                view = json.load(reply)
            ok = view["live_workers"] == 1 and view["traffic"] and view["traffic"]["ok"] > 0
            return view if ok else None

        view = fleet.until("the page's figures over CURVE", served)
        assert view["workers"][0]["name"] == "worker-0"
        assert view["traffic"]["errors"] == {}
        # A client without a key gets nothing from this broker.
        with Client(fleet.frontend) as stranger, pytest.raises(TimeoutError):
            stranger.stats(timeout_s=1.0)
    finally:
        code = fleet.stop()
    assert code == 0, fleet.output()
    assert fleet.left == []


def _free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (for --metrics-base: broker, worker-0)."""
    import socket

    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise AssertionError("no two free ports in a row")


@pytest.mark.slow
def test_metrics_base_gives_the_broker_and_each_worker_their_port(tmp_path: Path) -> None:
    base = _free_port_pair()
    fleet = UpFleet(tmp_path, "--workers", "1", *SYNTHETIC, "--metrics-base", str(base))
    try:
        with Client(fleet.frontend) as client:  # (a poll in this process, not a command each)
            fleet.until_workers(client, ["worker-0"])
        assert fleet.status_workers() == ["worker-0"]  # carpool status --json lists it

        def scrape(port: int) -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return str(r.read().decode())

        assert "carpool_model_workers" in scrape(base)
        fleet.until("worker-0 ready", lambda: "carpool_worker_ready 1.0" in scrape(base + 1))
    finally:
        code = fleet.stop()
    assert code == 0, fleet.output()
