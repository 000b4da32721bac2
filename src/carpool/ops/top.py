"""top.py: ``carpool top``: the fleet live, redrawn in place every ``--interval``.

A rich ``Live`` display over ``carpool status``'s tables, with each model's answers per
second since the previous refresh. It asks the broker for STATS once per refresh; a
broker that stops answering is shown as such, and the display goes on asking. Ends after
``--count`` refreshes (0: never) or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import threading
from typing import TYPE_CHECKING, Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from carpool.common.clock import Clock, MonotonicClock
from carpool.ops import fleet
from carpool.ops.status import add_client_flags, fetch, open_client, renderable

if TYPE_CHECKING:
    from carpool.client import Client


def run_top(
    client: Client,
    *,
    interval_s: float,
    count: int,
    timeout_s: float,
    console: Console | None = None,
    clock: Clock | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Refresh ``count`` times (0: until ``stop`` is set or Ctrl-C); returns 0."""
    clock = clock or MonotonicClock()
    stop = stop or threading.Event()
    previous: tuple[float, dict[str, Any]] | None = None
    done = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while not stop.is_set():
                started_s = clock.now()
                stats, why = fetch(client, timeout_s)
                view: RenderableType
                if stats is None:
                    view = Text(f"carpool top: {why}", style="bold red")
                else:
                    per_s = {}
                    if previous is not None:
                        per_s = fleet.rates(previous[1], stats, started_s - previous[0])
                    previous = (started_s, stats)
                    view = renderable(stats, fleet.problems(stats), per_s)
                live.update(view, refresh=True)
                done += 1
                if count and done >= count:
                    break
                # The refresh period, less the time the STATS took (the wait is an event's,
                # so a caller's stop ends it at once).
                stop.wait(max(0.0, interval_s - (clock.now() - started_s)))
        except KeyboardInterrupt:
            pass
    return 0


def _top(args: argparse.Namespace) -> int:
    """show the fleet live: models and workers, refreshed in place

    The tables of carpool status, redrawn every --interval seconds, with each model's
    requests answered per second since the last refresh. Ctrl-C quits; --count N quits
    after N refreshes.
    """
    from carpool.common.errors import ConfigError

    if not args.interval > 0 or args.count < 0:
        raise ConfigError("--interval must be more than 0 and --count at least 0")
    with open_client(args) as client:
        return run_top(client, interval_s=args.interval, count=args.count, timeout_s=args.timeout)


def add_parsers(sub: Any) -> None:
    from carpool.commandline import add_command

    t = add_command(sub, "top", _top)
    add_client_flags(t)
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument("--count", type=int, default=0, help="refreshes before quitting (0: until ^C)")
