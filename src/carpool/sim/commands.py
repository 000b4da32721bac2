"""commands.py: ``carpool simulate`` and ``carpool tune`` (argument parsing and printing).

``simulate`` compares batching policies on a workload; ``tune`` replays a recorded trace
on a grid of fixed (B_max, T_max) and recommends the best — the seeds' offline traffic
replay. Both run the real BrokerCore on a simulated clock (see simulator.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.commandline import add_burst_flags, add_command
from carpool.common.errors import ConfigError
from carpool.common.progress import CountProgress
from carpool.common.protocol import MAX_TIMEOUT_MS
from carpool.sim import workload
from carpool.sim.workload import Arrival

if TYPE_CHECKING:  # (the simulator and its comparisons load when a command runs)
    from carpool.sim.simulator import SimWorker

#: The engine's batch limit assumed when neither the flag nor the trace gives one.
DEFAULT_ENGINE_MAX = 64
#: Each request's timeout in a generated workload, unless --sla-ms says otherwise.
DEFAULT_SLA_MS = 50


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def add_engine_flags(group: Any, *, fleet: bool = True) -> None:
    """The simulated engines' flags on ``group``: their cost ``--alpha-ms`` + ``--beta-ms``
    x B, ``--workers`` and ``--engine-max-batch``; with ``fleet`` also ``--jitter``,
    ``--slots`` and ``--seed`` (simulate and tune; replay takes their defaults)."""
    group.add_argument("--alpha-ms", type=float, default=5.0, help="fixed cost per batch (α)")
    group.add_argument("--beta-ms", type=float, default=0.5, help="cost per sample (β)")
    if fleet:
        group.add_argument("--jitter", type=float, default=0.05, help="relative std of batch times")
    group.add_argument("--workers", type=int, default=1, help="simulated workers")
    if fleet:
        group.add_argument("--slots", type=int, default=2, help="batches outstanding per worker")
    group.add_argument(
        "--engine-max-batch",
        type=int,
        help=f"engine batch limit (default: what the trace recorded, else {DEFAULT_ENGINE_MAX})",
    )
    if fleet:
        group.add_argument("--seed", type=int, default=0, help="random seed")


def add_parsers(sub: Any) -> None:
    """Register ``simulate`` and ``tune`` on the ``carpool`` sub-parser object."""
    s = add_command(sub, "simulate", run_simulate)
    w = s.add_argument_group(
        "workload",
        "a pattern (--load and its rates and lengths) or a recorded --trace; with --trace "
        "the pattern's options are ignored, and --sla-ms replaces the recorded timeouts",
    )
    w.add_argument(
        "--load",
        choices=("poisson", "steps", "bursts", "diurnal"),
        default="poisson",
        help="arrival pattern (ignored with --trace)",
    )
    w.add_argument("--rate", type=float, default=1000.0, help="poisson: requests per second")
    w.add_argument("--rates", type=_floats, default=[200, 1400, 300, 1200], help="steps: R1,R2,..")
    w.add_argument("--step-s", type=float, default=3.0, help="steps: seconds per step")
    w.add_argument("--base-rps", type=float, default=300.0, help="bursts: base rate")
    add_burst_flags(w, burst_rps=2500.0, period="bursts: one burst per period")
    w.add_argument("--low-rps", type=float, default=100.0, help="diurnal: night rate")
    w.add_argument("--high-rps", type=float, default=1400.0, help="diurnal: peak rate")
    w.add_argument("--duration-s", type=float, default=10.0, help="workload length")
    w.add_argument("--sla-ms", type=int, help=f"each request's timeout (default {DEFAULT_SLA_MS})")
    w.add_argument("--bulk-share", type=float, default=0.0, help="share at bulk priority")
    w.add_argument("--trace", help="a recorded JSON-lines trace instead of a pattern")
    w.add_argument("--save-trace", help="write the generated arrivals as a trace")
    b = s.add_argument_group("policies")
    b.add_argument("--max-batch", type=int, default=8, help="B_max of the fixed baseline")
    b.add_argument("--max-wait-ms", type=float, default=5.0, help="T_max of the baselines")
    b.add_argument("--carpool-wait-ms", type=float, default=5.0, help="T_max cap of carpool")
    b.add_argument("--no-oracle", action="store_true", help="skip the grid search")
    s.add_argument("--json", help="also write the results as JSON here")
    add_engine_flags(s.add_argument_group("engine and fleet"))

    t = add_command(sub, "tune", run_tune)
    t.add_argument("--trace", required=True, help="JSON-lines trace")
    t.add_argument("--sla-ms", type=int, help="override every request's timeout")
    t.add_argument("--top", type=int, default=5, help="rows of the ranking to print")
    add_engine_flags(t.add_argument_group("engine and fleet"))


def _workers(args: argparse.Namespace, items: Sequence[Arrival]) -> tuple[list[SimWorker], str]:
    """The simulated fleet, and a note of its engines' batch limit: --engine-max-batch,
    else what the trace recorded (the recording fleet's), else DEFAULT_ENGINE_MAX."""
    from carpool.sim.simulator import EngineCost, SimWorker

    problems = []
    limit = args.engine_max_batch
    if args.workers < 1 or args.slots < 1 or (limit is not None and limit < 1):
        problems.append("--workers, --slots and --engine-max-batch must be at least 1")
    if not all(0 <= x < math.inf for x in (args.alpha_ms, args.beta_ms, args.jitter)):
        problems.append("--alpha-ms, --beta-ms and --jitter must be at least 0 (and finite)")
    if problems:
        raise ConfigError("; ".join(problems))
    note = f"max batch {limit}"
    if limit is None:
        recorded = workload.engine_limit(items)
        limit = recorded or DEFAULT_ENGINE_MAX
        source = "as the trace recorded" if recorded else "assumed; --engine-max-batch"
        note = f"max batch {limit} ({source})"
    cost = EngineCost(args.alpha_ms / 1000, args.beta_ms / 1000, args.jitter)
    workers = [SimWorker(f"sim-{i}", cost, limit, args.slots) for i in range(args.workers)]
    return workers, note


def _check_sla(sla_ms: int | None) -> None:
    if sla_ms is not None and not 1 <= sla_ms <= MAX_TIMEOUT_MS:
        # (over the protocol's limit every simulated request would be refused)
        raise ConfigError(f"--sla-ms must be at least 1 and at most {MAX_TIMEOUT_MS}, got {sla_ms}")


def _with_sla(items: list[Arrival], sla_ms: int | None) -> list[Arrival]:
    return items if sla_ms is None else [a.with_timeout(sla_ms) for a in items]


def _arrivals(args: argparse.Namespace) -> list[Arrival]:
    _check_sla(args.sla_ms)
    if args.trace:
        items = workload.load_trace(args.trace, workload.MIN_SIMULATED_ARRIVALS)
        return _with_sla(items, args.sla_ms)
    used = {
        "poisson": (args.rate, args.duration_s),
        "steps": (*args.rates, args.step_s),
        "bursts": (args.base_rps, args.burst_rps, args.duration_s, args.period_s, args.burst_s),
        "diurnal": (args.low_rps, args.high_rps, args.duration_s),
    }[args.load]
    if not all(math.isfinite(x) for x in used):
        # (an infinite rate or duration never ended, its memory growing)
        raise ConfigError(f"the {args.load} workload's rates and lengths must be finite")
    if args.load == "poisson":
        phases = workload.poisson(args.rate, args.duration_s)
    elif args.load == "steps":
        phases = workload.steps(args.rates, args.step_s)
    elif args.load == "bursts":
        phases = workload.bursts(
            args.base_rps, args.burst_rps, args.duration_s, args.period_s, args.burst_s
        )
    else:
        phases = workload.diurnal(args.low_rps, args.high_rps, args.duration_s)
    sla_ms = DEFAULT_SLA_MS if args.sla_ms is None else args.sla_ms
    return workload.arrivals(phases, timeout_ms=sla_ms, bulk_share=args.bulk_share, seed=args.seed)


def _quiet() -> None:
    # Thousands of simulated brokers would otherwise log every worker joining.
    logging.getLogger("carpool.broker").setLevel(logging.WARNING)


def run_simulate(args: argparse.Namespace) -> int:
    """compare batching policies on a simulated workload

    Drive the broker's real batching code with a simulated clock, workers of cost α+βB and
    open-loop arrivals; print throughput, goodput (answers within the deadline per
    second), latency percentiles, misses, batch size and busy time.
    """
    from carpool.sim.compare import as_records, compare, table
    from carpool.sim.simulator import span_s

    _quiet()
    items = _arrivals(args)
    workers, limit = _workers(args, items)
    if len(items) < workload.MIN_SIMULATED_ARRIVALS:  # (as a trace must have)
        raise ConfigError(
            f"the workload has {len(items)} arrival{'' if len(items) == 1 else 's'}; a "
            f"simulation needs at least {workload.MIN_SIMULATED_ARRIVALS} (a rate or a "
            "duration of 0?)"
        )
    if args.save_trace:
        workload.write_trace(args.save_trace, items)
    span = span_s(items)  # as the table's rates count it: n arrivals, n gaps
    print(
        f"workload: {len(items)} requests over {span:.1f} s "
        f"({len(items) / span if span else 0:.0f}/s mean); engine {args.alpha_ms:g} ms + "
        f"{args.beta_ms:g} ms x B, {limit}, {args.workers} worker(s)"
    )
    results = compare(
        items,
        workers,
        fixed_batch=args.max_batch,
        fixed_wait_s=args.max_wait_ms / 1000,
        carpool_wait_s=args.carpool_wait_ms / 1000,
        oracle=not args.no_oracle,
        seed=args.seed,
        progress=None if args.no_oracle else CountProgress("grid search"),
    )
    print(table(results))
    if args.json:
        write_json(args.json, as_records(results))
    return 0


def run_tune(args: argparse.Namespace) -> int:
    """recommend B_max and T_max for a recorded trace

    Replay a recorded trace (carpool record, or any JSON-lines file with t_s, model,
    shape, timeout_ms) on a grid of fixed (B_max, T_max) with a measured batch cost, and
    recommend the setting with the best goodput at the SLA.
    """
    from carpool.sim.compare import grid_search, table

    _quiet()
    if args.top < 1:  # (0 printed an empty ranking; -2 all but its last two rows)
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    _check_sla(args.sla_ms)
    items = workload.load_trace(args.trace, workload.MIN_SIMULATED_ARRIVALS)
    items = _with_sla(items, args.sla_ms)
    workers, limit = _workers(args, items)
    print(f"engine: {args.alpha_ms:g} ms + {args.beta_ms:g} ms x B, {limit}")
    points = grid_search(items, workers, seed=args.seed, progress=CountProgress("grid search"))
    best = points[0]
    print(table([p.result for p in points[: args.top]]))
    if best.result.on_time == 0:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(best.result.errors.items()))
        print(
            "\nno setting answered any request in time: nothing to recommend ("
            + (
                f"the best setting's errors: {errors}"
                if errors
                else "is the SLA shorter than one batch of the engine?"
            )
            + ")"
        )
        return 1
    print(
        f"\nrecommended: max_batch = {best.max_batch}, max_wait_s = {best.max_wait_s:g}  "
        f"(goodput {best.result.goodput_rps:.1f}/s, p99 {best.result.percentile_ms(99):.1f} ms, "
        f"misses {100 * best.result.miss_rate:.2f}%)"
    )
    print(
        "put these in the [batching] (or [models.<name>]) table of broker.toml; with "
        'policy = "carpool" they are the caps the adaptive policy works within.'
    )
    return 0


def finite(data: Any) -> Any:
    """``data`` with every non-finite float (the percentile of no answers) as None: NaN is
    not JSON, and strict parsers refuse a file that holds it."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite(v) for v in data]
    return data


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as strict JSON: null where a figure is not a number."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(finite(data), f, indent=2, allow_nan=False)


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via carpool.cli
    parser = argparse.ArgumentParser(prog="carpool")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))
