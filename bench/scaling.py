"""Does the broker's cost per request stay flat with many workers and with a deep queue?

Question: the broker should cost about the same per request whether one worker or 32
are registered, and whether 10 or 10,000 requests wait in its queue.

Method. Every request is a batch of its own (``carpool broker --policy fixed
--max-batch 1 --max-wait-ms 0``), so both configurations of each pair do the same work
per request; the broker is a process and its CPU time (psutil, user + system, all its
threads) is read before and after each measurement.

1. Workers: two fleets run side by side, each a broker with null-engine workers as
   threads of one helper process (``python bench/common.py workers``): 1 worker, and 32
   workers (all registered, all heartbeating). This process drives each in turn with the
   same open-loop constant rate (1,000 requests/s for 3 s; 500/s for 1 s with --quick,
   sent by ``carpool.loadgen.drive`` whatever the replies do), so both brokers see the
   same arrivals. Measured: broker CPU per request sent (all answered).
   The brokers' CPU while idle (heartbeats only) is shown too.
2. Queue depth: a broker with ``max_queued = 20000`` (and ``max_client_requests`` as
   high: one client holds the whole queue) and one worker whose engine takes
   1 ms per batch (a sleep: the worker, not the broker, sets the pace). The client keeps
   Q + 2 requests outstanding (Q queued at the broker, 2 at the worker's two slots; a new
   one is sent for each reply), Q = 10 and Q = 10,000; after filling and a warm-up, it
   counts 3,000 replies (500 with --quick). Measured: broker CPU per request processed
   in that window; in steady state each reply is matched by one admission, so this is
   the cost of admitting, queueing, dispatching and answering one request at that depth.
   The broker's own ``queued`` count is read at the end of the window. Each measurement
   uses a fresh broker and worker (a 10,000-deep queue takes ~15 s to drain).

The configurations alternate; 5 rounds (2 with --quick); the tables show medians and the
ratio is the median of the per-round ratios. psutil counts CPU time in 10 ms ticks: the
--quick numbers are coarse.

Targets: broker CPU per request, 32 workers / 1 worker <= 1.2, and 10,000 queued / 10
queued <= 1.2.

Run:  .venv/bin/python bench/scaling.py            (about 2.5 minutes)
      .venv/bin/python bench/scaling.py --quick    (a smoke run, under a minute)
Writes bench/out/scaling.json and bench/out/scaling.png.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from common import (
    CpuMeter,
    FleetLoop,
    ProcessGroup,
    SyntheticModel,
    median,
    parser,
    pyplot,
    quiet_logs,
    save_plot,
    table,
    tensor,
    verdict,
    wait_workers,
    write_json,
)

from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.loadgen import drive
from carpool.sim.workload import Arrival

TARGET = 1.2
MODEL = "synthetic"
NO_BATCHING = ["--policy", "fixed", "--max-batch", "1", "--max-wait-ms", "0"]
WORKER_COUNTS = (1, 32)
QUEUE_DEPTHS = (10, 10_000)
SLOTS = 2


def cpu_delta(meter: CpuMeter, before: tuple[float, float]) -> tuple[float, float]:
    after = meter.read()
    return after[0] - before[0], after[1] - before[1]


# ---------------------------------------------------------------------- 1: workers


def workers_part(args: Any, reps: int) -> dict[str, Any]:
    rate = 500.0 if args.quick else 1000.0
    duration_s = 1.0 if args.quick else 3.0
    idle_s = 1.0 if args.quick else 3.0
    x = tensor((1, 16))
    n = int(rate * duration_s)
    arrivals = [Arrival(i / rate, MODEL, (1, 16), 5000) for i in range(n)]
    inputs = [{"x": x}] * n
    rounds: dict[int, list[dict[str, float]]] = {w: [] for w in WORKER_COUNTS}
    idle: dict[int, float] = {}
    with ProcessGroup(args.transport) as group:
        fleets: dict[int, tuple[str, CpuMeter]] = {}
        for count in WORKER_COUNTS:
            frontend, backend = group.endpoint(f"front{count}"), group.endpoint(f"back{count}")
            broker = group.broker(frontend, backend, *NO_BATCHING)
            group.worker_host(backend, count, [SyntheticModel(MODEL)], slots=SLOTS)
            fleets[count] = (frontend, CpuMeter(broker.pid))
        for count, (frontend, _) in fleets.items():
            wait_workers(frontend, count, group)
        # Idle cost: heartbeats only (both brokers idle at once).
        before = {c: m.read() for c, (_, m) in fleets.items()}
        time.sleep(idle_s)
        for c, (_, m) in fleets.items():
            idle[c] = sum(cpu_delta(m, before[c])) / idle_s
        clock = MonotonicClock()
        for rnd in range(reps + 1):  # round 0 is the warm-up
            for count, (frontend, meter) in fleets.items():
                with Client(frontend) as client:
                    if rnd == 0:
                        y = client.infer(MODEL, {"x": x})["y"]
                        assert np.allclose(y, 2 * x + 1), "the fleet gave a wrong answer"
                    before_cpu = meter.read()
                    t0 = time.perf_counter()
                    samples = drive(client, arrivals, inputs, clock=clock)
                    wall = time.perf_counter() - t0
                    user, system = cpu_delta(meter, before_cpu)
                ok = sum(1 for s in samples if s.outcome == "ok")
                if ok < len(samples):
                    print(f"  warning: {len(samples) - ok} of {len(samples)} requests failed")
                if rnd:
                    rounds[count].append(
                        {
                            "sent": len(samples),
                            "ok": ok,
                            "wall_s": wall,
                            "user_us": 1e6 * user / len(samples),
                            "system_us": 1e6 * system / len(samples),
                            "cpu_us": 1e6 * (user + system) / len(samples),
                        }
                    )
            if rnd:
                print(f"workers: round {rnd}/{reps} done")
    per_round = [
        big["cpu_us"] / one["cpu_us"] if one["cpu_us"] > 0 else float("nan")
        for big, one in zip(rounds[32], rounds[1], strict=True)
    ]
    return {
        "rate_rps": rate,
        "duration_s": duration_s,
        "idle_cpu_share": idle,
        "rounds": rounds,
        "median": {
            c: {m: median([r[m] for r in rounds[c]]) for m in ("user_us", "system_us", "cpu_us")}
            for c in WORKER_COUNTS
        },
        "per_round_ratio": per_round,
        "ratio": median(per_round),
    }


# ---------------------------------------------------------------------- 2: queue depth


def queue_run(args: Any, depth: int, warm: int, measure: int) -> dict[str, float]:
    """One measurement at one depth, on a fresh broker and worker."""
    x = tensor((1, 16))
    with ProcessGroup(args.transport) as group:
        frontend, backend = group.endpoint("front"), group.endpoint("back")
        # One client holds the whole queue here, so its own limit is raised with the queue's.
        limits = {"max_queued": 20_000, "max_client_requests": 20_000}
        broker = group.broker(frontend, backend, *NO_BATCHING, config=limits)
        group.worker_host(backend, 1, [SyntheticModel(MODEL, fixed_ms=1.0)], slots=SLOTS)
        wait_workers(frontend, 1, group)
        meter = CpuMeter(broker.pid)
        with Client(frontend) as client:
            loop = FleetLoop(client, MODEL, {"x": x}, depth + SLOTS, timeout_s=120.0)
            loop.fill(60.0)
            warmed = loop.run(warm, 60.0)
            before = meter.read()
            result = loop.run(measure, 120.0)
            user, system = cpu_delta(meter, before)
            queued = client.stats()["queued"]
    if warmed.errors or result.errors:
        print(f"  warning: {warmed.errors + result.errors} requests failed")
    n = max(1, result.completed)
    return {
        "completed": result.completed,
        "errors": result.errors,
        "rate": result.rate,
        "queued_at_end": queued,
        "user_us": 1e6 * user / n,
        "system_us": 1e6 * system / n,
        "cpu_us": 1e6 * (user + system) / n,
    }


def queue_part(args: Any, reps: int) -> dict[str, Any]:
    warm = 200 if args.quick else 500
    measure = 500 if args.quick else 3000
    rounds: dict[int, list[dict[str, float]]] = {d: [] for d in QUEUE_DEPTHS}
    for rnd in range(1, reps + 1):
        # Alternate which depth goes first, so a drift in machine load favours neither.
        order = QUEUE_DEPTHS if rnd % 2 else tuple(reversed(QUEUE_DEPTHS))
        for depth in order:
            rounds[depth].append(queue_run(args, depth, warm, measure))
        print(f"queue depth: round {rnd}/{reps} done")
    deep, shallow = QUEUE_DEPTHS[1], QUEUE_DEPTHS[0]
    per_round = [
        d["cpu_us"] / s["cpu_us"] if s["cpu_us"] > 0 else float("nan")
        for d, s in zip(rounds[deep], rounds[shallow], strict=True)
    ]
    return {
        "worker_cost_ms": 1.0,
        "measured_replies": measure,
        "rounds": rounds,
        "median": {
            d: {
                m: median([r[m] for r in rounds[d]])
                for m in ("rate", "queued_at_end", "user_us", "system_us", "cpu_us")
            }
            for d in QUEUE_DEPTHS
        },
        "per_round_ratio": per_round,
        "ratio": median(per_round),
    }


# ---------------------------------------------------------------------- report


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--part", choices=("workers", "queue", "both"), default="both")
    args = p.parse_args(argv)
    quiet_logs()
    reps = args.reps or (2 if args.quick else 5)
    report: dict[str, Any] = {
        "question": "broker CPU per request: 1 vs 32 workers, 10 vs 10,000 queued",
        "transport": args.transport,
        "quick": args.quick,
        "rounds": reps,
        "target": f"each ratio <= {TARGET}",
    }
    passes = []
    if args.part in ("workers", "both"):
        w = report["workers"] = workers_part(args, reps)
        rows = [
            [
                f"{c} worker{'s' if c > 1 else ''}",
                w["median"][c]["user_us"],
                w["median"][c]["system_us"],
                w["median"][c]["cpu_us"],
                f"{w['median'][c]['cpu_us'] / w['median'][1]['cpu_us']:.2f}",
                f"{100 * w['idle_cpu_share'][c]:.1f}%",
            ]
            for c in WORKER_COUNTS
        ]
        print(
            f"\nBroker CPU per request, open loop {w['rate_rps']:.0f} req/s for "
            f"{w['duration_s']:g} s, {args.transport}; median of {reps} rounds"
        )
        print(table(["fleet", "user us", "sys us", "CPU us/req", "x 1 worker", "idle CPU"], rows))
        ok = w["ratio"] <= TARGET
        passes.append(ok)
        print(f"target 32 workers / 1 worker <= {TARGET}: {w['ratio']:.2f} {verdict(ok)}")
    if args.part in ("queue", "both"):
        q = report["queue"] = queue_part(args, reps)
        rows = [
            [
                f"{d:,} queued",
                q["median"][d]["queued_at_end"],
                q["median"][d]["rate"],
                q["median"][d]["user_us"],
                q["median"][d]["system_us"],
                q["median"][d]["cpu_us"],
                f"{q['median'][d]['cpu_us'] / q['median'][10]['cpu_us']:.2f}",
            ]
            for d in QUEUE_DEPTHS
        ]
        print(
            f"\nBroker CPU per request processed, 1 worker at 1 ms per batch, "
            f"{q['measured_replies']} replies counted, {args.transport}; median of {reps} rounds"
        )
        print(
            table(
                ["queue", "queued (stats)", "req/s", "user us", "sys us", "CPU us/req", "x 10"],
                rows,
            )
        )
        ok = q["ratio"] <= TARGET
        passes.append(ok)
        print(f"target 10,000 queued / 10 queued <= {TARGET}: {q['ratio']:.2f} {verdict(ok)}")
    report["pass"] = all(passes)
    write_json("scaling", report)
    plot(report)
    return 0


def plot(report: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    parts = [(k, report[k]) for k in ("workers", "queue") if k in report]
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4), squeeze=False)
    for ax, (name, part) in zip(axes[0], parts, strict=True):
        keys = WORKER_COUNTS if name == "workers" else QUEUE_DEPTHS
        labels = [
            f"{k} worker{'s' if k > 1 else ''}" if name == "workers" else f"{k:,} queued"
            for k in keys
        ]
        medians = [part["median"][k]["cpu_us"] for k in keys]
        ax.bar(labels, medians, color=["tab:blue", "tab:orange"])
        for i, k in enumerate(keys):
            ys = [r["cpu_us"] for r in part["rounds"][k]]
            ax.plot([i] * len(ys), ys, "k.", alpha=0.6)
        ax.axhline(TARGET * medians[0], color="k", linestyle=":", label=f"target {TARGET} x")
        ax.set_ylabel("broker CPU us per request")
        ax.set_title(f"{name}: ratio {part['ratio']:.2f} (bars: median, dots: rounds)")
        ax.legend(fontsize=8)
    save_plot(fig, "scaling")


if __name__ == "__main__":
    sys.exit(main())
