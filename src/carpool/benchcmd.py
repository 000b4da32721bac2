"""benchcmd.py: ``carpool bench`` and ``carpool replay`` (the command line of loadgen.py).

Arrivals follow a schedule (Poisson, constant, bursts, or a recorded trace) and are sent at
their times whatever the replies do, so slow replies cannot hide latency (no coordinated
omission). A warm-up window is sent but not counted; the measurement window is checked for
stability (goodput per second should not drift between its halves). The report has
throughput, goodput within deadline, p50/p90/p95/p99/p99.9, errors by type, the batch-size
distribution read from the broker, and how late the generator itself sent (if that grows,
the generator, not the fleet, is the bottleneck).
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

import zmq

from carpool.broker.config import BatchingConfig
from carpool.commandline import add_batching_flags, add_burst_flags, add_command
from carpool.common.errors import ConfigError
from carpool.common.protocol import DTYPES
from carpool.sim import workload
from carpool.sim.commands import add_engine_flags, finite, write_json
from carpool.sim.workload import Arrival

if TYPE_CHECKING:  # (the load generator and the client load when a run starts)
    from carpool.loadgen import BenchReport

# ---------------------------------------------------------------------- command line


def add_parsers(sub: Any) -> None:
    b = add_command(sub, "bench", run_bench, epilog=_EXIT_STATUS)
    b.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="broker frontend")
    b.add_argument("--model", default="synthetic", help="model to call")
    b.add_argument("--shape", default="1,16", help="request shape, dim 0 = samples")
    b.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="input dtype")
    b.add_argument("--input-name", default="x", help="input tensor name")
    b.add_argument(
        "--load", choices=("poisson", "constant", "bursts"), default="poisson", help="schedule"
    )
    b.add_argument("--rate", type=float, default=200.0, help="requests per second")
    add_burst_flags(b, burst_rps=1000.0, period="bursts: one per period")
    b.add_argument("--duration-s", type=float, default=10.0, help="measurement window")
    b.add_argument("--warmup-s", type=float, default=2.0, help="sent, not counted")
    b.add_argument("--timeout-ms", type=int, default=1000, help="each request's deadline")
    b.add_argument("--trace", help="replay a JSON-lines trace instead of a schedule")
    b.add_argument("--seed", type=int, default=0, help="random seed")
    b.add_argument("--json", help="write the report as JSON")
    b.add_argument("--csv", help="write per-second figures as CSV")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_stats_timeout(b)
    b.add_argument(
        "--shared-memory-mib",
        type=int,
        default=0,
        help="send inputs (and take outputs) of 64 KiB+ through /dev/shm: a fleet on this host",
    )

    r = add_command(sub, "replay", run_replay, epilog=_EXIT_STATUS)
    r.add_argument("--trace", required=True, help="JSON-lines trace")
    r.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="broker frontend")
    r.add_argument("--input-name", default="x", help="input tensor name")
    r.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="input dtype")
    r.add_argument("--simulate", action="store_true", help="replay in the simulator instead")
    _add_stats_timeout(r)
    add_engine_flags(r, fleet=False)
    _add_worker_cpu_flags(r)
    g = r.add_argument_group(
        "simulated broker", "as carpool broker's flags; set them as the recording broker had"
    )
    add_batching_flags(g, BatchingConfig())
    r.add_argument("--json", help="write the report as JSON")


def _add_worker_cpu_flags(parser: argparse.ArgumentParser) -> None:
    """replay --simulate: the engines' spread, and the simulated workers' own CPU per batch
    outside the engine (RESULT cpu_ms) and their host's CPU in use (telemetry), as a live
    fleet's STATS reports them (lanes' spread, cpu_fixed_ms and cpu_per_sample_ms;
    telemetry host_cpu_pct)."""
    g = parser.add_argument_group("simulated workers' CPU")
    g.add_argument(
        "--jitter", type=float, default=0.05, help="relative std of the engine's batch times"
    )
    g.add_argument(
        "--cpu-alpha-ms", type=float, default=0.0, help="the worker's own CPU per batch, fixed"
    )
    g.add_argument("--cpu-beta-ms", type=float, default=0.0, help="the worker's own CPU per sample")
    g.add_argument(
        "--host-busy-pct",
        type=float,
        help="the host's CPU in use its telemetry reports, 0..100 (default: none reported)",
    )
    g.add_argument(
        "--transfer-ms",
        type=float,
        default=0.0,
        help="per batch, how much later than its end its RESULT reaches the broker",
    )
    g.add_argument(
        "--transfer-ms-from",
        metavar="FILE",
        help="instead, per batch a delay drawn at random from FILE's (ms, one a line)",
    )


def _add_stats_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stats-timeout-s",
        type=float,
        help="how long each STATS waits for the broker's answer (default: 3 s for each of "
        "the three asked before the run, 5 s for the one after it; --simulate asks none)",
    )


_EXIT_STATUS = (
    "exit status: 0 when at least one request was answered, 1 when none was (every request "
    "failed, or no broker answered at --endpoint), 2 for a usage or configuration error"
)


def _at_least(value: float, low: float, *, above: bool = False) -> bool:
    """Whether ``value`` is finite and at least (``above``: more than) ``low``; NaN is not."""
    return math.isfinite(value) and (value > low if above else value >= low)


def _check_endpoint(endpoint: str) -> None:
    """A malformed endpoint is a usage error, not a ZMQError traceback from the client."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot connect to {endpoint!r}: {exc}") from None


def _check_bench(args: argparse.Namespace) -> tuple[int, ...]:
    """Refuse what would crash (0 or negative --timeout-ms, --rate 0 with constant load) or
    run and end as "no request was sent", exit 1, which reads as a dead fleet; all
    problems at once, before anything is sent. Returns the shape of --shape."""
    problems = []
    if not args.trace:
        if args.load == "bursts":
            if not (_at_least(args.rate, 0) and _at_least(args.burst_rps, 0)):
                problems.append("--rate and --burst-rps must be at least 0")
        elif not _at_least(args.rate, 0, above=True):
            problems.append(f"--rate must be more than 0, got {args.rate:g}")
        if not _at_least(args.duration_s, 0, above=True):
            problems.append(f"--duration-s must be more than 0, got {args.duration_s:g}")
        if not _at_least(args.warmup_s, 0):
            problems.append(f"--warmup-s must be at least 0, got {args.warmup_s:g}")
    if not 1 <= args.timeout_ms <= 3_600_000:
        problems.append(f"--timeout-ms must be in 1..3600000, got {args.timeout_ms}")
    if not args.model:
        problems.append("--model must be a non-empty name")
    problems += _stats_timeout_problems(args)
    if args.shared_memory_mib < 0:
        problems.append(f"--shared-memory-mib must be at least 0, got {args.shared_memory_mib}")
    shape: tuple[int, ...] = ()
    try:
        shape = tuple(int(d) for d in args.shape.split(","))
    except ValueError:
        problems.append(f"--shape must be comma-separated ints, got {args.shape!r}")
    else:
        if not 1 <= len(shape) <= 8 or any(d < 1 for d in shape):
            problems.append(f"--shape must have 1..8 dims, each at least 1, got {args.shape!r}")
    if problems:
        raise ConfigError("; ".join(problems))
    _check_endpoint(args.endpoint)
    return shape


def _stats_timeout_problems(args: argparse.Namespace) -> list[str]:
    timeout_s = args.stats_timeout_s
    if timeout_s is None or _at_least(timeout_s, 0, above=True):
        return []
    return [f"--stats-timeout-s must be more than 0, got {timeout_s:g}"]


def _arrivals(args: argparse.Namespace) -> list[Arrival]:
    shape = _check_bench(args)
    if args.trace:
        return workload.load_trace(args.trace)
    total_s = args.warmup_s + args.duration_s
    if args.load == "constant":
        step = 1.0 / args.rate
        n = int(total_s * args.rate)
        items = [Arrival(i * step, args.model, shape, args.timeout_ms) for i in range(n)]
    else:
        if args.load == "bursts":
            phases = workload.bursts(
                args.rate, args.burst_rps, total_s, args.period_s, args.burst_s
            )
        else:
            phases = workload.poisson(args.rate, total_s)
        items = workload.arrivals(
            phases, model=args.model, shape=shape, timeout_ms=args.timeout_ms, seed=args.seed
        )
    if not any(a.t_s >= args.warmup_s for a in items):
        raise ConfigError(
            "the schedule has no arrival in the measurement window (after the warm-up): "
            "raise --rate or --duration-s"
        )
    return items


def print_report(report: BenchReport) -> None:
    lat = report.latency_ms
    errors = _errors(report.errors)
    print(f"window:      {report.window_s:.1f} s, {report.sent} requests")
    print(
        f"throughput:  {report.throughput_rps:.1f}/s   goodput (within deadline): "
        f"{report.goodput_rps:.1f}/s"
    )
    print(
        "latency ms:  "
        + "  ".join(f"{k} {v:.2f}" for k, v in lat.items())
        + "  (answered requests, from the time each was due)"
    )
    print(f"errors:      {errors}")
    for model, sizes in sorted(report.batch_sizes.items()):
        n = sum(sizes.values())
        mean = sum(k * v for k, v in sizes.items()) / n if n else 0.0
        top = ", ".join(f"{k}:{v}" for k, v in sorted(sizes.items()))
        print(f"batches ({model}, whole run): {n}, mean size {mean:.2f} [{top}]")
    for model, labels in sorted(report.buckets.items()):
        for label, b in labels.items():
            print(
                f"bucket ({model} {label}): {b['batches']:.0f} batches, {b['samples']:.0f} "
                f"samples, padded share of compute {100 * b['padded_share']:.1f}%"
            )
    verdict = "stable" if report.stable else "NOT stable (goodput drifted between halves)"
    print(
        f"window halves goodput: {report.halves_goodput_rps[0]:.1f}/s, "
        f"{report.halves_goodput_rps[1]:.1f}/s: {verdict}"
    )
    print(
        f"generator: sent {report.sent_rps:.1f}/s of {report.scheduled_rps:.1f}/s scheduled, "
        f"send lag p99 {report.p99_send_lag_ms:.2f} ms, max {report.max_send_lag_ms:.2f} ms"
    )
    if not report.kept_up:
        print(
            "WARNING: the generator fell behind its schedule; these figures describe the "
            "generator as much as the fleet (run it on another core or host, or lower --rate)"
        )


def _end_on_sigterm() -> None:
    """SIGTERM (a timeout, a CI cancel, systemd) ends a run as Ctrl-C does: the client
    closes and removes its shared-memory region instead of leaving it in /dev/shm."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _write(report: BenchReport, args: argparse.Namespace) -> None:
    if getattr(args, "json", None):
        write_json(args.json, report.to_json())  # null, not NaN, for a figure of no answers
    if getattr(args, "csv", None):
        with open(args.csv, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["second", "sent", "goodput", "p99_ms"])
            writer.writeheader()
            for row in report.per_second:  # an empty field, not "nan", for no answers
                writer.writerow({k: "" if v is None else v for k, v in finite(row).items()})


def _fail(message: str) -> int:
    print(f"carpool: {message}", file=sys.stderr)
    return 1


def _live(args: argparse.Namespace, items: list[Arrival], **kwargs: Any) -> int:
    """Run ``items`` against the broker at ``args.endpoint``, print and write the report."""
    from carpool.loadgen import run, synthetic_inputs

    try:
        report = run(
            args.endpoint,
            items,
            synthetic_inputs(items, args.input_name, args.dtype),
            stats_timeout_s=args.stats_timeout_s,
            **kwargs,
        )
    except TimeoutError:  # no STATS before the run was answered (loadgen.first_stats)
        return _fail(
            f"no broker answered at {args.endpoint} (is one running, and is --endpoint its "
            "frontend?)"
        )
    print_report(report)
    _write(report, args)
    if report.ok == 0:
        what = "no request was sent" if report.sent == 0 else "no request was answered"
        return _fail(f"{what} (errors: {_errors(report.errors)})")
    return 0


def _errors(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def run_bench(args: argparse.Namespace) -> int:
    """load a live fleet open loop and report latency, goodput and batch sizes

    Load a live fleet open loop: requests follow a schedule (--load) or a recorded trace
    (--trace) and are sent at their times whatever the replies do, so slow replies cannot
    hide latency. The warm-up is sent but not counted. The report gives throughput,
    goodput (answers within the deadline per second), latency percentiles, errors by
    type, the batch sizes the broker formed, whether goodput held steady across the
    window, and how late the generator itself sent.
    """
    _end_on_sigterm()
    items = _arrivals(args)
    return _live(
        args,
        items,
        warmup_s=args.warmup_s if not args.trace else 0.0,
        progress=not args.no_progress,
        end_s=None if args.trace else args.warmup_s + args.duration_s,
        shared_memory=args.shared_memory_mib << 20,
    )


def _check_replay(args: argparse.Namespace) -> tuple[BatchingConfig, tuple[float, ...]]:
    """The simulator's flags, checked (as carpool tune checks them) before anything runs;
    returns the simulated broker's batching and the transfers to draw from."""
    problems = []
    if args.workers < 1:
        problems.append("--workers must be at least 1")
    if args.engine_max_batch is not None and args.engine_max_batch < 1:
        problems.append("--engine-max-batch must be at least 1")
    if not (_at_least(args.alpha_ms, 0) and _at_least(args.beta_ms, 0)):
        problems.append("--alpha-ms and --beta-ms must be at least 0 (and finite)")
    figures = (args.jitter, args.cpu_alpha_ms, args.cpu_beta_ms, args.transfer_ms)
    if not all(_at_least(x, 0) for x in figures):
        problems.append(
            "--jitter, --cpu-alpha-ms, --cpu-beta-ms and --transfer-ms must be at least 0"
        )
    draws: tuple[float, ...] = ()
    if args.transfer_ms_from is not None:
        try:
            draws = _draws_s(args.transfer_ms_from)
        except (OSError, ValueError) as exc:
            problems.append(f"--transfer-ms-from {args.transfer_ms_from}: {exc}")
    busy = args.host_busy_pct
    if busy is not None and not (_at_least(busy, 0) and busy <= 100):
        problems.append(f"--host-busy-pct must be in 0..100, got {busy:g}")
    problems += _stats_timeout_problems(args)
    if problems:
        raise ConfigError("; ".join(problems))
    batching = BatchingConfig(
        max_batch=args.max_batch, max_wait_s=args.max_wait_ms / 1000, policy=args.policy
    )
    return batching, draws


def _draws_s(path: str) -> tuple[float, ...]:
    """The delays in ``path`` (ms, one a line; blank lines skipped), in seconds."""
    with open(path, encoding="utf-8") as f:
        values = [float(line) for line in f if line.strip()]
    if not values:
        raise ValueError("no values")
    if not all(_at_least(v, 0) for v in values):
        raise ValueError("every value must be at least 0 (and finite)")
    return tuple(v / 1000 for v in values)


def run_replay(args: argparse.Namespace) -> int:
    """replay a recorded trace on a live fleet, or in the simulator

    Send a recorded trace (carpool record) to a live broker at its recorded times, or
    (--simulate) feed it to a simulated broker, with the batching flags of carpool broker,
    and workers of cost --alpha-ms + --beta-ms x B (spread --jitter), whose own CPU per
    batch is --cpu-alpha-ms + --cpu-beta-ms x B on a host --host-busy-pct busy, and whose
    RESULT reaches the broker --transfer-ms after the batch ends (or, with
    --transfer-ms-from, after a delay drawn for each batch from a recorded fleet's).
    """
    _end_on_sigterm()
    batching, draws = _check_replay(args)  # a typo in a flag for the simulator fails live runs too
    if not args.simulate:
        _check_endpoint(args.endpoint)
        return _live(args, workload.load_trace(args.trace), warmup_s=0.0, progress=True)
    items = workload.load_trace(args.trace, workload.MIN_SIMULATED_ARRIVALS)
    logging.getLogger("carpool.broker").setLevel(logging.WARNING)
    from carpool.sim.commands import DEFAULT_ENGINE_MAX
    from carpool.sim.compare import as_records, table
    from carpool.sim.simulator import EngineCost, SimWorker, simulate

    # The recording fleet's engine limit where the trace has it (else the simulator's).
    limit = args.engine_max_batch or workload.engine_limit(items) or DEFAULT_ENGINE_MAX
    cost = EngineCost(args.alpha_ms / 1000, args.beta_ms / 1000, args.jitter)
    overhead = None
    if args.cpu_alpha_ms or args.cpu_beta_ms:
        overhead = EngineCost(args.cpu_alpha_ms / 1000, args.cpu_beta_ms / 1000)
    workers = [
        SimWorker(
            f"sim-{i}",
            cost,
            limit,
            overhead=overhead,
            host_busy_pct=args.host_busy_pct,
            transfer_s=args.transfer_ms / 1000,
            transfer_draws_s=draws,
        )
        for i in range(args.workers)
    ]
    result = simulate(items, workers, batching, label=f"{args.policy} (sim)")
    print(table([result]))
    if args.json:
        write_json(args.json, as_records([result]))
    return 0 if result.ok else _fail(f"no request was answered (errors: {_errors(result.errors)})")
