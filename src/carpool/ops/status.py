"""status.py: ``carpool status``: the fleet once, from the broker's STATS.

Asks the broker at ``--endpoint`` for STATS (with CURVE keys when it has CURVE on: an
operator's key, docs/security.md), waits at most ``--timeout`` seconds, and prints the
models and workers (rich tables on a terminal, aligned text in a pipe, or ``--json``).
Exit status: 0 healthy, 1 when a model has no live worker (or no worker is registered),
2 when the broker does not answer (or refuses STATS, or the keys are wrong).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

import zmq
from rich.console import Console, Group, RenderableType
from rich.table import Table as RichTable
from rich.text import Text

from carpool.common.errors import ConfigError, RequestError
from carpool.ops import fleet

if TYPE_CHECKING:  # (the client loads when a command asks the broker)
    from carpool.client import Client

__all__ = ["add_client_flags", "fetch", "open_client", "renderable", "run_status"]


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the commands that ask a broker (``status``, ``top``, ``models
    show``): the broker, the wait, the CURVE keys."""
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="broker frontend")
    parser.add_argument(
        "--timeout", type=float, default=2.0, help="seconds to wait for an answer (default 2)"
    )
    c = parser.add_argument_group("CURVE", "for a broker with CURVE on (docs/security.md)")
    c.add_argument(
        "--curve-server-key", metavar="FILE", default="", help="the broker's public .key"
    )
    c.add_argument(
        "--curve-key",
        metavar="FILE",
        default="",
        help="this client's .key_secret (STATS: an operator's)",
    )


def open_client(args: argparse.Namespace) -> Client:
    """A client for questions to the broker (``ConfigError`` for keys that go wrong)."""
    from carpool.client import Client

    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be more than 0, got {args.timeout:g}")
    try:
        return Client(
            args.endpoint,
            curve_server_key=args.curve_server_key,
            curve_key=args.curve_key,
            send_timeout_s=args.timeout,
        )
    except ValueError as exc:  # (the options' own check: keys come in pairs)
        raise ConfigError(str(exc)) from None
    except zmq.ZMQError as exc:  # a malformed endpoint
        raise ConfigError(f"--endpoint {args.endpoint!r}: {exc}") from None


def fetch(client: Client, timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """The broker's STATS, or None and why not."""
    try:
        return client.stats(timeout_s), ""
    except TimeoutError:
        return None, f"no answer from the broker within {timeout_s:g} s"
    except RequestError as exc:  # PermissionDenied: not an operator's key
        return None, f"the broker refused STATS: {exc}"


def _status(args: argparse.Namespace) -> int:
    """print the fleet once: models, workers, load, B_max, queues, latency, errors

    Asks the broker for STATS and prints every model (live workers healthy/all, current
    B_max and T_max, queued samples, requests answered, errors, p50/p95/p99 of the last
    60 s) and every worker (transport, health, slots, batches in flight, rho, B_max per
    model). Exit status: 0 healthy; 1 a model has no live worker, or no worker is
    registered; 2 the broker did not answer within --timeout (or refused STATS).
    """
    with open_client(args) as client:
        stats, why = fetch(client, args.timeout)
    return run_status(stats, why, json_out=args.json)


def run_status(
    stats: dict[str, Any] | None, why: str, *, json_out: bool, console: Console | None = None
) -> int:
    """Print ``stats`` (or ``why`` there are none) and return the exit status."""
    if stats is None:
        print(f"carpool status: {why}", file=sys.stderr)
        if json_out:
            print(json.dumps({"reachable": False, "error": why}))
        return fleet.UNREACHABLE
    found = fleet.problems(stats)
    if json_out:
        stats.pop("id", None)
        print(json.dumps({"reachable": True, "problems": found, **stats}, indent=2))
        return fleet.verdict(stats)
    console = console or Console()
    if console.is_terminal:
        console.print(renderable(stats, found))
    else:
        lines = [fleet.summary(stats), *(f"problem: {p}" for p in found)]
        sys.stdout.write(fleet.plain(lines, fleet.tables(stats)))
    return fleet.verdict(stats)


def renderable(
    stats: dict[str, Any], found: list[str], per_s: dict[str, float] | None = None
) -> RenderableType:
    """The fleet as rich tables (``per_s``: a req/s column, for ``carpool top``)."""
    parts: list[RenderableType] = [Text(fleet.summary(stats), style="bold")]
    parts += [Text(f"problem: {p}", style="bold red") for p in found]
    for block in fleet.tables(stats, per_s):
        table = RichTable(title=block.title, title_justify="left", expand=False)
        for header in block.headers:
            table.add_column(header, no_wrap=True)
        for row in block.rows:
            table.add_row(*row)
        parts.append(table)
    return Group(*parts)


def add_parsers(sub: Any) -> None:
    from carpool.commandline import add_command

    s = add_command(sub, "status", _status, epilog=_EXIT_STATUS)
    add_client_flags(s)
    s.add_argument("--json", action="store_true", help="print the STATS reply as JSON")


_EXIT_STATUS = (
    "exit status: 0 healthy, 1 when a model has no live worker (or no worker is registered), "
    "2 when the broker does not answer within --timeout or refuses STATS"
)
