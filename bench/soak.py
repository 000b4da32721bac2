"""Does a fleet under steady load keep its memory flat for as long as it runs?

Question: a broker and a worker that have served for minutes should hold what they held
after their first minute; memory that grows with the requests served runs a long-lived
fleet out of memory in the end.

Method: a broker process (``carpool broker --max-batch B``) and a worker process
(``carpool worker --synthetic FIXED_MS PER_SAMPLE_MS``), whose engine takes a known
α + β·B per batch (a sleep), so the fleet's capacity is B / (α + β·B) requests per
second (1,000/s with the defaults: α = 4 ms, β = 0.5 ms, B = 8). This process sends
Poisson arrivals at ``--load`` of that capacity (80%) with ``carpool.loadgen``, open
loop (a request goes out at its time whatever the replies do), for ``--duration-s``
(600 s), 1-sample float32 requests of 16 values with a 1 s deadline. A thread reads
the broker's and the worker's resident set size (psutil) every ``--sample-s`` (5 s).

Reported: RSS of each process after the warm-up (``--warmup-s``: 60 s, or a quarter of a
shorter run) and at the end of the schedule, and the growth between the two in percent;
requests sent, answered (a reply or an error; the SDK fails a request only after its
deadline and grace), answered with outputs, errors by code; p50 and p99 latency of those
after the warm-up (from each request's scheduled time); and whether the generator kept
to its schedule. One answer is checked against the engine's known output before and
after the run.

Target: RSS growth under 5% for the broker and for the worker, and every request
answered.

Run:  .venv/bin/python bench/soak.py                    (10 minutes, then its report)
      .venv/bin/python bench/soak.py --duration-s 60    (a short run)
Writes bench/out/soak.json and bench/out/soak.png.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import psutil
from common import (
    ProcessGroup,
    parser,
    pct,
    pyplot,
    quiet_logs,
    save_plot,
    table,
    tensor,
    verdict,
    wait_workers,
    write_json,
)

from carpool import loadgen
from carpool.client import Client
from carpool.sim.workload import arrivals, poisson
from carpool.worker.engines.synthetic import synthetic_output

MODEL = "synthetic"
SHAPE = (1, 16)
TIMEOUT_MS = 1000
TARGET_GROWTH_PCT = 5.0


class RssSampler:
    """Reads the RSS of some processes every ``every_s`` on a thread, until stopped."""

    def __init__(self, pids: dict[str, int], every_s: float) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.every_s = every_s
        self.samples: list[dict[str, float]] = []  # {"t_s": ..., name: rss bytes, ...}
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self) -> None:
        self._start = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while True:
            sample = {"t_s": time.monotonic() - self._start}
            for name, proc in self.procs.items():
                sample[name] = float(proc.memory_info().rss)
            self.samples.append(sample)
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t_s: float) -> dict[str, float]:
        """The first sample at or after ``t_s`` (the last one if none is)."""
        return next((s for s in self.samples if s["t_s"] >= t_s), self.samples[-1])


def check_answer(frontend: str) -> None:
    x = tensor(SHAPE, seed=7)
    with Client(frontend, default_timeout_s=10.0) as client:
        y = client.infer(MODEL, {"x": x})["y"]
    if not np.array_equal(y, synthetic_output(x)):
        raise RuntimeError("the fleet gave a wrong answer")


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--duration-s", type=float, default=600.0, help="the schedule's length")
    p.add_argument("--warmup-s", type=float, help="default: 60 s, or a quarter of a shorter run")
    p.add_argument("--load", type=float, default=0.8, help="share of the fleet's capacity")
    p.add_argument("--fixed-ms", type=float, default=4.0, help="α: the engine's cost per batch")
    p.add_argument("--per-sample-ms", type=float, default=0.5, help="β: its cost per sample")
    p.add_argument("--max-batch", type=int, default=8, help="the broker's B_max")
    p.add_argument("--sample-s", type=float, default=5.0, help="how often RSS is read")
    args = p.parse_args(argv)
    if args.quick:
        args.duration_s = min(args.duration_s, 30.0)
    quiet_logs()
    warmup_s = args.warmup_s if args.warmup_s is not None else min(60.0, args.duration_s / 4)
    batch_s = (args.fixed_ms + args.per_sample_ms * args.max_batch) / 1000
    capacity = args.max_batch / batch_s
    rate = args.load * capacity
    schedule = arrivals(poisson(rate, args.duration_s), shape=SHAPE, timeout_ms=TIMEOUT_MS)
    inputs = [{"x": tensor(SHAPE)}] * len(schedule)
    print(
        f"soak: {rate:.0f} req/s ({100 * args.load:.0f}% of {capacity:.0f}/s) for "
        f"{args.duration_s:g} s, {len(schedule):,} requests; RSS every {args.sample_s:g} s, "
        f"warm-up {warmup_s:g} s",
        file=sys.stderr,
    )
    with ProcessGroup(args.transport) as group:
        frontend, backend = group.endpoint("frontend"), group.endpoint("backend")
        broker = group.broker(frontend, backend, "--max-batch", str(args.max_batch))
        synthetic = [str(args.fixed_ms), str(args.per_sample_ms)]
        worker = group.worker(backend, "--synthetic", *synthetic, "--name", "soak")
        wait_workers(frontend, 1, group)
        check_answer(frontend)
        sampler = RssSampler({"broker": broker.pid, "worker": worker.pid}, args.sample_s)
        sampler.start()
        started = time.monotonic()
        report = loadgen.run(frontend, schedule, inputs, warmup_s=warmup_s, keep=True)
        ran_s = time.monotonic() - started
        sampler.stop()
        group.check_alive()
        check_answer(frontend)
        with Client(frontend) as client:
            stats = client.stats()
    samples = report.samples
    outcomes = Counter(s.outcome for s in samples)
    ok = outcomes.pop("ok", 0)
    never = outcomes.pop("pending", 0)
    after_warmup = [s.latency_s for s in samples if s.outcome == "ok" and s.scheduled_s >= warmup_s]
    warm, end = sampler.at(warmup_s), sampler.at(args.duration_s)
    growth = {name: 100 * (end[name] / warm[name] - 1) for name in ("broker", "worker")}
    passed = all(g < TARGET_GROWTH_PCT for g in growth.values()) and never == 0
    result: dict[str, Any] = {
        "question": "broker and worker RSS growth over a soak at a steady share of capacity",
        "transport": args.transport,
        "duration_s": args.duration_s,
        "ran_s": ran_s,
        "warmup_s": warmup_s,
        "fixed_ms": args.fixed_ms,
        "per_sample_ms": args.per_sample_ms,
        "max_batch": args.max_batch,
        "capacity_rps": capacity,
        "rate_rps": rate,
        "timeout_ms": TIMEOUT_MS,
        "sent": len(samples),
        "answered": len(samples) - never,
        "ok": ok,
        "never_answered": never,
        "errors": dict(outcomes),
        "latency_ms": {
            "p50": 1000 * pct(after_warmup, 50) if after_warmup else None,
            "p99": 1000 * pct(after_warmup, 99) if after_warmup else None,
        },
        "kept_up": report.kept_up,
        "p99_send_lag_ms": report.p99_send_lag_ms,
        "rss_mb": {
            name: {"warm": warm[name] / 2**20, "end": end[name] / 2**20}
            for name in ("broker", "worker")
        },
        "rss_growth_pct": growth,
        "rss_samples": sampler.samples,
        "broker_stats": {k: v for k, v in stats.items() if k not in ("workers", "id")},
        "target": f"RSS growth < {TARGET_GROWTH_PCT:g}% for each, every request answered",
        "pass": passed,
    }
    rows = [
        [
            name,
            f"{warm[name] / 2**20:.1f}",
            f"{end[name] / 2**20:.1f}",
            f"{growth[name]:+.2f}%",
            verdict(growth[name] < TARGET_GROWTH_PCT),
        ]
        for name in ("broker", "worker")
    ]
    print(f"\nRSS after the {warmup_s:g} s warm-up and at {args.duration_s:g} s")
    print(table(["process", "warm MB", "end MB", "growth", f"< {TARGET_GROWTH_PCT:g}%"], rows))
    latency = result["latency_ms"]
    print(
        f"requests: {len(samples):,} sent, {len(samples) - never:,} answered, {ok:,} with "
        f"outputs, errors {dict(outcomes) or 'none'}, never answered {never}; "
        f"p50 {latency['p50']:.1f} ms, p99 {latency['p99']:.1f} ms after the warm-up; "
        f"generator kept up: {report.kept_up}"
    )
    print(f"target: {result['target']}: {verdict(passed)}")
    write_json("soak", result)
    plot(result)
    return 0


def plot(result: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    samples = result["rss_samples"]
    t = [s["t_s"] for s in samples]
    for name in ("broker", "worker"):
        ax.plot(t, [s[name] / 2**20 for s in samples], label=name)
    ax.axvline(result["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(f"soak at {result['rate_rps']:.0f} req/s ({result['sent']:,} requests)")
    ax.legend()
    save_plot(fig, "soak")


if __name__ == "__main__":
    sys.exit(main())
