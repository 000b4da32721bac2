"""worker/tensorrt/progress.py: TensorRT's build phases as plain lines (not a terminal)
or rich progress bars (a terminal)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import Progress

from carpool.worker.tensorrt.progress import PlainListener, RichListener, listener_for


def test_plain_lines_show_phases_nested_and_every_tenth_step() -> None:
    out = io.StringIO()
    listener = PlainListener(out)
    listener.phase_start("Building engine", None, 1)
    listener.phase_start("Tactic timing", "Building engine", 20)
    assert all(listener.step_complete("Tactic timing", step) for step in range(20))
    listener.phase_finish("Tactic timing")
    listener.phase_finish("Building engine")
    assert out.getvalue().splitlines() == [
        "Building engine: started",
        "  Tactic timing: started (20 steps)",
        *(f"  Tactic timing: {n}/20" for n in range(2, 20, 2)),
        "  Tactic timing: done",
        "Building engine: done",
    ]


def test_a_stream_that_is_no_terminal_gets_plain_lines() -> None:
    with listener_for(io.StringIO()) as listener:
        assert isinstance(listener, PlainListener)


def test_a_terminal_gets_a_bar_per_phase_removed_when_it_ends() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=80)
    with Progress(console=console) as progress:
        listener = RichListener(progress)
        listener.phase_start("Building engine", None, 3)
        (task,) = progress.tasks
        assert (task.description, task.total) == ("Building engine", 3)
        assert listener.step_complete("Building engine", 1)
        assert progress.tasks[0].completed == 2
        listener.phase_finish("Building engine")
        assert progress.tasks == []
