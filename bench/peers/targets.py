"""targets.py: the servers the peers harness loads, each behind one interface.

A :class:`Target` starts its processes (:meth:`Target.start` returns once its client
endpoint answers requests for the model), names their pids (:meth:`Target.pids`, by
role), answers STATS (:func:`stats`: carpool's, or the floor's map of the same shape)
and ends its processes by pid (:meth:`Target.stop`: SIGTERM, a bounded wait, SIGKILL).
Every endpoint is ``tcp://127.0.0.1`` on a free port. Each child gets SIGTERM when the
harness dies (``PR_SET_PDEATHSIG``), so an interrupted run leaves no server behind.

Targets by name (:func:`make`):

- ``carpool-default``: ``carpool broker --policy carpool --max-batch 16 --max-wait-ms 5``
  and one ``carpool worker --model mlp=FILE --threads 1``, this checkout's ``src``;
- ``carpool-fixed``: the same with ``--policy fixed``;
- ``greedy``: the floor (:mod:`peers.greedy`), one process;
- ``carpool@REV``: carpool default at git revision REV, its processes run with
  ``PYTHONPATH=<worktree>/src`` of a worktree that :func:`revision_trees` makes
  (bench/compare_revs.py's ``worktrees``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq
from common import START_TIMEOUT_S, _die_with_parent, free_port, stop_all

from carpool.common.protocol import Command, decode_meta, header, pack

ROOT = Path(__file__).resolve().parents[2]
GREEDY = Path(__file__).resolve().parent / "greedy.py"
MODEL = "mlp"
MAX_BATCH = 16
MAX_WAIT_MS = 5
_ids = itertools.count(1)


def env_for(src: Path) -> dict[str, str]:
    """This interpreter's environment with ``src`` as the ``carpool`` it imports."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src)
    env.pop("PYTHONHOME", None)
    return env


def stats(endpoint: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The STATS map of the server at ``endpoint``, or None without an answer in time."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        rid = next(_ids)
        sock.send_multipart([header(Command.STATS), pack({"id": rid})])
        until = time.monotonic() + timeout_s
        while (rem := until - time.monotonic()) > 0:
            if not sock.poll(max(1, int(rem * 1000))):
                continue
            frames = sock.recv_multipart()
            if len(frames) >= 2 and frames[0] == header(Command.STATS):
                meta = decode_meta(frames[1])
                if meta.get("id") == rid:
                    return meta
        return None
    finally:
        sock.close()
        ctx.term()


class Target:
    """One server under load: its processes (by role) and its client endpoint."""

    def __init__(self, name: str, src: Path, model_path: Path) -> None:
        self.name = name
        self.src = src  # the ``src`` folder whose carpool its processes run
        self.model_path = model_path
        self.endpoint = ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts = 0

    def commands(self, frontend: str) -> dict[str, list[str]]:
        """The command of each process, by role, for a client endpoint ``frontend``."""
        raise NotImplementedError

    def ready(self, snapshot: Mapping[str, Any]) -> bool:
        """Whether a STATS answer says the target serves the model."""
        return True

    def start(self) -> str:
        """Start the processes; return the client endpoint once the model is served."""
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        env = env_for(self.src)
        for role, cmd in self.commands(self.endpoint).items():
            self.procs[role] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, env=env, cwd=ROOT, preexec_fn=_die_with_parent
            )
        until = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < until:
            if not self.alive():
                self.stop()
                raise RuntimeError(f"{self.name}: a process exited while starting")
            snapshot = stats(self.endpoint, 0.5)
            if snapshot is not None and self.ready(snapshot):
                return self.endpoint
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name}: not serving {MODEL} after {START_TIMEOUT_S:.0f} s")

    def restart(self) -> str:
        """Stop what is left and start again (counted in :attr:`restarts`)."""
        self.stop()
        self.restarts += 1
        return self.start()

    def pids(self) -> dict[str, int]:
        return {role: proc.pid for role, proc in self.procs.items()}

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs.values())

    def stop(self) -> None:
        """End this target's processes by pid (SIGTERM, bounded wait, SIGKILL)."""
        stop_all(list(reversed(self.procs.values())))
        self.procs.clear()


class Carpool(Target):
    """A carpool broker and one ONNX Runtime worker."""

    def __init__(self, name: str, src: Path, model_path: Path, policy: str) -> None:
        super().__init__(name, src, model_path)
        self.policy = policy

    def commands(self, frontend: str) -> dict[str, list[str]]:
        backend = f"tcp://127.0.0.1:{free_port()}"
        carpool = [sys.executable, "-m", "carpool", "--log-level", "WARNING"]
        broker = [
            *carpool, "broker", "--frontend", frontend, "--backend", backend,
            "--policy", self.policy, "--max-batch", str(MAX_BATCH),
            "--max-wait-ms", str(MAX_WAIT_MS),
        ]  # fmt: skip
        worker = [
            *carpool, "worker", "--broker", backend,
            "--model", f"{MODEL}={self.model_path}", "--threads", "1",
        ]  # fmt: skip
        return {"broker": broker, "worker": worker}

    def ready(self, snapshot: Mapping[str, Any]) -> bool:
        return any(MODEL in w.get("models", ()) for w in snapshot.get("workers", ()))


class Greedy(Target):
    """The floor: :mod:`peers.greedy`, one process."""

    def commands(self, frontend: str) -> dict[str, list[str]]:
        cmd = [sys.executable, str(GREEDY), frontend, "--model", str(self.model_path)]
        return {"greedy": [*cmd, "--name", MODEL, "--max-batch", str(MAX_BATCH), "--threads", "1"]}


def make(name: str, model_path: Path, trees: Mapping[str, Path]) -> Target:
    """The target called ``name``; ``trees`` maps a revision to its worktree."""
    src = ROOT / "src"
    if name == "carpool-default":
        return Carpool(name, src, model_path, "carpool")
    if name == "carpool-fixed":
        return Carpool(name, src, model_path, "fixed")
    if name == "greedy":
        return Greedy(name, src, model_path)
    if name.startswith("carpool@"):
        return Carpool(name, trees[name.partition("@")[2]] / "src", model_path, "carpool")
    raise ValueError(
        f"unknown target {name!r} (carpool-default, carpool-fixed, greedy, carpool@REV)"
    )


@contextlib.contextmanager
def revision_trees(names: Sequence[str]) -> Iterator[dict[str, Path]]:
    """A worktree for each ``carpool@REV`` in ``names`` (REV -> its tree), removed on exit."""
    from compare_revs import worktrees

    revs = [n.partition("@")[2] for n in names if n.startswith("carpool@")]
    with worktrees({f"r{i}": rev for i, rev in enumerate(revs)}) as made:
        trees = {rev: made[f"r{i}"].tree for i, rev in enumerate(revs)}
        for rev, tree in trees.items():
            where = subprocess.run(
                [sys.executable, "-c", "import carpool; print(carpool.__file__)"],
                env=env_for(tree / "src"),
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            if not Path(where).is_relative_to(tree):
                raise RuntimeError(f"carpool@{rev} imports {where}, not its worktree's")
        yield trees


def commit_of(rev: str = "HEAD") -> str:
    """The commit ``rev`` names in this checkout (with ``-dirty`` for a changed HEAD tree)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    commit = git("rev-parse", "--short", f"{rev}^{{commit}}")
    if rev == "HEAD" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return commit
