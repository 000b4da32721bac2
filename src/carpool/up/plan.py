"""plan.py: the command line of each process ``carpool up`` starts — pure.

Every child is ``python -m carpool broker ...`` or ``python -m carpool worker ...``: the
same entry points an operator runs by hand, so a fleet under ``carpool up`` behaves as
one started by systemd. Worker slot k is named ``worker-k`` (its name in STATS).

Metrics ports (``--metrics-base PORT``): the broker listens on PORT and worker k on
PORT + 1 + k, all on 127.0.0.1, so a slot keeps its port across restarts and scaling.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from carpool.up.supervisor import BROKER

#: The highest port a metrics listener may take.
MAX_PORT = 65535


def metrics_port(base: int, name: str) -> int:
    """The metrics port of child ``name`` under ``--metrics-base base``: the broker's is
    ``base``, worker k's ``base + 1 + k``."""
    if name == BROKER:
        return base
    return base + 1 + int(name.rsplit("-", 1)[1])


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """How to start the broker and each worker.

    Args:
        frontend: the broker's client endpoint.
        backend: the broker's worker endpoint (the workers connect to it).
        broker_args: further ``carpool broker`` flags (batching caps, CURVE, config).
        worker_args: further ``carpool worker`` flags (models, limits, CURVE, config).
        metrics_base: ``--metrics-base``, or None (no metrics listeners).
        metrics_flag: the commands that take ``--metrics HOST:PORT`` (``carpool up`` gives
            :data:`~carpool.commandline.METRICS_COMMANDS`).
        log_level: the children's ``--log-level``.
    """

    frontend: str
    backend: str
    broker_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    metrics_base: int | None = None
    metrics_flag: frozenset[str] = frozenset()
    log_level: str = "INFO"
    python: str = sys.executable

    def argv(self, name: str) -> list[str]:
        """The command line of child ``name`` (``broker`` or ``worker-k``)."""
        head = [self.python, "-m", "carpool", "--log-level", self.log_level]
        if name == BROKER:
            args = [BROKER, "--frontend", self.frontend, "--backend", self.backend]
            args += self.broker_args
        else:
            args = ["worker", "--broker", self.backend, "--name", name, *self.worker_args]
        role = args[0]
        if self.metrics_base is not None and role in self.metrics_flag:
            args += ["--metrics", f"127.0.0.1:{metrics_port(self.metrics_base, name)}"]
        return head + args

    def check(self, max_workers: int) -> list[str]:
        """Problems with the plan for up to ``max_workers`` workers (empty: none)."""
        if self.metrics_base is None:
            return []
        top = metrics_port(self.metrics_base, f"worker-{max_workers - 1}")
        if self.metrics_base < 1 or top > MAX_PORT:
            return [
                f"--metrics-base {self.metrics_base}: the ports {self.metrics_base}..{top} "
                f"(broker, then {max_workers} workers) must lie in 1..{MAX_PORT}"
            ]
        return []
