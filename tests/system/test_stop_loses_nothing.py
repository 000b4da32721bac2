"""A broker process told to stop (SIGTERM) while a client sends at a steady rate answers
every request it read, and a request it could not read fails in the client as soon as
the connection closes: none waits for its own timeout (protocol.md §11)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest

from carpool.client import Client, Unavailable

pytestmark = pytest.mark.timeout(60)

RATE_RPS = 500
TIMEOUT_S = 4.0


def test_a_stopping_broker_leaves_no_request_to_its_timeout(tmp_path: Path) -> None:
    frontend = f"ipc://{tmp_path}/fe"
    with (tmp_path / "broker.log").open("wb") as log:
        _run(tmp_path, frontend, log)


def _run(tmp_path: Path, frontend: str, log: BinaryIO) -> None:
    broker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "carpool",
            "broker",
            "--frontend",
            frontend,
            "--backend",
            f"ipc://{tmp_path}/be",
            "--embed-synthetic",
            "2",
            "0.1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    x = np.ones((1, 16), np.float32)
    try:
        with Client(frontend, default_timeout_s=TIMEOUT_S, grace_s=0.5) as client:
            client.infer("synthetic", {"x": x}, timeout_s=30)  # up and serving
            futures = []
            start = time.monotonic()
            stopped_at = None
            n = 0
            # Send until the client learns that the connection closed (bounded: 10 s).
            while client.core.lost_connections == 0 and (now := time.monotonic()) - start < 10:
                if stopped_at is None and now - start > 0.5:
                    broker.send_signal(signal.SIGTERM)
                    stopped_at = now
                due = start + n / RATE_RPS
                if now < due:
                    client.poll(min(due - now, 0.002))
                    continue
                futures.append(client.submit("synthetic", {"x": x}))
                n += 1
            assert client.core.lost_connections == 1, "the client never saw the broker go"
            outcomes: Counter[str] = Counter()
            for future in futures:
                try:
                    future.result(TIMEOUT_S + 2)
                    outcomes["answered"] += 1
                except Unavailable as exc:
                    text = str(exc)
                    if "no reply from the broker" in text:
                        outcomes["timed out"] += 1
                    elif "stopping" in text or "stopped" in text:
                        outcomes["stopping"] += 1
                    elif "connection to the broker closed" in text:
                        outcomes["connection closed"] += 1
                    else:
                        outcomes[text] += 1
            assert sum(outcomes.values()) == len(futures)
            assert outcomes["answered"] > 0
            assert outcomes["timed out"] == 0, outcomes
            assert set(outcomes) <= {"answered", "stopping", "connection closed"}, outcomes
            assert client.core.late_replies == 0
        assert broker.wait(10) == 0
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()
