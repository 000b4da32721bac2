"""commandline.py: the parts that several ``carpool`` commands' parsers share.

A command is registered from the function that runs it (:func:`add_command`): the first
paragraph of its docstring is the command's line in ``carpool --help``, the rest its
description in ``carpool COMMAND --help`` (argparse re-wraps both), as click takes a
command's help from its function. Flags that mean the same in several commands are
defined once: the batching caps (``broker``, ``record``, ``replay``) and the bursts of a
load schedule (``bench``, ``simulate``). Which commands take ``--metrics`` is one table,
:data:`METRICS_COMMANDS`: ``carpool``'s parser adds the flag to exactly those, and ``carpool
up`` passes it to the broker and workers it starts.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

from carpool.broker.config import POLICIES, BatchingConfig

Command = Callable[[argparse.Namespace], int]

#: The commands that serve Prometheus metrics: each takes ``--metrics HOST:PORT``
#: (:func:`add_metrics_flag`), ``broker`` and ``worker`` also under ``carpool up --metrics-base``.
METRICS_COMMANDS = frozenset({"broker", "record", "worker"})


def add_command(sub: Any, name: str, func: Command, **kwargs: Any) -> argparse.ArgumentParser:
    """Add sub-command ``name`` (on ``add_subparsers()``'s object), run by ``func``; its
    help and description come from ``func``'s docstring, ``kwargs`` go to ``add_parser``."""
    summary, _, rest = (inspect.getdoc(func) or "").partition("\n\n")
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=" ".join(summary.split()), description=" ".join(rest.split()) or None, **kwargs
    )
    parser.set_defaults(func=func)
    return parser


def add_batching_flags(group: Any, defaults: BatchingConfig | None = None) -> None:
    """``--max-batch``, ``--max-wait-ms`` and ``--policy`` on ``group`` (a parser or an
    argument group). Without ``defaults`` a flag not given is None (a broker's config file
    decides); with them, a simulated broker's settings default to theirs (shown in help)."""
    shown = defaults is not None
    base = defaults or BatchingConfig()
    group.add_argument(
        "--max-batch",
        type=int,
        default=base.max_batch if shown else None,
        help="B_max: samples per batch at most" + (" (default %(default)s)" if shown else ""),
    )
    group.add_argument(
        "--max-wait-ms",
        type=float,
        default=base.max_wait_s * 1000 if shown else None,
        help="T_max: longest wait of the oldest request"
        + (" (default %(default)g)" if shown else ""),
    )
    group.add_argument(
        "--policy",
        choices=POLICIES,
        default=base.policy if shown else None,
        help="batching policy (default "
        + ("%(default)s)" if shown else "carpool: deadline-aware, adaptive)"),
    )


def add_metrics_flag(parser: Any) -> None:
    """``--metrics HOST:PORT``: the Prometheus endpoint of a command of :data:`METRICS_COMMANDS`."""
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve /metrics, /healthz and /readyz here (a bare PORT: on 127.0.0.1; "
        "default: none; docs/operations.md)",
    )


def add_burst_flags(group: Any, *, burst_rps: float, period: str) -> None:
    """``--burst-rps``, ``--period-s`` and ``--burst-s``: the bursts of a ``bursts`` load
    (``workload.bursts``), ``burst_rps`` their default rate; ``period`` the help of
    ``--period-s``."""
    group.add_argument("--burst-rps", type=float, default=burst_rps, help="bursts: rate in a burst")
    group.add_argument("--period-s", type=float, default=2.0, help=period)
    group.add_argument("--burst-s", type=float, default=0.3, help="bursts: burst length")
