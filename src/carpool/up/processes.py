"""processes.py: the shell around :class:`~carpool.up.supervisor.Supervisor` — real processes.

:class:`FleetRunner` owns the child processes (one owner: the thread that calls
:meth:`FleetRunner.run`), carries out the supervisor's actions (start with
``subprocess.Popen``, SIGTERM, SIGKILL) and feeds it the exits it sees. It sleeps in
``select`` on a :class:`~carpool.common.wake.WakePipe` until the next restart or SIGKILL is
due: a child's exit (SIGCHLD, through ``signal.set_wakeup_fd``), a stop (SIGTERM, SIGINT)
or a new worker count from another thread (the fleet page) wakes it early. The process
seam (:data:`Launch`) is where tests put fake processes.
"""

from __future__ import annotations

import logging
import select
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from carpool.common.clock import Clock, MonotonicClock
from carpool.common.wake import WakePipe
from carpool.up.plan import FleetPlan
from carpool.up.supervisor import Action, ChildState, Supervisor, Verb

logger = logging.getLogger(__name__)

#: The longest sleep between two looks at the children, whatever wakes the loop (a
#: SIGCHLD lost because the loop does not run on the main thread, say).
GUARD_S = 1.0


class Process(Protocol):
    """What the runner needs of a child (``subprocess.Popen`` has it)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


Launch = Callable[[list[str]], Process]


def popen(argv: list[str]) -> Process:
    """Start ``argv`` with stdin closed; its output goes where ours does (the journal)."""
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


@dataclass(frozen=True, slots=True)
class ChildStatus:
    name: str
    state: str
    pid: int | None  # None while it waits to be started again
    restarts: int
    last_exit: int | None


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """The table as the runner published it last (read from any thread)."""

    desired: int
    children: tuple[ChildStatus, ...]
    stopping: bool

    def workers(self) -> list[ChildStatus]:
        return [c for c in self.children if c.name != "broker"]


class FleetRunner:
    """Run a fleet's processes until stopped.

    Args:
        plan: the command line of each child.
        supervisor: the decisions (desired count, restarts, stops).
        launch: starts one child (``popen``; a fake in tests).
        clock: the time the supervisor is given.
    """

    def __init__(
        self,
        plan: FleetPlan,
        supervisor: Supervisor,
        *,
        launch: Launch = popen,
        clock: Clock | None = None,
    ) -> None:
        self.plan = plan
        self.supervisor = supervisor
        self.launch = launch
        self.clock: Clock = clock or MonotonicClock()
        self.wake = WakePipe()
        self.processes: dict[str, Process] = {}
        self._stop_asked = False  # set by a signal handler: a plain flag, then a wake-up
        self._scales: deque[int] = deque()  # counts asked for by other threads
        self._lock = threading.Lock()
        self._status = FleetStatus(supervisor.workers, (), stopping=False)
        self._started = False

    # ------------------------------------------------------------------ any thread

    def request_stop(self) -> None:
        """Stop the fleet (safe from a signal handler)."""
        self._stop_asked = True
        self.wake.wake()

    def request_scale(self, workers: int) -> None:
        """Make the desired worker count ``workers`` (from any thread)."""
        self._scales.append(workers)
        self.wake.wake()

    def status(self) -> FleetStatus:
        with self._lock:
            return self._status

    # ------------------------------------------------------------------ owner

    def run(self) -> int:
        """Start the fleet and supervise it until it is stopped and every child exited.

        Returns:
            0 after a stop asked for; 1 when the broker could not be kept running.
        """
        while not self.step(GUARD_S):
            pass
        return 1 if self.supervisor.gave_up_broker else 0

    def step(self, guard_s: float) -> bool:
        """One look at the children (waiting at most ``guard_s`` for a reason to look);
        True once the fleet is down."""
        if not self._started:
            self._started = True
            self._carry_out(self.supervisor.on_start(self.clock.now()))
        else:
            self._wait(guard_s)
        now = self.clock.now()
        actions: list[Action] = []
        while self._scales:
            workers = self._scales.popleft()
            logger.info("workers: %d -> %d", self.supervisor.workers, workers)
            actions += self.supervisor.scale(now, workers)
        for name, proc in list(self.processes.items()):
            status = proc.poll()
            if status is not None:
                del self.processes[name]
                actions += self._exited(now, name, status)
        # (after the exits: a child that Ctrl-C stopped before us is not started again)
        gave_up = self.supervisor.gave_up_broker
        if (self._stop_asked or gave_up) and not self.supervisor.shutting_down:
            if gave_up:
                logger.error("the broker keeps exiting: stopping the fleet")
            actions += self.supervisor.stop(now)
        actions += self.supervisor.on_tick(now)
        self._carry_out(actions)
        self._publish()
        return self.supervisor.done

    def close(self) -> None:
        self.wake.close()

    # ------------------------------------------------------------------ helpers

    def _wait(self, guard_s: float) -> None:
        due = self.supervisor.next_wakeup()
        timeout_s = guard_s if due is None else min(guard_s, max(0.0, due - self.clock.now()))
        readable, _, _ = select.select([self.wake.fd], [], [], timeout_s)
        if readable:
            self.wake.clear()

    def _exited(self, now: float, name: str, status: int | None) -> list[Action]:
        actions = self.supervisor.on_exit(now, name, status)
        child = self.supervisor.children.get(name)
        if child is not None and child.state is ChildState.BACKOFF:
            logger.warning(
                "%s exited (status %s); starting it again in %.1f s",
                name,
                status,
                child.due_s - now,
            )
        elif child is not None and child.state is ChildState.FAILED:
            logger.error(
                "%s exited (status %s) %d times in a row: given up",
                name,
                status,
                child.failures,
            )
        else:
            logger.info("%s exited (status %s)", name, status)
        return actions

    def _carry_out(self, actions: list[Action]) -> None:
        while actions:
            action = actions.pop(0)
            proc = self.processes.get(action.name)
            if action.verb is Verb.START:
                try:
                    self.processes[action.name] = started = self.launch(self.plan.argv(action.name))
                except OSError as exc:
                    logger.error("cannot start %s: %s", action.name, exc)
                    actions += self._exited(self.clock.now(), action.name, None)
                    continue
                logger.info("started %s (pid %d)", action.name, started.pid)
            elif proc is not None and action.verb is Verb.TERMINATE:
                proc.send_signal(signal.SIGTERM)
            elif proc is not None and action.verb is Verb.KILL:
                logger.warning("%s did not stop in time: SIGKILL", action.name)
                proc.send_signal(signal.SIGKILL)

    def _publish(self) -> None:
        children = tuple(
            ChildStatus(
                c.name,
                c.state,
                self.processes[c.name].pid if c.name in self.processes else None,
                c.restarts,
                c.last_exit,
            )
            for c in self.supervisor.snapshot()
        )
        status = FleetStatus(self.supervisor.workers, children, self.supervisor.shutting_down)
        with self._lock:
            self._status = status
