"""Does carpool's batching policy deliver? (issue: deadline-aware adaptive batching)

Measures, on a GPU-like synthetic engine (batch cost α = 5 ms + β = 0.5 ms per sample) and a
50 ms SLA, as ratios between policies in the same run:

1. stationary Poisson load: carpool's goodput against the oracle (the best fixed
   (B_max, T_max) on a grid, found by replaying the same arrivals);
2. time-varying load (steps, bursts, a compressed day): carpool against the best fixed
   configuration for that very workload;
3. against no batching: the highest Poisson rate each sustains with p99 within the SLA and
   under 1% misses, and p99 at no batching's highest rate;
4. the live fleet: broker and a synthetic worker as processes, an open-loop client,
   the same Poisson arrivals as the simulator, to show where the two differ.

Run:  .venv/bin/python bench/batching.py            (about 10 minutes on 2 cores)
      .venv/bin/python bench/batching.py --quick    (a smoke run, under a minute)
Writes bench/out/batching.json and bench/out/batching.png (if matplotlib is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from carpool.broker.config import BatchingConfig
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.sim import workload
from carpool.sim.compare import GRID_BATCH, GRID_WAIT_MS, grid_search, table
from carpool.sim.simulator import EngineCost, SimResult, SimWorker, simulate
from carpool.sim.workload import Arrival

OUT = Path(__file__).resolve().parent / "out"
ALPHA_S, BETA_S, JITTER = 0.005, 0.0005, 0.05
SLA_MS = 50
WORKERS = [SimWorker("gpu", EngineCost(ALPHA_S, BETA_S, JITTER), max_batch=64)]
CARPOOL = BatchingConfig(max_batch=64, max_wait_s=0.005, policy="carpool")
NO_BATCHING = BatchingConfig(max_batch=1, max_wait_s=0.0, policy="fixed")
SEED_RULE = BatchingConfig(max_batch=64, max_wait_s=0.005, policy="seed")


def run(arrivals: Sequence[Arrival], config: BatchingConfig, label: str) -> SimResult:
    return simulate(arrivals, WORKERS, config, label=label)


def oracle(arrivals: Sequence[Arrival], quick: bool) -> SimResult:
    grid = grid_search(
        arrivals,
        WORKERS,
        batch_sizes=(8, 16, 32, 64) if quick else GRID_BATCH,
        waits_ms=(2.0, 5.0, 10.0, 20.0) if quick else GRID_WAIT_MS,
    )
    best = grid[0].result
    best.label = f"best fixed: {best.label[6:]}"
    return best


def row(r: SimResult) -> dict[str, object]:
    return {
        "policy": r.label,
        "throughput_rps": round(r.throughput_rps, 1),
        "goodput_rps": round(r.goodput_rps, 1),
        "p50_ms": round(r.percentile_ms(50), 1),
        "p99_ms": round(r.percentile_ms(99), 1),
        "miss_pct": round(100 * r.miss_rate, 2),
        "mean_batch": round(r.mean_batch, 2),
        "busy_pct": round(100 * r.busy_share, 1),
    }


def stationary(quick: bool) -> list[dict[str, Any]]:
    """One entry per arrival rate: the rate, carpool/oracle goodput, and a row per policy."""
    out: list[dict[str, Any]] = []
    for rate in (300, 1000) if quick else (300, 1000, 1400):
        items = workload.arrivals(
            workload.poisson(rate, 2 if quick else 10), timeout_ms=SLA_MS, seed=rate
        )
        results = [
            run(items, NO_BATCHING, "no batching"),
            run(
                items, BatchingConfig(max_batch=8, max_wait_s=0.005, policy="fixed"), "fixed 8/5ms"
            ),
            run(items, SEED_RULE, "seed rho rule"),
            run(items, CARPOOL, "carpool"),
            oracle(items, quick),
        ]
        ratio = results[3].goodput_rps / results[4].goodput_rps
        print(f"\nPoisson {rate}/s, SLA {SLA_MS} ms — carpool/oracle goodput = {ratio:.3f}")
        print(table(results))
        out.append({"rate": rate, "carpool_over_oracle": ratio, "rows": [row(r) for r in results]})
    return out


def time_varying(quick: bool) -> list[dict[str, object]]:
    scale = 0.3 if quick else 1.0
    loads = {
        "steps 200/1400/300/1200 per 3 s": workload.steps([200, 1400, 300, 1200], 3 * scale),
        "steps with overload 300/2000/300/1200": workload.steps([300, 2000, 300, 1200], 3 * scale),
        "bursts 300/s + 1500/s for 0.3 s every 2 s": workload.bursts(
            300, 1500, 12 * scale, 2.0, 0.3
        ),
        "bursts 300/s + 2500/s for 0.3 s every 2 s": workload.bursts(
            300, 2500, 12 * scale, 2.0, 0.3
        ),
        "compressed day 100..1400/s": workload.diurnal(100, 1400, 12 * scale),
    }
    out = []
    for name, phases in loads.items():
        items = workload.arrivals(phases, timeout_ms=SLA_MS, seed=7)
        results = [run(items, CARPOOL, "carpool"), oracle(items, quick)]
        ratio = results[0].goodput_rps / results[1].goodput_rps
        print(f"\n{name} — carpool/best fixed goodput = {ratio:.3f}")
        print(table(results))
        out.append(
            {"load": name, "carpool_over_best_fixed": ratio, "rows": [row(r) for r in results]}
        )
    return out


def sustained_rate(config: BatchingConfig, quick: bool) -> tuple[float, SimResult]:
    """Highest Poisson rate with p99 <= SLA and misses < 1% (bisection on the rate)."""
    low, high = 20.0, 3000.0
    best: SimResult | None = None
    for _ in range(7 if quick else 10):
        mid = (low + high) / 2
        items = workload.arrivals(workload.poisson(mid, 2 if quick else 8), timeout_ms=SLA_MS)
        r = run(items, config, "probe")
        if r.miss_rate < 0.01 and r.percentile_ms(99) <= SLA_MS:
            low, best = mid, r
        else:
            high = mid
    assert best is not None
    return low, best


def against_no_batching(quick: bool) -> dict[str, object]:
    rate_nb, _ = sustained_rate(NO_BATCHING, quick)
    rate_cp, _ = sustained_rate(CARPOOL, quick)
    items = workload.arrivals(workload.poisson(rate_nb, 2 if quick else 10), timeout_ms=SLA_MS)
    at_nb = [run(items, NO_BATCHING, "no batching"), run(items, CARPOOL, "carpool")]
    gain = rate_cp / rate_nb - 1
    print(
        f"\nsustained rate (p99 <= {SLA_MS} ms, misses < 1%): no batching {rate_nb:.0f}/s, "
        f"carpool {rate_cp:.0f}/s: {100 * gain:+.0f}% (the seeds report +81%)"
    )
    print(f"at no batching's highest rate ({rate_nb:.0f}/s):")
    print(table(at_nb))
    return {
        "no_batching_rps": rate_nb,
        "carpool_rps": rate_cp,
        "gain": gain,
        "at_no_batching_rate": [row(r) for r in at_nb],
    }


# Camera frames as (channels, height, width) at 1/100 of the pixels (the simulator only needs
# the ratios): 1080p (padded to 1088 for the detector), 720p, 480p.
CAMERAS = {"1080p": (3, 109, 192), "720p": (3, 72, 128), "480p": (3, 48, 64)}
# (label, fixed cost s, cost per 1080p frame s, offered frames/s): one engine where the fixed
# cost dominates, one (a detector) where the per-frame compute does.
CAMERA_ENGINES = [
    ("5 ms + 0.5 ms per 1080p frame", 0.005, 0.0005, 600),
    ("5 ms + 4 ms per 1080p frame", 0.005, 0.004, 200),
]


def cameras(quick: bool) -> list[dict[str, object]]:
    """The seeds' multi-resolution camera table: static batching padded to 1080p against
    batching per resolution, on engines whose per-frame cost scales with pixels."""
    import math
    import random

    largest = math.prod(CAMERAS["1080p"])
    out = []
    for name, alpha_s, beta_s, rate in CAMERA_ENGINES:
        workers = [SimWorker("gpu", EngineCost(alpha_s, beta_s, JITTER, largest), 64)]
        rng = random.Random(5)
        base = workload.arrivals(
            workload.poisson(rate, 3 if quick else 10), timeout_ms=SLA_MS, seed=5
        )
        mixed = [
            Arrival(a.t_s, a.model, (1, *CAMERAS[rng.choice(list(CAMERAS))]), a.timeout_ms)
            for a in base
        ]
        padded = [Arrival(a.t_s, a.model, (1, *CAMERAS["1080p"]), a.timeout_ms) for a in mixed]
        real_share = sum(math.prod(a.shape) for a in mixed) / (largest * len(mixed))
        fixed = BatchingConfig(max_batch=8, max_wait_s=0.005, policy="fixed")
        runs = [
            ("static, padded to 1080p 8/5ms", padded, fixed, 1 - real_share),
            ("fixed per resolution 8/5ms", mixed, fixed, 0.0),
            ("carpool per resolution", mixed, CARPOOL, 0.0),
        ]
        rows, results = [], []
        for label, items, config, padding in runs:
            r = simulate(items, workers, config, label=label)
            results.append(r)
            rows.append(row(r) | {"padded_compute_pct": round(100 * padding, 1)})
        print(f"\ncameras 1080p/720p/480p in equal shares, {rate} frames/s, engine {name}")
        print(table(results))
        print(
            "padded share of compute: "
            + ", ".join(f"{r['policy']} {r['padded_compute_pct']}%" for r in rows)
        )
        out.append({"engine": name, "rate": rate, "rows": rows})
    return out


@contextlib.contextmanager
def fleet(policy: list[str]) -> Iterator[str]:
    """A broker and one synthetic worker as processes; yields the client endpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        frontend, backend = f"ipc://{tmp}/frontend", f"ipc://{tmp}/backend"
        cmd = [sys.executable, "-m", "carpool", "--log-level", "WARNING"]
        broker = subprocess.Popen(
            [*cmd, "broker", "--frontend", frontend, "--backend", backend, *policy]
        )
        worker = subprocess.Popen(
            [*cmd, "worker", "--broker", backend, "--max-batch", "64", "--synthetic", "5", "0.5"]
        )
        try:
            with Client(frontend) as client:
                clock = MonotonicClock()
                until = clock.now() + 30
                while not client.stats()["workers"]:
                    if clock.now() > until:
                        raise RuntimeError("the worker did not register")
                    client.poll(0.05)
            yield frontend
        finally:
            for proc in (worker, broker):
                proc.terminate()
            for proc in (worker, broker):
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def live(quick: bool, best_fixed: tuple[int, float]) -> list[dict[str, object]]:
    from carpool.loadgen import run_open_loop

    rate = 1000
    items = workload.arrivals(
        workload.poisson(rate, 3 if quick else 10), timeout_ms=SLA_MS, seed=11
    )
    b, t_s = best_fixed
    policies = [
        (
            "no batching",
            ["--policy", "fixed", "--max-batch", "1", "--max-wait-ms", "0"],
            NO_BATCHING,
        ),
        (
            f"fixed {b}/{1000 * t_s:g}ms",
            ["--policy", "fixed", "--max-batch", str(b), "--max-wait-ms", str(1000 * t_s)],
            BatchingConfig(max_batch=b, max_wait_s=t_s, policy="fixed"),
        ),
        ("carpool", ["--policy", "carpool", "--max-batch", "64", "--max-wait-ms", "5"], CARPOOL),
    ]
    out = []
    rows = []
    for label, flags, config in policies:
        with fleet(flags) as endpoint:
            measured = run_open_loop(endpoint, items, label=f"live: {label}")
        simulated = run(items, config, f"sim:  {label}")
        rows += [measured.result, simulated]
        out.append(
            {
                "policy": label,
                "live": row(measured.result),
                "sim": row(simulated),
                "max_send_lag_ms": round(measured.max_send_lag_ms, 2),
            }
        )
    print(f"\nlive fleet vs simulator, Poisson {rate}/s, SLA {SLA_MS} ms")
    print("(busy % is not measured live)")
    print(table(rows))
    return out


def plot(stationary_rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rates = [float(s["rate"]) for s in stationary_rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    policies = [r["policy"] for r in stationary_rows[0]["rows"]]
    for i, name in enumerate(policies):
        good = [s["rows"][i]["goodput_rps"] for s in stationary_rows]
        p99 = [s["rows"][i]["p99_ms"] for s in stationary_rows]
        label = "best fixed (grid, per load)" if str(name).startswith("best fixed") else str(name)
        axes[0].plot(rates, good, marker="o", label=label)
        axes[1].plot(rates, p99, marker="o", label=label)
    axes[0].plot(rates, rates, "k:", label="offered")
    axes[0].set(xlabel="offered load (req/s)", ylabel="goodput (req/s)", title="goodput")
    axes[1].set(xlabel="offered load (req/s)", ylabel="p99 latency of answers (ms)", title="p99")
    axes[1].axhline(SLA_MS, color="k", linestyle=":")
    axes[0].legend(fontsize=7)
    fig.suptitle("GPU-like engine 5 ms + 0.5 ms x B, SLA 50 ms (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short workloads, small grid")
    parser.add_argument("--no-live", action="store_true", help="skip the live fleet part")
    parser.add_argument(
        "--live-only",
        metavar="B,T_MS",
        help="only the live part, with this best fixed config (e.g. 16,20)",
    )
    parser.add_argument("--cameras-only", action="store_true", help="only the camera table")
    args = parser.parse_args(argv)
    if args.cameras_only:
        logging.getLogger("carpool").setLevel(logging.WARNING)
        cameras(args.quick)
        return 0
    if args.live_only:
        b, t_ms = args.live_only.split(",")
        live(args.quick, (int(b), float(t_ms) / 1000))
        return 0
    logging.getLogger("carpool").setLevel(logging.WARNING)
    OUT.mkdir(exist_ok=True)
    report: dict[str, object] = {"engine": {"alpha_s": ALPHA_S, "beta_s": BETA_S}, "sla_ms": SLA_MS}
    report["stationary"] = stationary_rows = stationary(args.quick)
    report["time_varying"] = time_varying(args.quick)
    report["against_no_batching"] = against_no_batching(args.quick)
    report["cameras"] = cameras(args.quick)
    if not args.no_live:
        best = stationary_rows[1]["rows"][-1]["policy"]
        parts = str(best).split()  # "best fixed: B=32 T=10ms"
        b = int(parts[2][2:])
        t_s = float(parts[3][2:-2]) / 1000
        report["live"] = live(args.quick, (b, t_s))
    (OUT / "batching.json").write_text(json.dumps(report, indent=2))
    if plot(stationary_rows, OUT / "batching.png"):
        print(f"\nwrote {OUT / 'batching.png'}")
    print(f"wrote {OUT / 'batching.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
