"""The broker and worker processes speak systemd's notify protocol: a real unix datagram
socket stands in for systemd (NOTIFY_SOCKET, WATCHDOG_USEC), and the test reads what
they send: READY only once they serve, WATCHDOG=1 while their loop turns, none while
the loop is wedged (CARPOOL_WEDGE_FILE), STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from carpool.client import Client
from carpool.common.clock import MonotonicClock

CARPOOL = [sys.executable, "-m", "carpool"]
#: The watchdog interval the processes are told (they ping at half of it).
WATCHDOG_USEC = 200_000
QUIET_S = 1.0  # five ping intervals with no ping: the loop is not turning


class Systemd:
    """The notify socket of a ``Type=notify`` unit, and the process it watches."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.path = path
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str] = queue.Queue()

    def start(self, *args: str, **env: str) -> subprocess.Popen[str]:
        environ = {
            **os.environ,
            "NOTIFY_SOCKET": str(self.path),
            "WATCHDOG_USEC": str(WATCHDOG_USEC),
            **env,
        }
        self.proc = subprocess.Popen(
            [*CARPOOL, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
        )
        stderr = self.proc.stderr
        assert stderr is not None
        self._reader = threading.Thread(target=self._read, args=(stderr,))
        self._reader.start()
        return self.proc

    def _read(self, stderr: Iterable[str]) -> None:
        for line in stderr:
            self.lines.put(line)

    def message(self, timeout_s: float) -> dict[str, str] | None:
        """The next message, as its fields; None when none comes within ``timeout_s``."""
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        return dict(line.split("=", 1) for line in data.decode().splitlines())

    def until(self, field: str, timeout_s: float = 60.0) -> list[dict[str, str]]:
        """Messages up to and including the first with ``field``."""
        clock = MonotonicClock()
        end = clock.now() + timeout_s
        seen = []
        while clock.now() < end:
            assert self.proc is not None
            assert self.proc.poll() is None, self.log()
            msg = self.message(0.2)
            if msg is not None:
                seen.append(msg)
                if field in msg:
                    return seen
        raise AssertionError(f"no {field} within {timeout_s} s: {seen}\n{self.log()}")

    def log_line(self, text: str, timeout_s: float = 30.0) -> None:
        while True:
            line = self.lines.get(timeout=timeout_s)
            if text in line:
                return

    def log(self) -> str:
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return "".join(out)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self._reader.join(timeout=10)
            assert self.proc.stderr is not None
            self.proc.stderr.close()
        self.sock.close()


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[Systemd]:
    unit = Systemd(tmp_path / "notify")
    yield unit
    unit.close()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A broker process without systemd: (frontend, backend)."""
    frontend, backend = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b"
    proc = subprocess.Popen(
        [*CARPOOL, "broker", "--frontend", frontend, "--backend", backend],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield frontend, backend
    proc.terminate()
    proc.wait(timeout=10)


def _watchdog_drill(systemd: Systemd, wedge: Path) -> None:
    """Pings come while the loop turns, none while it is wedged, and again after."""
    for _ in range(2):
        assert systemd.until("WATCHDOG")[-1]["WATCHDOG"] == "1"
    wedge.touch()
    systemd.log_line("the loop blocks until it is removed")
    # (a ping sent before the loop reached the file may still be in the socket)
    while systemd.message(0.05) is not None:
        pass
    assert systemd.message(QUIET_S) is None, "a wedged loop must not ping the watchdog"
    wedge.unlink()
    assert systemd.until("WATCHDOG", timeout_s=10.0)[-1]["WATCHDOG"] == "1"


def _stops(systemd: Systemd) -> None:
    assert systemd.proc is not None
    systemd.proc.terminate()
    assert systemd.until("STOPPING", timeout_s=10.0)[-1]["STOPPING"] == "1"
    assert systemd.proc.wait(timeout=30) == 0, systemd.log()


def test_the_broker_notifies_ready_pings_while_its_loop_turns_and_says_stopping(
    tmp_path: Path, systemd: Systemd
) -> None:
    frontend = f"ipc://{tmp_path}/front"
    wedge = tmp_path / "wedge"
    systemd.start(
        "broker", "--frontend", frontend, "--backend", f"ipc://{tmp_path}/back",
        CARPOOL_WEDGE_FILE=str(wedge),
    )  # fmt: skip
    (ready,) = systemd.until("READY")  # READY is the first thing it says
    assert ready["READY"] == "1"
    assert "workers=0" in ready["STATUS"]
    assert "queued=0" in ready["STATUS"]
    # Bound before READY: the first STATS after it is answered.
    with Client(frontend) as client:
        assert client.stats(timeout_s=5.0)["workers"] == []
    _watchdog_drill(systemd, wedge)
    status = systemd.until("STATUS")[-1]["STATUS"]
    assert "req/s=" in status
    assert "models=0" in status
    _stops(systemd)


def test_the_worker_notifies_ready_once_registered_and_pings_while_healthy(
    tmp_path: Path, systemd: Systemd, broker: tuple[str, str]
) -> None:
    frontend, backend = broker
    wedge = tmp_path / "wedge"
    systemd.start(
        "worker", "--broker", backend, "--synthetic", "1", "0", "--name", "w0",
        "--set", "heartbeat_s=0.2",
        CARPOOL_WEDGE_FILE=str(wedge),
    )  # fmt: skip
    before = systemd.until("READY")
    assert all("WATCHDOG" not in m for m in before)  # no pings before it is ready
    assert "model=synthetic" in before[-1]["STATUS"]
    assert "broker=registered" in before[-1]["STATUS"]
    # Registered before READY: the broker lists it.
    with Client(frontend) as client:
        assert [w["name"] for w in client.stats(timeout_s=5.0)["workers"]] == ["w0"]
    _watchdog_drill(systemd, wedge)
    _stops(systemd)


def test_without_notify_socket_nothing_is_sent_and_the_loop_is_not_bounded() -> None:
    from carpool.common.sdnotify import SdNotifier
    from carpool.common.supervision import LoopWatch

    notifier = SdNotifier({})
    assert not notifier.enabled
    assert notifier.watchdog_s is None
    assert not notifier.send(READY=1)
    assert LoopWatch(notifier, lambda: "").turn(0.0) is None
