"""policy_live.py: carpool's batching policies on a live fleet, beside the one-process floor.

What: the same open-loop Poisson load on each target of bench/peers/ — carpool with its
default policy, carpool with ``--policy fixed`` (B_max 16, T_max 5 ms, as the default's
caps), the greedy one-process server (the floor), and carpool's default at another git
revision (``carpool@482d38b`` by default, for its ceiling) — and per offered rate their
latency, throughput, batch sizes and CPU per request of every process.

Method: the model is bench/peers/mlp.py's ONNX MLP (about 1 ms at batch 1, 3 ms at 16, one
ONNX Runtime thread). Each carpool target is one broker and one worker process over
``tcp://127.0.0.1``; the floor is one process. All targets start once and stay up for the
whole run (one that dies is started again before its next cell, and the cell says so).
Once started, each target is primed with ``--prime-s`` of uncounted load at 1,000/s
(default 3 s), so that no pass's first cell pays for what a fresh process learns or
warms: the default's fitted batch cost, without which it sends at once; the worker's
first runs; the allocator's arenas. A target started again mid-run is primed too.
A cell is one target at one rate: bench/peers/openloop.py, a process of its own, sends a
seeded Poisson schedule (``--warmup-s`` uncounted, then ``--seconds`` counted; 1,000 ms
timeout; latency from each request's scheduled send) and reports p50, p99, answers,
errors and its own CPU. Around it the harness reads the target's STATS (the batch-size
histogram, answered requests) and each server process's CPU (psutil), so CPU per request
and mean batch are the cell's own; between cells it waits until the target is idle.
Passes are interleaved: pass 1 runs every rate on every target, then pass 2, ..., the
target order rotated each pass and each pass with its own seed (the same for every target
in it), so a drift in the machine's load falls on all targets alike. The revision target
runs only at rates of ``--old-from`` and up (default 2,500/s: its ceiling is what is
wanted from it; ``--old-from 0`` runs it at every rate).

Report: per target and rate, medians over passes with min-max spreads; goodput (the highest
offered rate whose median p99 <= 50 ms with >= 99% answered); ceiling (the largest
served/s of any cell); and the checks: up to 0.9x fixed's ceiling, default's p99 and
server CPU per request at most max(1.05x fixed's median, fixed's largest pass); default's
goodput and ceiling at least 0.8x the floor's; default's ceiling at least the old
revision's. A cell whose generator used over half a core is marked void. On a shared
machine the figures are noisy: read the spreads.

Run:  PYTHONPATH=$PWD/src .venv/bin/python bench/policy_live.py [--rates 600,1000,...]
          [--passes 3] [--seconds 5] [--targets carpool-default,carpool-fixed,greedy,
          carpool@482d38b] [--old-from 2500] [--prime-s 3] [--quick]
Takes about 10 minutes with the defaults on 2 cores (84 cells of about 7.5 s, plus the
starts: 590-625 s measured); ``--quick`` (1,000 and 3,000/s, one pass, 2 s cells) about
30 s. Writes bench/out/policy_live.json and prints a markdown table for
docs/benchmarks.md, headed by the commit it ran at (``-dirty`` with uncommitted changes).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json
from peers import mlp, report, targets

OPENLOOP = Path(__file__).resolve().parent / "peers" / "openloop.py"
DEFAULT_RATES = "600,1000,1500,2000,2500,3000,3500,4200"
DEFAULT_TARGETS = "carpool-default,carpool-fixed,greedy,carpool@482d38b"
#: The rate of the uncounted load that primes a freshly started target.
PRIME_RATE = 1000.0
#: How long a target may take to finish the previous cell's work before the next begins.
SETTLE_S = 20.0


def cpu_s(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds (user + system, all threads) of each process, by role."""
    out = {}
    for role, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[role] = t.user + t.system
        except psutil.Error:
            out[role] = float("nan")
    return out


def histogram(snapshot: Mapping[str, Any] | None) -> Counter[int]:
    """The model's batch-size counts in a STATS answer (requests or samples per batch)."""
    if snapshot is None:
        return Counter()
    sizes = snapshot.get("batch_sizes", {}).get(targets.MODEL, {})
    return Counter({int(k): int(v) for k, v in sizes.items()})


def answered(snapshot: Mapping[str, Any] | None) -> int:
    return int(snapshot.get("replies", 0)) if snapshot is not None else 0


def settle(target: targets.Target) -> dict[str, Any] | None:
    """Wait until the target has nothing left to answer (its reply count holds still and
    nothing is queued or at a worker); its STATS then."""
    until = time.monotonic() + SETTLE_S
    last = targets.stats(target.endpoint, 10.0)
    while time.monotonic() < until:
        time.sleep(0.3)
        now = targets.stats(target.endpoint, 10.0)
        if now is None or last is None:
            last = now
            continue
        busy = now.get("queued", 0) or now.get("inflight_batches", 0)
        if answered(now) == answered(last) and not busy:
            return now
        last = now
    return last


def load(
    target: targets.Target, rate: float, seed: int, seconds: float, warmup_s: float,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """Run bench/peers/openloop.py against ``target``; its report."""
    cmd = [
        sys.executable, str(OPENLOOP), target.endpoint, "--rate", str(rate),
        "--seconds", str(seconds), "--warmup-s", str(warmup_s),
        "--seed", str(seed), "--timeout-ms", str(args.timeout_ms), "--model", targets.MODEL,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        env=targets.env_for(targets.ROOT / "src"),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        timeout=seconds + warmup_s + 60,
    )
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def prime(target: targets.Target, args: argparse.Namespace) -> None:
    """Uncounted load on a freshly started target (see the module's docstring)."""
    if args.prime_s > 0:
        load(target, PRIME_RATE, 0, args.prime_s, 0.0, args)
        settle(target)


def cell(
    target: targets.Target, rate: float, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One target at one rate: the generator's figures, CPU per request, batch sizes."""
    restarted = False
    if not target.alive():
        print(f"  {target.name} is down; starting it again", flush=True)
        target.restart()
        prime(target, args)
        restarted = True
    before = settle(target)
    pids = target.pids()
    cpu0, t0 = cpu_s(pids), time.monotonic()
    gen = load(target, rate, seed, args.seconds, args.warmup_s, args)
    after = targets.stats(target.endpoint, 10.0) if target.alive() else None
    cpu1, wall_s = cpu_s(pids), time.monotonic() - t0
    replies = answered(after) - answered(before)
    hist = histogram(after) - histogram(before)
    batches = sum(hist.values())
    used = {role: cpu1[role] - cpu0[role] for role in pids}
    per = (lambda s: s / replies * 1e6) if replies > 0 else (lambda s: float("nan"))
    return {
        "target": target.name,
        "rate": rate,
        "seed": seed,
        "gen": gen,
        "replies": replies,
        "batch_hist": {str(k): v for k, v in sorted(hist.items())},
        "mean_batch": sum(k * v for k, v in hist.items()) / batches if batches else None,
        "roles_us": {role: per(s) for role, s in used.items()},
        "server_us": per(sum(used.values())),
        "server_cores": sum(used.values()) / wall_s,
        "restarted": restarted or not target.alive(),
    }


def line(c: Mapping[str, Any]) -> str:
    g = c["gen"]
    p99 = "-" if g["p99_ms"] is None else f"{g['p99_ms']:.1f}"
    batch = "-" if c["mean_batch"] is None else f"{c['mean_batch']:.1f}"
    void = " VOID" if g["void"] else ""
    return (
        f"  {c['target']:<18} {c['rate']:>6g}/s  served {g['served_per_s']:7.0f}/s  "
        f"ok {100 * g['ok_share']:5.1f}%  p99 {p99:>7} ms  batch {batch:>4}  "
        f"server {c['server_us']:6.0f} us/req  gen {g['cores']:.2f} cores{void}"
    )


def order(names: Sequence[str], pass_index: int) -> list[str]:
    """The target order of a pass: rotated by one each pass."""
    k = pass_index % len(names)
    return [*names[k:], *names[:k]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    rates = [float(r) for r in args.rates.split(",")]
    model_path = mlp.ensure()
    old = next((n for n in names if n.startswith("carpool@")), None)
    cells: list[dict[str, Any]] = []
    started: list[targets.Target] = []
    with targets.revision_trees(names) as trees:
        try:
            for name in names:
                target = targets.make(name, model_path, trees)
                print(f"starting {name} ...", flush=True)
                target.start()
                started.append(target)
                print(f"  {name} at {target.endpoint}, pids {target.pids()}", flush=True)
                prime(target, args)
            by_name = {t.name: t for t in started}
            for p in range(args.passes):
                print(f"pass {p + 1} of {args.passes}", flush=True)
                for rate in rates:
                    for name in order(names, p):
                        if name == old and rate < args.old_from:
                            continue
                        c = cell(by_name[name], rate, seed=p + 1, args=args)
                        c["pass"] = p + 1
                        cells.append(c)
                        print(line(c), flush=True)
        finally:
            for target in started:
                target.stop()
    summary = report.summarise(cells)
    found = report.checks(summary, cells, "carpool-default", "carpool-fixed", "greedy", old)
    return {
        "commit": targets.commit_of("HEAD"),
        "old": {old: targets.commit_of(old.partition("@")[2])} if old else {},
        "model": {"path": str(model_path), "hidden": mlp.HIDDEN},
        "settings": {
            "rates": rates,
            "passes": args.passes,
            "seconds": args.seconds,
            "warmup_s": args.warmup_s,
            "prime_s": args.prime_s,
            "timeout_ms": args.timeout_ms,
            "old_from": args.old_from,
            "max_batch": targets.MAX_BATCH,
            "max_wait_ms": targets.MAX_WAIT_MS,
        },
        "restarts": {t.name: t.restarts for t in started},
        "cells": cells,
        "summary": {t: {str(r): row for r, row in rows.items()} for t, rows in summary.items()},
        "goodput": {t: report.goodput(rows) for t, rows in summary.items()},
        "ceiling": {t: report.ceiling(cells, t) for t in summary},
        "checks": [{"what": w, "held": ok, "figures": f} for w, ok, f in found],
        "table": report.markdown(summary, cells),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rates", default=DEFAULT_RATES, help=f"offered rates (default {DEFAULT_RATES})"
    )
    p.add_argument("--passes", type=int, default=3, help="passes over every rate and target")
    p.add_argument("--seconds", type=float, default=5.0, help="counted seconds per cell")
    p.add_argument("--warmup-s", type=float, default=1.0, help="uncounted seconds before them")
    p.add_argument("--timeout-ms", type=int, default=1000, help="each request's timeout")
    p.add_argument("--targets", default=DEFAULT_TARGETS, help=f"default {DEFAULT_TARGETS}")
    p.add_argument(
        "--old-from", type=float, default=2500, help="lowest rate of the carpool@REV target"
    )
    p.add_argument(
        "--prime-s", type=float, default=3.0, help="uncounted load on a fresh target (3 s)"
    )
    p.add_argument("--quick", action="store_true", help="2 rates, 1 pass, 2 s cells")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.passes, args.seconds, args.warmup_s = "1000,3000", 1, 2.0, 0.5
        args.prime_s = 1.0

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where SIGINT came ignored
    t0 = time.monotonic()
    try:
        data = run(args)
    except KeyboardInterrupt:
        print("interrupted: every target stopped, nothing written", file=sys.stderr)
        return 130
    data["elapsed_s"] = time.monotonic() - t0
    path = write_json("policy_live", data)
    passes = f"{args.passes} pass{'es' if args.passes != 1 else ''}"
    print(f"\nat commit {data['commit']}; {passes} of {args.seconds:g} s cells (medians, min-max)")
    print(data["table"])
    print("\nchecks:")
    for c in data["checks"]:
        print(f"  {'ok  ' if c['held'] else 'FAIL'} {c['what']}: {c['figures']}")
    print(f"\nwrote {path} in {data['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
