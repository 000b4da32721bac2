"""Does the simulator predict the live fleet? A recorded live run, replayed in it.

Method. One live fleet per pass, as processes on this machine over tcp on 127.0.0.1: a
``carpool broker --policy carpool --max-batch 16 --max-wait-ms 5 --record TRACE`` and one
``carpool worker --model mlp=FILE.onnx --threads 1``, serving bench/peers/mlp.py's
ONNX MLP [N,3,64,64] float32 -> [N,10] at width H (``--hidden``; H=512 costs about
0.65 ms at batch 1 and 2.5 ms at batch 16 on one ONNX Runtime
thread). This process is the open-loop Poisson load generator (carpool.loadgen): a
warm-up at the pass's rate, then the measured window. Before the fleet stops, STATS
gives the worker lane's fits (the engine's α, β and spread; the worker's own CPU per
batch outside the engine, from RESULT ``cpu_ms``) and the worker's telemetry
``host_cpu_pct``. The pass's trace, cut to the measured window, is then replayed with
``carpool replay --simulate`` and the same batching flags, four times: with all those
figures ("sim"); with them and, per batch, a transfer time ("+xfer": the pass's median
round trip less the engine's time and the worker's CPU, from the broker's batch lines,
by which each RESULT reaches the simulated broker late); with them and, per batch, a
transfer drawn at random from the pass's own batches' ("drawn": each batch line's round
trip less its engine time and the worker's fitted CPU for its size, through ``carpool
replay --transfer-ms-from``), which carries their spread, and so the waits for a core
that make the live tail; and with the engine's figures alone ("engine": no worker CPU,
no host busy share), which shows what the overhead model changes. Rates are interleaved
within each pass, and every pass has a fresh broker, worker and trace.

Compared per rate: mean batch, p50 and p99, as medians over the passes, with the live
passes' spread (max - min). A figure agrees when the simulator's median is within the
tolerance of the live median (mean batch 15%, p50 20%, p99 30%) or within the live
passes' own spread of it. The latency bases differ: live latency counts from each
request's scheduled send at the client (its send, four ZeroMQ hops and the broker's and
client's CPU included); the simulator's from the request's arrival at the broker. The
live broker's own p50 and p99 (STATS: arrival to RESULT, over its last 2,048 requests)
are on the simulator's base, and are compared too. The broker runs at DEBUG, a line per
batch; from those lines each rate also reports what the simulator does not model: each
batch's round trip less its engine time, against the worker's CPU per batch, and how
long each batch's oldest request waited, against T_max.

Run:  .venv/bin/python bench/sim_vs_live.py          (about 2.5 minutes on 2 cores)
      .venv/bin/python bench/sim_vs_live.py --quick  (a smoke run, about 30 s)
Writes bench/out/sim_vs_live.json. The machine is shared: the live figures are noisy.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import CARPOOL, OUT, ProcessGroup, parser, quiet_logs, wait_workers
from peers import mlp

from carpool.client import Client
from carpool.loadgen import run, synthetic_inputs
from carpool.sim import workload
from carpool.sim.workload import Arrival

MODEL = "mlp"
ITEM_SHAPE = (3, 64, 64)
HIDDEN = 512
BATCHING = ["--policy", "carpool", "--max-batch", "16", "--max-wait-ms", "5"]
TIMEOUT_MS = 1000
#: The agreement asked of the simulator: its figure over the live one within 1 ± this.
TOLERANCE = {"mean_batch": 0.15, "p50_ms": 0.20, "p99_ms": 0.30}
#: Each figure compared: the live one, the simulator's it is held against, and its
#: tolerance. ``broker_*``: the live broker's own percentiles (STATS, arrival to RESULT,
#: its last 2,048 requests), on the simulator's latency base.
FIGURES = {
    "mean_batch": ("mean_batch", 0.15),
    "p50_ms": ("p50_ms", 0.20),
    "p99_ms": ("p99_ms", 0.30),
    "broker_p50_ms": ("p50_ms", 0.20),
    "broker_p99_ms": ("p99_ms", 0.30),
}
#: The replays of each pass (the module's docstring).
VARIANTS = ("sim", "sim_transfer", "sim_drawn", "sim_engine_only")


def poisson(rate: float, duration_s: float, seed: int) -> list[Arrival]:
    phases = workload.poisson(rate, duration_s)
    items = workload.arrivals(phases, timeout_ms=TIMEOUT_MS, seed=seed)
    return [Arrival(a.t_s, MODEL, (1, *ITEM_SHAPE), a.timeout_ms) for a in items]


def lane_figures(stats: dict[str, Any]) -> dict[str, float]:
    """The worker lane's fits and its host's CPU in use, from a STATS answer."""
    (worker,) = stats["workers"]
    lane = worker["lanes"][MODEL]
    return {
        "alpha_ms": float(lane["fixed_cost_ms"]),
        "beta_ms": float(lane["per_sample_ms"]),
        "spread": float(lane["spread"]),
        "cpu_alpha_ms": float(lane["cpu_fixed_ms"]),
        "cpu_beta_ms": float(lane["cpu_per_sample_ms"]),
        "host_cpu_pct": float(worker["telemetry"].get("host_cpu_pct", 0.0)),
    }


def live_pass(
    model: Path, rate: float, seed: int, duration_s: float, warmup_s: float, trace: Path
) -> tuple[dict[str, Any], dict[str, float], float]:
    """One live pass at ``rate``: the measured figures, the fitted figures, and the Unix
    time the measured window's schedule began after (the warm-up's arrivals came before)."""
    warm = poisson(rate, warmup_s, seed + 1000)
    items = poisson(rate, duration_s, seed)
    log = trace.with_suffix(".broker.log")
    with ProcessGroup("tcp") as group, open(log, "wb") as log_file:
        frontend, backend = group.endpoint("frontend"), group.endpoint("backend")
        # At DEBUG: a line per batch (carpool.broker.stats), read by :func:`batch_times`.
        broker = [*CARPOOL, "broker", "--frontend", frontend, "--backend", backend]
        broker += [*BATCHING, "--record", str(trace), "--log-level", "DEBUG"]
        proc = subprocess.Popen(broker, stdin=subprocess.DEVNULL, stderr=log_file)
        group.procs.append(("broker", proc))
        group.worker(backend, "--model", f"{MODEL}={model}", "--threads", "1")
        wait_workers(frontend, 1, group)
        run(frontend, warm, synthetic_inputs(warm), warmup_s=0.0)
        start_unix, log_offset = time.time(), log.stat().st_size
        report = run(frontend, items, synthetic_inputs(items), warmup_s=0.0)
        with Client(frontend) as client:
            stats = client.stats()
        fit = lane_figures(stats)
        group.check_alive()
    sizes = report.batch_sizes.get(MODEL, {})
    batches = sum(sizes.values())
    live = {
        "sent": report.sent,
        "ok": report.ok,
        "throughput_rps": round(report.throughput_rps, 1),
        "mean_batch": sum(k * v for k, v in sizes.items()) / batches if batches else 0.0,
        "p50_ms": report.latency_ms["p50"],
        "p99_ms": report.latency_ms["p99"],
        "broker_p50_ms": float(stats["models"][MODEL]["latency"]["p50_ms"]),
        "broker_p99_ms": float(stats["models"][MODEL]["latency"]["p99_ms"]),
        "p99_send_lag_ms": round(report.p99_send_lag_ms, 3),
        "kept_up": report.kept_up,
        **batch_times(log, log_offset),
    }
    return live, fit, start_unix


_BATCH_LINE = re.compile(
    r"size=(\d+) .*?wait_ms=([\d.]+) compute_ms=([\d.]+) round_trip_ms=([\d.]+)"
)


def batch_times(log: Path, offset: int) -> dict[str, Any]:
    """From the broker's per-batch lines after ``offset``: the median queue wait of each
    batch's oldest request (against T_max: how late its timer fired), and the median of
    each batch's round trip less its engine time (the transfers, the worker's own CPU,
    a wait behind the worker's previous batch, and any wait for a core; the simulator
    has only the worker's CPU of it); and each batch's size with that time
    (``batches``, for the transfers the simulator draws)."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    rows = [tuple(map(float, m)) for m in _BATCH_LINE.findall(text)]
    if not rows:
        return {"batch_wait_ms": math.nan, "outside_engine_ms": math.nan, "batches": []}
    return {
        "batch_wait_ms": statistics.median(wait for _, wait, _, _ in rows),
        "outside_engine_ms": statistics.median(rt - c for _, _, c, rt in rows),
        "batches": [(int(size), rt - c) for size, _, c, rt in rows],
    }


def transfers(batches: Sequence[tuple[int, float]], fit: dict[str, float]) -> list[float]:
    """Each batch's round trip less its engine time and the worker's fitted CPU for its
    size (ms, at least 0): what the simulator draws a batch's transfer from."""
    cpu_alpha, cpu_beta = fit["cpu_alpha_ms"], fit["cpu_beta_ms"]
    return [max(0.0, outside - cpu_alpha - cpu_beta * size) for size, outside in batches]


def cut(trace: Path, after_unix: float, out: Path) -> int:
    """Write the arrivals of ``trace`` after ``after_unix`` to ``out``; returns how many."""
    lines = [
        line
        for line in trace.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line)["t_s"] >= after_unix
    ]
    out.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return len(lines)


def replay(
    trace: Path,
    fit: dict[str, float],
    *,
    overhead: bool,
    transfer_ms: float = 0.0,
    transfers_from: Path | None = None,
) -> dict[str, float]:
    """``carpool replay --simulate`` of ``trace`` with the fitted figures (``overhead``:
    the worker's CPU per batch and its host's busy share too; ``transfer_ms``: how much
    later than its end each batch's RESULT reaches the broker; ``transfers_from``: a file
    of such delays, one drawn per batch)."""
    out = trace.with_suffix(".sim.json")
    flags = [
        *("--alpha-ms", str(fit["alpha_ms"]), "--beta-ms", str(fit["beta_ms"])),
        *("--jitter", str(fit["spread"])),
    ]
    if overhead:
        flags += ["--cpu-alpha-ms", str(fit["cpu_alpha_ms"])]
        flags += ["--cpu-beta-ms", str(fit["cpu_beta_ms"])]
        flags += ["--host-busy-pct", str(min(100.0, fit["host_cpu_pct"]))]
    if transfer_ms > 0:
        flags += ["--transfer-ms", str(transfer_ms)]
    if transfers_from is not None:
        flags += ["--transfer-ms-from", str(transfers_from)]
    cmd = [*CARPOOL, "replay", "--trace", str(trace), "--simulate", *BATCHING, *flags]
    subprocess.run([*cmd, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
    (row,) = json.loads(out.read_text(encoding="utf-8"))
    return {k: float(row[k]) for k in ("mean_batch", "p50_ms", "p99_ms", "throughput_rps")}


def summarize(rate: float, passes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per rate: each figure's live median and spread, the simulator's medians (with
    and without the overhead model), their ratios to live, and whether they agree."""
    out: dict[str, Any] = {
        "rate": rate,
        "passes": len(passes),
        # passes whose generator sent on schedule (else its lag is in the live latency)
        "generator_kept_up": sum(1 for p in passes if p["live"]["kept_up"]),
        "host_cpu_pct": statistics.median(p["fit"]["host_cpu_pct"] for p in passes),
        "cpu_per_batch_ms": statistics.median(
            p["fit"]["cpu_alpha_ms"] + p["fit"]["cpu_beta_ms"] * p["live"]["mean_batch"]
            for p in passes
        ),
        "batch_wait_ms": statistics.median(p["live"]["batch_wait_ms"] for p in passes),
        "outside_engine_ms": statistics.median(p["live"]["outside_engine_ms"] for p in passes),
    }
    for figure, (sim_figure, tolerance) in FIGURES.items():
        live = [p["live"][figure] for p in passes]
        median, spread = statistics.median(live), max(live) - min(live)
        row: dict[str, Any] = {"live": median, "live_spread": spread}
        for name in VARIANTS:
            value = statistics.median(p[name][sim_figure] for p in passes)
            ratio = value / median if median else math.nan
            row[name] = value
            row[f"{name}_ratio"] = ratio
            row[f"{name}_agrees"] = abs(ratio - 1) <= tolerance or abs(value - median) <= spread
        out[figure] = row
    return out


def table(summary: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'rate/s':>7} {'figure':<13} {'live':>8} {'spread':>7} {'sim':>8} {'ratio':>6} "
        f"{'ok':>3} {'+xfer':>8} {'ratio':>6} {'ok':>3} {'drawn':>8} {'ratio':>6} {'ok':>3} "
        f"{'engine':>8} {'ratio':>6} {'ok':>3}"
    )
    rows = [head, "-" * len(head)]
    for s in summary:
        for figure in FIGURES:
            r = s[figure]
            cells = [
                f"{r[n]:8.2f} {r[f'{n}_ratio']:6.2f} {'yes' if r[f'{n}_agrees'] else 'NO':>3}"
                for n in VARIANTS
            ]
            rows.append(
                f"{s['rate']:>7g} {figure:<13} {r['live']:8.2f} {r['live_spread']:7.2f} "
                + " ".join(cells)
            )
    notes = [
        f"{s['rate']:g}/s: generator on schedule in {s['generator_kept_up']} of "
        f"{s['passes']} passes; host CPU in use {s['host_cpu_pct']:.0f}% (telemetry); "
        f"per batch: the worker's CPU {s['cpu_per_batch_ms']:.2f} ms (the simulator's "
        f"overhead), round trip less engine {s['outside_engine_ms']:.2f} ms, oldest "
        f"request's wait {s['batch_wait_ms']:.2f} ms (medians)"
        for s in summary
    ]
    return "\n".join([*rows, *notes])


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--rates", default="600,1500,2200", help="offered rates, requests/s")
    p.add_argument("--duration-s", type=float, default=8.0, help="measured window per pass")
    p.add_argument("--warmup-s", type=float, default=1.5, help="warm-up per pass, not measured")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="the MLP's hidden width")
    p.add_argument("--out", default=str(OUT / "sim_vs_live.json"), help="JSON report")
    args = p.parse_args(argv)
    quiet_logs()
    rates = [float(r) for r in args.rates.split(",")]
    passes = args.reps or 3
    duration_s, warmup_s = args.duration_s, args.warmup_s
    if args.quick:
        rates, passes, duration_s, warmup_s = rates[:2], 2, 2.0, 1.0
    work = OUT / "sim_vs_live"
    model = mlp.ensure(args.hidden)  # (cached in bench/out, as bench/policy_live.py has it)
    started = time.monotonic()
    runs: dict[float, list[dict[str, Any]]] = {rate: [] for rate in rates}
    for n in range(passes):
        for rate in rates:
            trace = work / f"trace-{rate:g}-{n}.jsonl"
            trace.unlink(missing_ok=True)
            live, fit, start_unix = live_pass(model, rate, n, duration_s, warmup_s, trace)
            measured = work / f"measured-{rate:g}-{n}.jsonl"
            arrivals = cut(trace, start_unix, measured)
            sim = replay(measured, fit, overhead=True)
            # What the broker's batch lines show beyond the engine and the worker's CPU.
            cpu_ms = fit["cpu_alpha_ms"] + fit["cpu_beta_ms"] * live["mean_batch"]
            transfer_ms = max(0.0, live["outside_engine_ms"] - cpu_ms)
            drawn = work / f"transfers-{rate:g}-{n}.txt"
            drawn.write_text(
                "".join(f"{x:.4f}\n" for x in transfers(live.pop("batches"), fit)),
                encoding="utf-8",
            )
            runs[rate].append(
                {
                    "pass": n,
                    "recorded": arrivals,
                    "live": live,
                    "fit": fit,
                    "transfer_ms": transfer_ms,
                    "sim": sim,
                    "sim_transfer": replay(measured, fit, overhead=True, transfer_ms=transfer_ms),
                    "sim_drawn": replay(measured, fit, overhead=True, transfers_from=drawn),
                    "sim_engine_only": replay(measured, fit, overhead=False),
                }
            )
            print(
                f"pass {n} {rate:g}/s: live B {live['mean_batch']:.2f} p50 {live['p50_ms']:.2f} "
                f"p99 {live['p99_ms']:.2f}; sim B {sim['mean_batch']:.2f} "
                f"p50 {sim['p50_ms']:.2f} p99 {sim['p99_ms']:.2f}; fit "
                + ", ".join(f"{k} {v:g}" for k, v in fit.items()),
                flush=True,
            )
    summary = [summarize(rate, runs[rate]) for rate in rates]
    print(
        "\nlive fleet vs its recorded trace replayed in the simulator (medians over "
        f"{passes} passes; sim: with the worker's CPU per batch and host busy share; +xfer: "
        "and the median transfer per batch; drawn: and each batch's transfer drawn from the "
        "live batches'; engine: the engine's fit alone)"
    )
    print(table(summary))
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "rates": rates,
        "passes": passes,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "hidden": args.hidden,
        "batching": BATCHING,
        "tolerance": TOLERANCE,
        "seconds": round(time.monotonic() - started, 1),
        "summary": summary,
        "runs": {f"{rate:g}": runs[rate] for rate in rates},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(f"\nwrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
