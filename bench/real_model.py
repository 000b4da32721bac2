"""What does the fleet deliver on a real model on the CPU, with one and with two workers?

Question: for the embedded orientation classifier (ONNX, [B, 3, 224, 224] float32, ONNX
Runtime on the CPU with one intra-op thread per worker), what throughput and latency does
the fleet give with one worker and with two, and how does that compare with calling the
engine directly in this process?

Method: two fleets run side by side as processes, each a broker (``carpool broker``,
default batching policy) with one, resp. two, ``carpool worker --model orientation``
workers. This process drives each in turn with a closed loop of 4 requests in flight
(``carpool.client.Client.submit`` / ``poll``; one image per request, a new one sent as
soon as one returns) for 4 s (1.5 s with --quick), timing every request. As a
reference, ``OnnxRuntimeEngine(locate("orientation"), intra_op_threads=1).run`` is timed
in this process at batch 1 and batch 8 for 1 s each (0.5 s with --quick), while the fleets
are idle. Before measuring, the fleets' answer for one image is checked against the
direct call. The one-worker fleet is driven twice: by a plain client, and by one made with
``Client(shared_memory=16 MiB, shared_memory_outputs=True)``, whose 602 KB images go
through /dev/shm by reference (protocol §5.4), as a camera process on the workers' host
would send them. Configurations alternate; 5 rounds (2 with --quick); the table shows
medians. Batch sizes come from the brokers' STATS.
Note: on a 2-core machine the client, the broker and two workers share two cores, so
two workers cannot double the throughput here; the CPU column shows the client's and the
broker's share.

Target: none fixed; the numbers to read are fleet (1 worker) / direct at batch 1 (the
fleet's efficiency) and 2 workers / 1 worker (scaling).

Run:  .venv/bin/python bench/real_model.py            (about a minute)
      .venv/bin/python bench/real_model.py --quick    (a smoke run, under a minute)
Writes bench/out/real_model.json and bench/out/real_model.png.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
from common import (
    CpuMeter,
    FleetLoop,
    ProcessGroup,
    median,
    parser,
    pct,
    pyplot,
    quiet_logs,
    save_plot,
    table,
    tensor,
    wait_workers,
    write_json,
)

from carpool.client import Client
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.models import locate

MODEL = "orientation"
IN_FLIGHT = 4
WORKERS = (1, 2)
DIRECT_BATCHES = (1, 8)
#: (label, workers, shared memory): the one-worker fleet also serves a client that sends
#: its images through /dev/shm (protocol §5.4), as a camera process on the same host would.
CONFIGS = (("1 worker", 1, False), ("1 worker, shared memory", 1, True), ("2 workers", 2, False))
SHM = {"shared_memory": 16 << 20, "shared_memory_outputs": True}


def direct(engine: OnnxRuntimeEngine, x: Any, batch: int, duration_s: float) -> dict[str, float]:
    """Samples per second of back-to-back engine calls at one batch size."""
    name = engine.info.io.inputs[0].name
    xb = {name: np.ascontiguousarray(np.repeat(x, batch, axis=0))}
    engine.run(xb)
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s and len(times) < 100_000:
        t0 = time.perf_counter()
        engine.run(xb)
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    return {
        "samples_per_s": batch * len(times) / wall,
        "p50_ms": 1000 * pct(times, 50),
        "p99_ms": 1000 * pct(times, 99),
    }


def batch_sizes(client: Client) -> Counter[int]:
    sizes = client.stats()["batch_sizes"].get(MODEL, {})
    return Counter({int(k): int(v) for k, v in sizes.items()})


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    quiet_logs()
    reps = args.reps or (2 if args.quick else 5)
    fleet_s = 1.5 if args.quick else 4.0
    direct_s = 0.5 if args.quick else 1.0
    x = tensor((1, 3, 224, 224))
    engine = OnnxRuntimeEngine(locate(MODEL), max_batch=8, intra_op_threads=1)
    expected = engine.run({engine.info.io.inputs[0].name: x})
    out_name = engine.info.io.outputs[0].name
    fleet_rounds: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in CONFIGS}
    direct_rounds: dict[int, list[dict[str, float]]] = {b: [] for b in DIRECT_BATCHES}
    me = CpuMeter()
    with ProcessGroup(args.transport) as group:
        fleets: dict[int, tuple[str, CpuMeter]] = {}
        for count in WORKERS:
            frontend, backend = group.endpoint(f"front{count}"), group.endpoint(f"back{count}")
            broker = group.broker(frontend, backend)
            for _ in range(count):
                group.worker(backend, "--model", MODEL, "--threads", "1")
            fleets[count] = (frontend, CpuMeter(broker.pid))
        for count, (frontend, _) in fleets.items():
            wait_workers(frontend, count, group)
        for rnd in range(reps + 1):  # round 0 is the warm-up
            for label, count, shared in CONFIGS:
                frontend, broker_cpu = fleets[count]
                with Client(frontend, **(SHM if shared else {})) as client:  # type: ignore[arg-type]
                    if rnd == 0:
                        got = client.infer(MODEL, {"x": x})[out_name]
                        assert np.allclose(got, expected[out_name], atol=1e-4), "wrong answer"
                    sizes0 = batch_sizes(client)
                    cpu0 = sum(me.read()), sum(broker_cpu.read())
                    t0 = time.perf_counter()
                    loop = FleetLoop(client, MODEL, {"x": x}, IN_FLIGHT, latencies=True)
                    result = loop.run(100_000, fleet_s if rnd else fleet_s / 3)
                    loop.drain()
                    wall = time.perf_counter() - t0
                    cpu1 = sum(me.read()), sum(broker_cpu.read())
                    sizes = batch_sizes(client) - sizes0
                if result.errors:
                    print(f"  warning: {result.errors} requests failed")
                if rnd:
                    batches = sum(sizes.values())
                    fleet_rounds[label].append(
                        {
                            "completed": result.completed,
                            "errors": result.errors,
                            "rate": result.rate,
                            "p50_ms": 1000 * pct(result.latencies_s, 50),
                            "p99_ms": 1000 * pct(result.latencies_s, 99),
                            "mean_batch": sum(k * v for k, v in sizes.items()) / max(1, batches),
                            "client_cpu": (cpu1[0] - cpu0[0]) / wall,
                            "broker_cpu": (cpu1[1] - cpu0[1]) / wall,
                        }
                    )
            for b in DIRECT_BATCHES:
                d = direct(engine, x, b, direct_s if rnd else direct_s / 3)
                if rnd:
                    direct_rounds[b].append(d)
            if rnd:
                print(f"round {rnd}/{reps} done")
    engine.close()

    fleet = {
        label: {
            m: median([r[m] for r in fleet_rounds[label]])
            for m in ("rate", "p50_ms", "p99_ms", "mean_batch", "client_cpu", "broker_cpu")
        }
        for label, _, _ in CONFIGS
    }
    base = {
        b: {m: median([r[m] for r in direct_rounds[b]]) for m in direct_rounds[b][0]}
        for b in DIRECT_BATCHES
    }
    ref = base[1]["samples_per_s"]
    rows: list[list[object]] = [
        [
            f"direct, batch {b}",
            base[b]["samples_per_s"],
            "-",
            base[b]["p50_ms"],
            base[b]["p99_ms"],
            float(b),
            "-",
            f"{base[b]['samples_per_s'] / ref:.2f}",
        ]
        for b in DIRECT_BATCHES
    ]
    rows += [
        [
            f"fleet, {label}",
            fleet[label]["rate"],
            f"{IN_FLIGHT}",
            fleet[label]["p50_ms"],
            fleet[label]["p99_ms"],
            fleet[label]["mean_batch"],
            f"{100 * fleet[label]['client_cpu']:.0f}% / {100 * fleet[label]['broker_cpu']:.0f}%",
            f"{fleet[label]['rate'] / ref:.2f}",
        ]
        for label, _, _ in CONFIGS
    ]
    print(
        f"\norientation classifier, [1, 3, 224, 224] float32 per request, ONNX Runtime CPU, "
        f"1 thread per engine, {args.transport}; median of {reps} rounds"
    )
    print(
        table(
            [
                "configuration",
                "images/s",
                "in flight",
                "p50 ms",
                "p99 ms",
                "mean batch",
                "client/broker CPU",
                "x direct b1",
            ],
            rows,
        )
    )
    one = fleet["1 worker"]
    efficiency = one["rate"] / ref
    scaling = fleet["2 workers"]["rate"] / one["rate"]
    shm = fleet["1 worker, shared memory"]
    shm_rate, shm_p50 = shm["rate"] / one["rate"], shm["p50_ms"] / one["p50_ms"]
    print(f"fleet with 1 worker / direct at batch 1: {efficiency:.2f}")
    print(f"fleet with 2 workers / 1 worker: {scaling:.2f}")
    print(f"1 worker, shared memory / sockets: rate {shm_rate:.2f}, p50 {shm_p50:.2f}")
    write_json(
        "real_model",
        {
            "question": "orientation classifier: fleet with 1 and 2 workers vs direct calls",
            "transport": args.transport,
            "quick": args.quick,
            "rounds": reps,
            "in_flight": IN_FLIGHT,
            "fleet": fleet,
            "direct": base,
            "efficiency_1_worker": efficiency,
            "scaling_2_over_1": scaling,
            "shared_memory_over_sockets": {"rate": shm_rate, "p50": shm_p50},
            "fleet_rounds": fleet_rounds,
            "direct_rounds": direct_rounds,
        },
    )
    plot(fleet, base, reps)
    return 0


def plot(fleet: dict[str, dict[str, float]], base: dict[int, dict[str, float]], reps: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names = [c[0] for c in CONFIGS]
    short = [n.replace(", shared memory", "\nshm").replace(" worker", "w") for n in names]
    labels = [f"direct b{b}" for b in DIRECT_BATCHES] + [f"fleet {n}" for n in short]
    rates = [base[b]["samples_per_s"] for b in DIRECT_BATCHES] + [fleet[n]["rate"] for n in names]
    colors = ["tab:gray"] * len(DIRECT_BATCHES) + ["tab:blue"] * len(names)
    axes[0].bar(labels, rates, color=colors)
    axes[0].tick_params(axis="x", labelsize=7)
    axes[0].set_ylabel("images / s (median)")
    axes[0].set_title("throughput")
    xs = np.arange(len(names))
    axes[1].bar(xs - 0.2, [fleet[n]["p50_ms"] for n in names], 0.4, label="p50")
    axes[1].bar(xs + 0.2, [fleet[n]["p99_ms"] for n in names], 0.4, label="p99")
    axes[1].set_xticks(xs, short, fontsize=7)
    axes[1].set_ylabel(f"latency ms ({IN_FLIGHT} in flight)")
    axes[1].set_title("fleet latency")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"orientation classifier on the CPU ({reps} rounds)")
    save_plot(fig, "real_model")


if __name__ == "__main__":
    sys.exit(main())
