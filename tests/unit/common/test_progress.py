"""Progress: plain periodic lines when piped (never a carriage return), a bar on a
terminal; and the commands that run long work write no carriage return when piped."""

from __future__ import annotations

import io
import subprocess
import sys

from carpool.common.progress import CountProgress, Progress
from carpool.common.testing import FakeClock


def test_piped_progress_is_a_line_every_interval_and_one_at_the_end() -> None:
    out = io.StringIO()
    clock = FakeClock()
    with Progress("sent", 1000, stream=out, every_s=5.0, clock=clock) as bar:
        for done in range(1000):
            bar.update(done, "3 in flight")
            clock.advance(0.02)  # 20 s in all: a line at 5, 10, 15 s
        bar.update(1000)
        bar.update(1000)  # the end, once
    lines = out.getvalue().splitlines(keepends=True)
    assert "\r" not in out.getvalue()
    assert [x.split(":")[0] for x in lines] == ["  sent"] * 4
    assert lines[-1] == "  sent: 1000/1000 (100%)\n"
    assert "3 in flight" in lines[0]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_redrawn_in_place() -> None:
    out = _Terminal()
    with Progress("grid search", 10, stream=out) as bar:
        for done in range(11):
            bar.update(done)
    assert "10/10" in out.getvalue()
    assert "\r" in out.getvalue() or "\x1b[" in out.getvalue()  # (redrawn, not appended)


def test_a_count_callback_starts_a_task_per_run() -> None:
    out = io.StringIO()
    callback = CountProgress("grid search", stream=out)
    for _ in range(2):
        for done in range(1, 4):
            callback(done, 3)
    assert out.getvalue() == "  grid search: 3/3 (100%)\n" * 2


def test_piped_commands_write_lines_not_carriage_returns() -> None:
    """carpool simulate's grid search (the oracle) on a short workload, piped."""
    result = subprocess.run(
        [sys.executable, "-m", "carpool", "simulate", "--rate", "300", "--duration-s", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr + result.stdout
    assert "  grid search: " in result.stderr
