"""A broker process stopped with SIGTERM and started again under light load: the client
leaves its connection at the first request the stopping broker refuses with ``retry``,
sends each request refused so again on its next connection, and the restarted broker
answers them; the stopping broker answers the others on the old connection. Requests
whose budgets outlast the restart are answered instead of failing "stopping" (protocol.md
§6.1, §6.3, §11)."""

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

from carpool.client import Client, RequestError
from carpool.client.calls import ReplyFuture
from carpool.worker.engines.synthetic import synthetic_output

pytestmark = pytest.mark.timeout(90)

RATE_RPS = 100
#: Long enough to outlast the stop (its grace, then the frontend's close) and the start
#: of the next broker, on a loaded machine.
TIMEOUT_S = 10.0
STOP_AT_S, AFTER_RESTART_S = 0.5, 1.0
#: Batches of 100 ms: the stopping broker finishes the one running while requests arrive,
#: and refuses those "stopping" (with retry).
SYNTHETIC_MS = ("100", "1")
#: The broker expects "synthetic" back, so a request sent again before its embedded
#: worker registers is held (§11.1), not refused as an unknown model.
BROKER_TOML = "[models.synthetic]\n"


def _start_broker(tmp_path: Path, log: BinaryIO) -> subprocess.Popen[bytes]:
    config = tmp_path / "broker.toml"
    config.write_text(BROKER_TOML)
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "carpool", "broker", "--config", str(config)),
            *("--frontend", f"ipc://{tmp_path}/fe", "--backend", f"ipc://{tmp_path}/be"),
            *("--embed-synthetic", *SYNTHETIC_MS),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def test_requests_whose_budget_allows_are_answered_after_a_restart(tmp_path: Path) -> None:
    with (tmp_path / "broker.log").open("wb") as log:
        brokers = [_start_broker(tmp_path, log)]
        try:
            _run(tmp_path, log, brokers)
        finally:
            for broker in brokers:
                if broker.poll() is None:
                    broker.terminate()
                    broker.wait(10)


def _run(tmp_path: Path, log: BinaryIO, brokers: list[subprocess.Popen[bytes]]) -> None:
    with Client(f"ipc://{tmp_path}/fe", default_timeout_s=TIMEOUT_S, grace_s=1.0) as client:
        client.infer("synthetic", {"x": np.zeros((1, 16), np.float32)}, timeout_s=30)  # serving
        sent: list[tuple[np.ndarray, ReplyFuture]] = []
        start = time.monotonic()
        signalled = False
        # Light load until the client leaves the connection (bounded: 20 s).
        while client.core.switches == 0 and time.monotonic() - start < 20:
            if not signalled and time.monotonic() - start > STOP_AT_S:
                brokers[0].send_signal(signal.SIGTERM)
                signalled = True
            _send_due(client, sent, start, 0)
        assert client.core.switches == 1, "the client never left the stopping broker"
        # The broker gone, one starts again; meanwhile the client holds what it sends again.
        until = time.monotonic() + 20
        while brokers[0].poll() is None:
            assert time.monotonic() < until, "the broker did not stop"
            client.poll(0.01)
        assert brokers[0].returncode == 0
        brokers.append(_start_broker(tmp_path, log))
        restarted, before = time.monotonic(), len(sent)
        while time.monotonic() - restarted < AFTER_RESTART_S:
            _send_due(client, sent, restarted, before)
        outcomes: Counter[str] = Counter()
        for x, future in sent:
            try:
                result = future.result(TIMEOUT_S + 2)
            except RequestError as exc:
                outcomes[f"{type(exc).__name__}: {exc}"] += 1
                continue
            ok = np.array_equal(result.outputs["y"], synthetic_output(x))
            outcomes["answered" if ok else "wrong output"] += 1
        report = f"sent {len(sent)}, outcomes {dict(outcomes)}, resent {client.core.resends}"
        assert outcomes == {"answered": len(sent)}, report
        # One connection left, none lost: the old one was read until the stopping broker
        # had answered every request sent on it.
        assert (client.core.switches, client.core.lost_connections) == (1, 0), report
        assert client.core.resends > 0, report  # (else none was in flight at the stop)
        assert client.core.late_replies == 0, report


def _send_due(
    client: Client, sent: list[tuple[np.ndarray, ReplyFuture]], start: float, before: int
) -> None:
    """Send the next request if it is due at :data:`RATE_RPS` from ``start`` (``before``
    were sent until then), else pump the client."""
    now = time.monotonic()
    due = start + (len(sent) - before) / RATE_RPS
    if now < due:
        client.poll(min(due - now, 0.005))
        return
    x = np.full((1, 16), len(sent) % 1000, np.float32)  # each request's own input
    sent.append((x, client.submit("synthetic", {"x": x})))
