"""Overload at three times the capacity of a synthetic worker of known cost α + βB, against
a broker process: the door refuses what cannot make its deadline, what it lets in makes
it, and the broker's memory stays bounded. (How fast refusals come is for bench/.)"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

from carpool.client import Client, DeadlineExceeded, Overloaded, RequestError

FIXED_MS, PER_SAMPLE_MS, MAX_BATCH = 40.0, 4.0, 8
#: Full batches, back to back: 8 samples every 72 ms.
CAPACITY_RPS = MAX_BATCH / ((FIXED_MS + PER_SAMPLE_MS * MAX_BATCH) / 1000.0)
TIMEOUT_S = 1.0
#: The broker's resident memory at the end (with its embedded worker and the Python
#: runtime: about 70 MB at rest here).
RSS_BOUND_MB = 250


def _pace(client: Client, rate_rps: float, duration_s: float) -> list[tuple[float, object]]:
    """Send open loop at ``rate_rps`` for ``duration_s``; the futures with their send times."""
    x = np.ones((1, 16), np.float32)
    sent: list[tuple[float, object]] = []
    start = time.monotonic()
    n = 0
    while (now := time.monotonic()) - start < duration_s:
        due = start + n / rate_rps
        if now < due:
            client.poll(min(due - now, 0.005))
            continue
        sent.append((now, client.submit("synthetic", {"x": x}, timeout_s=TIMEOUT_S)))
        n += 1
    return sent


def _until_serving(client: Client) -> None:
    """Until the broker answers a result (its process starts, its worker registers): a
    hang guard of 30 s, however long a loaded machine takes to start it."""
    x = np.ones((1, 16), np.float32)
    until = time.monotonic() + 30.0
    while time.monotonic() < until:
        try:
            client.infer("synthetic", {"x": x}, timeout_s=TIMEOUT_S)
        except RequestError:  # (not up yet: no reply, or no worker registered)
            continue
        return
    raise AssertionError("the broker did not serve within 30 s")


def test_what_the_door_lets_in_at_three_times_capacity_makes_its_deadline(
    tmp_path: Path,
) -> None:
    frontend, backend = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    log = (tmp_path / "broker.log").open("wb")
    broker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "carpool",
            "broker",
            "--frontend",
            frontend,
            "--backend",
            backend,
            "--max-batch",
            str(MAX_BATCH),
            "--embed-synthetic",
            str(FIXED_MS),
            str(PER_SAMPLE_MS),
            "--embed-max-batch",
            str(MAX_BATCH),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with Client(frontend, default_timeout_s=TIMEOUT_S) as client:
            _until_serving(client)
            # Below capacity first, so that the broker fits the batch cost (2 sizes).
            for _, future in _pace(client, 0.5 * CAPACITY_RPS, 1.5):
                future.result(5.0)  # type: ignore[attr-defined]
            before = client.stats()
            sent = _pace(client, 3 * CAPACITY_RPS, 4.0)
            outcomes: Counter[str] = Counter()
            for _, future in sent:
                try:
                    future.result(5.0)  # type: ignore[attr-defined]
                except DeadlineExceeded:
                    outcomes["deadline"] += 1
                except Overloaded:
                    outcomes["overloaded"] += 1
                else:
                    outcomes["ok"] += 1
            after = client.stats()
        rss_mb = psutil.Process(broker.pid).memory_info().rss / 2**20
        assert broker.poll() is None
    finally:
        broker.terminate()
        try:
            broker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()
        log.close()
    at_door = after["shed_at_door"] - before["shed_at_door"]
    shed_late = (after["shed"] - before["shed"]) - at_door
    overloaded = after["errors"].get("OVERLOADED", 0) - before["errors"].get("OVERLOADED", 0)
    admitted = len(sent) - at_door - overloaded
    summary = f"{dict(outcomes)}, door {at_door}, late {shed_late}, overloaded {overloaded}"
    # It was overload: most requests were refused at the door...
    assert at_door + overloaded > len(sent) / 2, summary
    # ... and at least 99% of those let in were answered in time (a reply past its
    # deadline is a DEADLINE_EXCEEDED too).
    assert outcomes["ok"] >= 0.99 * admitted, summary
    assert outcomes["deadline"] + outcomes["overloaded"] == at_door + overloaded + (
        admitted - outcomes["ok"]
    )
    assert shed_late <= 0.01 * admitted, summary
    assert rss_mb < RSS_BOUND_MB, f"broker RSS {rss_mb:.0f} MB"
