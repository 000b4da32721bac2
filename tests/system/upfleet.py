"""A ``carpool up`` subprocess for the tests: start it on ipc:// endpoints under a test's
tmp_path, find its children, wait for STATS to list its workers, stop it (SIGTERM, then
SIGKILL of whatever is left: only processes it started)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from carpool.client import Client
from carpool.common.clock import MonotonicClock

STOP_TIMEOUT_S = 30.0
# A synthetic engine: no model file to load, so a worker registers in a second or two.
SYNTHETIC = ("--synthetic", "2", "0.5")


class UpFleet:
    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.tmp_path = tmp_path
        self.frontend = f"ipc://{tmp_path}/frontend"
        self.log = tmp_path / "up.log"
        command = [
            *(sys.executable, "-m", "carpool", "up"),
            *("--frontend", self.frontend, "--backend", f"ipc://{tmp_path}/backend"),
            *("--stop-timeout-s", "10", *args),
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.seen: dict[int, psutil.Process] = {}  # every child seen, by pid
        self.clock = MonotonicClock()
        self.left: list[int] = []  # children still running after stop()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def until(self, what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """Poll ``check`` until it returns something true (at most ``timeout_s``)."""
        deadline = self.clock.now() + timeout_s
        while self.clock.now() < deadline:
            assert self.proc.poll() is None, f"carpool up exited\n{self.output()}"
            got = check()
            if got:
                return got
            self.proc_wait(0.1)
        raise AssertionError(f"{what}: not within {timeout_s:g} s\n{self.output()}")

    def proc_wait(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)

    def children(self) -> dict[str, psutil.Process]:
        """Its live children by name (``broker``, ``worker-k``)."""
        out = {}
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return {}
        for kid in kids:
            try:
                cmdline = kid.cmdline()
                if kid.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                continue
            self.seen[kid.pid] = kid
            name = cmdline[cmdline.index("--name") + 1] if "--name" in cmdline else "broker"
            out[name] = kid
        return out

    def page_url(self) -> tuple[str, str]:
        """The page's URL and token, as ``carpool up`` printed them."""
        found = self.until(
            "the page's URL", lambda: re.search(r"fleet page (\S+)#token=(\S+)", self.output())
        )
        return found.group(1), found.group(2)

    def registered(self, client: Client) -> list[str]:
        """The names of the workers STATS lists (empty while the broker does not answer)."""
        try:
            return sorted(str(w["name"]) for w in client.stats(timeout_s=2.0)["workers"])
        except TimeoutError:
            return []

    def status_workers(self) -> list[str]:
        """The names of the workers ``carpool status --json`` lists (empty while the
        broker does not answer: exit status 2)."""
        done = subprocess.run(
            [sys.executable, "-m", "carpool", "status", "--json", "--endpoint", self.frontend],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode == 2:
            return []
        assert done.returncode in (0, 1), done.stderr
        return sorted(str(w["name"]) for w in json.loads(done.stdout)["workers"])

    def until_workers(self, client: Client, names: list[str], timeout_s: float = 60.0) -> None:
        self.until(
            f"STATS lists {names}",
            lambda: (
                self.registered(client) == names
                and sorted(self.children()) == sorted(["broker", *names])
            ),
            timeout_s,
        )

    def stop(self) -> int:
        """SIGTERM it and wait; SIGKILL it and any child of its left after the timeout."""
        if self.proc.poll() is None:
            self.children()  # (remember the latest children, to check they are gone)
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.left = self.orphans()
            for pid in self.left:
                self.seen[pid].kill()

    def orphans(self) -> list[int]:
        """The children seen that still run."""
        return [
            pid
            for pid, kid in self.seen.items()
            if kid.is_running() and kid.status() != psutil.STATUS_ZOMBIE
        ]
