"""LoopWatch over a real notify socket: what it sends, when, and what it holds back."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from carpool.common.sdnotify import SdNotifier
from carpool.common.supervision import LoopWatch
from carpool.worker.notify import start_extension, worker_trouble


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    yield sock
    sock.close()


def _sent(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def _notifier(tmp_path: Path, **env: str) -> SdNotifier:
    return SdNotifier({"NOTIFY_SOCKET": str(tmp_path / "notify"), **env}, pid=42)


def test_ready_then_pings_every_half_interval_while_healthy(tmp_path: Path, systemd) -> None:
    trouble: list[str | None] = [None]
    ready = [False]
    with closing(_notifier(tmp_path, WATCHDOG_USEC="2000000", WATCHDOG_PID="42")) as notifier:
        watch = LoopWatch(
            notifier, lambda: "ok", ready=lambda: ready[0], trouble=lambda: trouble[0]
        )
        assert watch.turn(0.0) == 1.0  # not ready: nothing yet
        assert _sent(systemd) == []
        ready[0] = True
        assert watch.turn(0.5) == 1.0
        assert _sent(systemd) == ["READY=1\nSTATUS=ok"]
        assert watch.turn(1.0) == pytest.approx(0.5)  # not due
        assert watch.turn(1.5) == 1.0
        assert _sent(systemd) == ["WATCHDOG=1\nSTATUS=ok"]
        trouble[0] = "a batch has run 200 s"
        watch.turn(2.5)
        assert _sent(systemd) == ["STATUS=unhealthy: a batch has run 200 s"]  # no ping
        trouble[0] = None
        watch.turn(3.5)
        assert _sent(systemd) == ["WATCHDOG=1\nSTATUS=ok"]
        watch.stopping()
        assert _sent(systemd) == ["STOPPING=1\nSTATUS=stopping"]


def test_a_watchdog_meant_for_another_process_is_not_pinged(tmp_path: Path, systemd) -> None:
    with closing(_notifier(tmp_path, WATCHDOG_USEC="2000000", WATCHDOG_PID="7")) as notifier:
        assert notifier.watchdog_s is None
        watch = LoopWatch(notifier, lambda: "ok")
        watch.turn(0.0)
        watch.turn(10.0)
        assert _sent(systemd) == ["READY=1\nSTATUS=ok", "STATUS=ok"]  # status only


def test_an_abstract_socket_name_is_reached(systemd) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0carpool-test-notify")
    with sock, closing(SdNotifier({"NOTIFY_SOCKET": "@carpool-test-notify"})) as notifier:
        assert notifier.send(READY=1)
        assert sock.recv(100) == b"READY=1"


def test_a_socket_that_is_gone_is_logged_not_raised(tmp_path: Path) -> None:
    notifier = _notifier(tmp_path)
    assert not notifier.enabled
    assert not notifier.send(READY=1)


@pytest.mark.parametrize(
    ("alive", "busy_ms", "hung_s", "says"),
    [
        (True, 0, 120.0, None),
        (True, 119_000, 120.0, None),
        (True, 121_000, 120.0, "a batch has run 121 s (hung_batch_s 120)"),
        (True, 10**9, 0.0, None),  # 0: never hung
        (False, 0, 120.0, "the inference thread has ended"),
    ],
)
def test_a_worker_is_unwell_when_its_inference_thread_ends_or_hangs(
    alive: bool, busy_ms: int, hung_s: float, says: str | None
) -> None:
    assert worker_trouble(alive, busy_ms, hung_s) == says


def test_a_starting_worker_extends_its_start_up_to_its_own_limit(tmp_path: Path, systemd) -> None:
    with closing(_notifier(tmp_path)) as notifier:
        starting = start_extension(notifier, 2, 300.0)
        starting(10.0)
        starting(290.0)
        starting(299.0)
    assert _sent(systemd) == [
        # until the next message (every 10 s) with room to spare, plus a margin
        "EXTEND_TIMEOUT_USEC=25000000\nSTATUS=starting 2 models: 10 s of at most 300 s",
        # never past the worker's own limit (plus the margin): its error ends the start
        "EXTEND_TIMEOUT_USEC=15000000\nSTATUS=starting 2 models: 290 s of at most 300 s",
        "EXTEND_TIMEOUT_USEC=6000000\nSTATUS=starting 2 models: 299 s of at most 300 s",
    ]
