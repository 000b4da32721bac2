"""supervisor.py: which processes of ``carpool up`` to start, restart and stop — pure.

:class:`Supervisor` keeps one table: a broker and the worker slots ``worker-0`` ..
``worker-{N-1}`` (N, the desired count, changes with :meth:`Supervisor.scale`). Events
go in with the time as an argument (``now``, monotonic seconds); what the shell must do
comes back as a list of :class:`Action` values (start, SIGTERM, SIGKILL a child). It never
reads a clock, starts a process or sends a signal (that is :mod:`carpool.up.processes`).

Restarts: a child that exits without being asked to is started again after a backoff
(``base_s``, doubling, at most ``max_s``). A run longer than ``stable_s`` forgets the
failures before it; after ``max_restarts`` quick failures in a row the slot is given up
(FAILED, left so), so a worker that cannot start does not spin. Stops: a child asked to
stop gets SIGTERM, and SIGKILL if it is still there ``stop_timeout_s`` later. On
:meth:`Supervisor.stop` the workers drain first; the broker gets its SIGTERM once every
worker is gone, so that their last results still reach it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from carpool.common.config import signs

BROKER = "broker"


def worker_name(index: int) -> str:
    """The name of worker slot ``index`` (its ``--name`` in STATS too)."""
    return f"worker-{index}"


class ChildState(enum.Enum):
    RUNNING = "running"  # started; not asked to stop
    BACKOFF = "backoff"  # exited on its own; started again at ``due_s``
    STOPPING = "stopping"  # SIGTERM sent; SIGKILL at ``due_s``
    KILLED = "killed"  # SIGKILL sent; waiting for its exit
    FAILED = "failed"  # exited too often too quickly: given up


class Verb(enum.Enum):
    START = "start"
    TERMINATE = "terminate"  # SIGTERM: drain and exit
    KILL = "kill"  # SIGKILL


@dataclass(frozen=True, slots=True)
class Action:
    """What the shell must do to child ``name``."""

    verb: Verb
    name: str


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    base_s: float = 0.5  # the first restart's delay
    max_s: float = 30.0  # the longest delay
    stable_s: float = 10.0  # a run this long forgets the failures before it
    max_restarts: int = 5  # quick failures in a row before a slot is given up
    stop_timeout_s: float = 10.0  # from SIGTERM to SIGKILL

    def __post_init__(self) -> None:
        positive = ("base_s", "max_s", "stop_timeout_s")
        problems = signs(self, positive=positive, non_negative=("stable_s", "max_restarts"))
        if problems:
            raise ValueError("restart policy: " + "; ".join(problems))

    def delay_s(self, failures: int) -> float:
        """The wait before the restart that follows ``failures`` quick failures (>= 1)."""
        return float(min(self.max_s, self.base_s * 2 ** max(0, failures - 1)))


@dataclass(slots=True)
class Child:
    """One slot of the table, as the supervisor sees it."""

    name: str
    state: ChildState
    started_s: float
    due_s: float = 0.0  # BACKOFF: when to start again; STOPPING: when to SIGKILL
    failures: int = 0  # quick exits in a row
    restarts: int = 0  # times started again after an exit of its own
    last_exit: int | None = None  # its last exit status (negative: killed by that signal)


@dataclass(frozen=True, slots=True)
class ChildView:
    name: str
    state: str
    restarts: int
    last_exit: int | None


@dataclass(slots=True)
class Supervisor:
    """The table of ``carpool up``'s processes and the decisions about them.

    Args:
        workers: the desired number of workers at the start.
        policy: restart and stop timings.
    """

    workers: int
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    children: dict[str, Child] = field(default_factory=dict)
    shutting_down: bool = False
    gave_up_broker: bool = False  # the broker exited too often: the fleet must stop

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")

    # ------------------------------------------------------------------ events

    def on_start(self, now: float) -> list[Action]:
        """The fleet starts: the broker, then every desired worker."""
        return [self._start(now, BROKER), *self._fill(now)]

    def on_exit(self, now: float, name: str, status: int | None) -> list[Action]:
        """Child ``name`` exited with ``status`` (None: it could not be started at all)."""
        child = self.children.get(name)
        if child is None:
            return []
        child.last_exit = status
        if self.shutting_down:
            del self.children[name]
            return self._stop_broker_when_alone(now)
        if child.state in (ChildState.STOPPING, ChildState.KILLED):
            del self.children[name]  # asked to stop: wanted again only if scaled back up
            return self._fill(now)
        if child.state is not ChildState.RUNNING:
            return []
        child.failures = 1 if now - child.started_s >= self.policy.stable_s else child.failures + 1
        if child.failures > self.policy.max_restarts:
            child.state = ChildState.FAILED
            self.gave_up_broker |= name == BROKER
            return []
        child.state = ChildState.BACKOFF
        child.due_s = now + self.policy.delay_s(child.failures)
        return []

    def on_tick(self, now: float) -> list[Action]:
        """Restarts whose backoff is over, SIGKILLs whose stop timeout is."""
        actions: list[Action] = []
        for child in list(self.children.values()):
            if child.due_s > now:
                continue
            if child.state is ChildState.BACKOFF:
                child.restarts += 1
                actions.append(self._start(now, child.name, child))
            elif child.state is ChildState.STOPPING:
                child.state = ChildState.KILLED
                actions.append(Action(Verb.KILL, child.name))
        return actions

    def scale(self, now: float, workers: int) -> list[Action]:
        """Make the desired count ``workers``: start the slots missing, stop those above."""
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if self.shutting_down:
            return []
        self.workers = workers
        actions: list[Action] = []
        for name, child in list(self.children.items()):
            if name == BROKER or _index(name) < workers:
                continue
            if child.state in (ChildState.BACKOFF, ChildState.FAILED):
                del self.children[name]  # nothing running to stop
            elif child.state is ChildState.RUNNING:
                actions.append(self._terminate(now, child))
        for name, child in list(self.children.items()):
            if child.state is ChildState.FAILED and name != BROKER:
                del self.children[name]  # an operator's new count gives it a new chance
        return actions + self._fill(now)

    def stop(self, now: float) -> list[Action]:
        """Stop everything: SIGTERM the workers now, the broker once they are gone."""
        self.shutting_down = True
        actions: list[Action] = []
        for name, child in list(self.children.items()):
            if child.state in (ChildState.BACKOFF, ChildState.FAILED):
                del self.children[name]
            elif child.state is ChildState.RUNNING and name != BROKER:
                actions.append(self._terminate(now, child))
        return actions + self._stop_broker_when_alone(now)

    # ------------------------------------------------------------------ queries

    def next_wakeup(self) -> float | None:
        """The earliest restart or SIGKILL due (None: nothing is timed)."""
        due = [
            c.due_s
            for c in self.children.values()
            if c.state in (ChildState.BACKOFF, ChildState.STOPPING)
        ]
        return min(due, default=None)

    @property
    def done(self) -> bool:
        """Shut down, and every child has exited."""
        return self.shutting_down and not self.children

    def snapshot(self) -> list[ChildView]:
        """The table, broker first, then the workers by index."""
        ordered = sorted(self.children.values(), key=lambda c: _index(c.name))
        return [ChildView(c.name, c.state.value, c.restarts, c.last_exit) for c in ordered]

    # ------------------------------------------------------------------ helpers

    def _start(self, now: float, name: str, child: Child | None = None) -> Action:
        if child is None:
            self.children[name] = Child(name, ChildState.RUNNING, now)
        else:
            child.state, child.started_s = ChildState.RUNNING, now
        return Action(Verb.START, name)

    def _terminate(self, now: float, child: Child) -> Action:
        child.state = ChildState.STOPPING
        child.due_s = now + self.policy.stop_timeout_s
        return Action(Verb.TERMINATE, child.name)

    def _fill(self, now: float) -> list[Action]:
        """Start the desired worker slots that have no child."""
        return [
            self._start(now, worker_name(i))
            for i in range(self.workers)
            if worker_name(i) not in self.children
        ]

    def _stop_broker_when_alone(self, now: float) -> list[Action]:
        broker = self.children.get(BROKER)
        if broker is None or len(self.children) > 1 or broker.state is not ChildState.RUNNING:
            return []
        return [self._terminate(now, broker)]


def _index(name: str) -> int:
    """A slot's place in the table: the broker first, then the workers by number."""
    return -1 if name == BROKER else int(name.rsplit("-", 1)[1])
