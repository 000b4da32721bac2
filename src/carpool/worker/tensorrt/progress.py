"""progress.py: what a build shows while TensorRT works — a rich progress display on a
terminal, plain lines elsewhere (a log, a CI job).

Both hear TensorRT's IProgressMonitor calls (phase started with its step count, step
done, phase finished; phases nest), through the BuildListener of :mod:`.build`. The plain one
prints a phase's start and end and a line each tenth of its steps, so a long build
shows it is alive without flooding a log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["PlainListener", "RichListener", "listener_for"]


class PlainListener:
    """Phases as lines on ``stream``."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._steps: dict[str, int] = {}
        self._depth: dict[str, int] = {}

    def _say(self, phase: str, text: str) -> None:
        indent = "  " * self._depth.get(phase, 0)
        print(f"{indent}{phase}: {text}", file=self._stream, flush=True)

    def phase_start(self, phase: str, parent: str | None, steps: int) -> None:
        self._steps[phase] = steps
        self._depth[phase] = self._depth.get(parent, -1) + 1 if parent is not None else 0
        self._say(phase, f"started ({steps} steps)" if steps > 1 else "started")

    def step_complete(self, phase: str, step: int) -> bool:
        steps = self._steps.get(phase, 0)
        done = step + 1
        if steps >= 10 and done < steps and done * 10 // steps != step * 10 // steps:
            self._say(phase, f"{done}/{steps}")
        return True

    def phase_finish(self, phase: str) -> None:
        self._say(phase, "done")
        self._steps.pop(phase, None)
        self._depth.pop(phase, None)


class RichListener:
    """Phases as rich progress bars (a spinner for a one-step phase)."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._tasks: dict[str, TaskID] = {}

    def phase_start(self, phase: str, parent: str | None, steps: int) -> None:
        indent = "  " if parent is not None else ""
        self._tasks[phase] = self._progress.add_task(f"{indent}{phase}", total=max(steps, 1))

    def step_complete(self, phase: str, step: int) -> bool:
        task = self._tasks.get(phase)
        if task is not None:
            self._progress.update(task, completed=step + 1)
        return True

    def phase_finish(self, phase: str) -> None:
        task = self._tasks.pop(phase, None)
        if task is not None:
            self._progress.remove_task(task)


@contextlib.contextmanager
def listener_for(stream: IO[str]) -> Iterator[PlainListener | RichListener]:
    """A rich display when ``stream`` is a terminal, else plain lines."""
    if not stream.isatty():
        yield PlainListener(stream)
        return
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=stream),
        transient=True,
    )
    with progress:
        yield RichListener(progress)
