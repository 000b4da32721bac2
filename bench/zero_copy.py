"""Does the broker's cost per request stay flat as payloads grow from 1 KiB to 1 MiB?

Question: the broker forwards tensor frames without reading or copying them. If that
holds, its CPU time per request should barely depend on payload size. How does the
broker's CPU per request with 1 MiB payloads compare with 1 KiB payloads?

Method: a broker (``carpool broker --policy fixed --max-batch 1 --max-wait-ms 0``, so
every request is a batch of its own at both sizes), one worker process serving two
null-engine models, "small" (float32 [1, 256] = 1 KiB) and "large" (float32 [1, 262144] =
1 MiB) (``python bench/common.py workers``), and the plain pyzmq echo server, all as
processes. This process sends a fixed number of requests (2,000; 200 with --quick) with 4
in flight through ``carpool.client.Client`` and reads the broker's CPU time (psutil,
user + system, all its threads including zmq's I/O thread) before and after. The same
is done, as references, against the echo server and against a ``zmq.proxy`` relay in
front of it (raw DEALER, same frames; 10x as many small requests). The relay has the
broker's topology (each payload crosses four sockets of the relay's process: in from the
client, out to the echo, back in, back out) with no Python per message, so its ratio is
what the transport alone costs, and the broker's ratio can be read against it. psutil counts CPU
time in 10 ms ticks, so a full run's measurements span ~0.5 s of CPU or more; the
--quick numbers are coarse. Sizes and servers alternate within a
round; 5 rounds (2 with --quick); the table shows medians, the ratio is the median of
the per-round ratios large / small.

The same broker and worker also serve a second client made with
``Client(..., shared_memory=64 MiB)`` ("broker, shared-memory client"): its 1 MiB inputs
go through a /dev/shm region by reference (protocol §5.4), its 1 KiB ones in their frames
(below the 64 KiB threshold), as a user on the workers' host would run it. The worker
process's CPU per request is measured for both fleet configurations, so moving the cost
from the broker to the worker would show.

Note: the kernel copies every byte into and out of each socket (ipc and tcp alike); that
system time lands in the broker's process (zmq's I/O thread) and grows with the payload.
User time is what the broker's own code spends; the split is in the table.

Target: broker CPU per request, 1 MiB / 1 KiB <= 1.5.

Run:  .venv/bin/python bench/zero_copy.py            (about 2 minutes)
      .venv/bin/python bench/zero_copy.py --quick    (a smoke run, under a minute)
Writes bench/out/zero_copy.json and bench/out/zero_copy.png.
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
    LoopResult,
    ProcessGroup,
    SyntheticModel,
    dealer,
    median,
    parser,
    pyplot,
    quiet_logs,
    raw_loop,
    request_frames,
    save_plot,
    table,
    tensor,
    verdict,
    wait_echo,
    wait_workers,
    write_json,
)

from carpool.client import Client

TARGET = 1.5
IN_FLIGHT = 4
SIZES = {"small": 256, "large": 262_144}  # float32 items: 1 KiB and 1 MiB
LABEL = {"small": "1 KiB", "large": "1 MiB"}
SERVERS = ("broker", "shm", "broker-c", "shm-c", "relay", "echo")
NAMES = {
    "broker": "broker",
    "shm": "broker, shared-memory client",
    "broker-c": "broker, 64 B output",
    "shm-c": "broker, shared-memory client, 64 B output",
    "relay": "zmq.proxy relay",
    "echo": "echo server",
}
#: Configurations that run through the fleet (their worker's CPU is measured too):
#: which client, and whether the model answers with its input's size ("echo") or with
#: 16 float32 per sample, a classifier's shape ("-c").
FLEETS = ("broker", "shm", "broker-c", "shm-c")
CLASSES = 16
NO_BATCHING = ["--policy", "fixed", "--max-batch", "1", "--max-wait-ms", "0"]


def per_request(meter: CpuMeter, run: Any, worker: CpuMeter | None = None) -> dict[str, float]:
    """Run ``run()`` and return its rate and the process's CPU us per completed request
    (and the worker process's, when given)."""
    u0, s0 = meter.read()
    mu0, ms0 = meter.read_main()
    wu0, ws0 = worker.read() if worker is not None else (0.0, 0.0)
    t0 = time.perf_counter()
    result: LoopResult = run()
    wall = time.perf_counter() - t0
    u1, s1 = meter.read()
    mu1, ms1 = meter.read_main()
    wu1, ws1 = worker.read() if worker is not None else (0.0, 0.0)
    n = max(1, result.completed)
    if result.errors:
        print(f"  warning: {result.errors} requests failed")
    return {
        "worker_us": 1e6 * (wu1 - wu0 + ws1 - ws0) / n,
        "completed": result.completed,
        "errors": result.errors,
        "rate": result.rate,
        "wall_s": wall,
        "user_us": 1e6 * (u1 - u0) / n,
        "system_us": 1e6 * (s1 - s0) / n,
        "cpu_us": 1e6 * (u1 - u0 + s1 - s0) / n,
        "main_us": 1e6 * (mu1 - mu0 + ms1 - ms0) / n,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    quiet_logs()
    reps = args.reps or (2 if args.quick else 5)
    n = 200 if args.quick else 2000
    max_s = 15.0 if args.quick else 60.0  # per measurement, a bound only
    inputs = {name: tensor((1, d), seed=i) for i, (name, d) in enumerate(SIZES.items())}
    frames = {name: request_frames(name, x) for name, x in inputs.items()}
    models = [SyntheticModel(name, item_shape=(d,), max_batch=8) for name, d in SIZES.items()]
    models += [
        SyntheticModel(f"{name}-c", item_shape=(d,), max_batch=8, output_items=CLASSES)
        for name, d in SIZES.items()
    ]
    results: dict[tuple[str, str], list[dict[str, float]]] = {
        (server, size): [] for server in SERVERS for size in SIZES
    }
    with ProcessGroup(args.transport) as group:
        frontend, backend, echo_ep, relay_ep = (
            group.endpoint(n) for n in ("front", "back", "echo", "relay")
        )
        broker = group.broker(frontend, backend, *NO_BATCHING)
        worker = group.worker_host(backend, 1, models)
        echo = group.echo(echo_ep)
        relay = group.relay(relay_ep, echo_ep)
        wait_workers(frontend, 1, group)
        wait_echo(echo_ep, group)
        wait_echo(relay_ep, group)
        meters = {
            "broker": CpuMeter(broker.pid),
            "relay": CpuMeter(relay.pid),
            "echo": CpuMeter(echo.pid),
        }
        for fleet in FLEETS:
            meters[fleet] = meters["broker"]
        worker_meter = CpuMeter(worker.pid)
        # The shared-memory client sends 1 MiB inputs by reference (protocol §5.4) and
        # 1 KiB ones in their frames (below its 64 KiB threshold), as a user would.
        with (
            Client(frontend) as client,
            Client(frontend, shared_memory=64 << 20, shared_memory_outputs=True) as shm,
        ):
            clients = {"broker": client, "shm": shm, "broker-c": client, "shm-c": shm}
            for c in (client, shm):
                for name, x in inputs.items():
                    y = c.infer(name, {"x": x})["y"]
                    assert np.allclose(y, 2 * x + 1), f"the fleet gave a wrong answer for {name}"
                    y = c.infer(f"{name}-c", {"x": x})["y"]
                    assert np.allclose(y, 2 * x[:, :CLASSES] + 1), f"wrong answer: {name}-c"
            socks = {"relay": dealer(relay_ep), "echo": dealer(echo_ep)}
            try:
                for rnd in range(reps + 1):  # round 0 is the warm-up
                    count = n if rnd else max(20, n // 10)
                    for size in SIZES:
                        measured = {}
                        for fleet in FLEETS:
                            model = size + ("-c" if fleet.endswith("-c") else "")
                            loop = FleetLoop(clients[fleet], model, {"x": inputs[size]}, IN_FLIGHT)

                            def fleet_run(loop: FleetLoop = loop, count: int = count) -> LoopResult:
                                result = loop.run(count, max_s)
                                loop.drain()
                                return result

                            measured[fleet] = per_request(meters[fleet], fleet_run, worker_meter)
                        # The references spend ~10x less per small request: send 10x more
                        # so their CPU time stays well above psutil's 10 ms tick.
                        k = count * (10 if size == "small" else 1)
                        for server, sock in socks.items():
                            measured[server] = per_request(
                                meters[server],
                                lambda sock=sock, size=size, k=k: raw_loop(
                                    sock, frames[size], IN_FLIGHT, k, max_s
                                ),
                            )
                        if rnd:
                            for server, m in measured.items():
                                results[(server, size)].append(m)
                    if rnd:
                        print(f"round {rnd}/{reps} done")
            finally:
                for sock in socks.values():
                    sock.close()

    summary: dict[str, Any] = {}
    for (server, size), rounds in results.items():
        entry: dict[str, Any] = {
            m: median([r[m] for r in rounds])
            for m in ("rate", "user_us", "system_us", "cpu_us", "main_us", "worker_us")
        }
        entry["rounds"] = rounds
        summary[f"{server} {size}"] = entry
    ratios: dict[str, float] = {}
    for server in SERVERS:
        per_round = [
            big["cpu_us"] / small["cpu_us"] if small["cpu_us"] > 0 else float("nan")
            for big, small in zip(
                results[(server, "large")], results[(server, "small")], strict=True
            )
        ]
        ratios[server] = median(per_round)
        summary[f"{server} large"]["ratio_to_small"] = ratios[server]
        summary[f"{server} large"]["per_round_ratio"] = per_round
    main_ratios = {
        fleet: median(
            [
                big["main_us"] / small["main_us"] if small["main_us"] > 0 else float("nan")
                for big, small in zip(
                    results[(fleet, "large")], results[(fleet, "small")], strict=True
                )
            ]
        )
        for fleet in FLEETS
    }
    main_ratio = main_ratios["broker"]
    for fleet in FLEETS:
        summary[f"{fleet} large"]["main_ratio_to_small"] = main_ratios[fleet]
    rows = []
    for server, size in results:
        s = summary[f"{server} {size}"]
        rows.append(
            [
                NAMES[server],
                LABEL[size],
                s["rate"],
                s["rate"] * (4 * SIZES[size]) / 2**20,
                s["user_us"],
                s["system_us"],
                s["cpu_us"],
                f"{ratios[server]:.2f}" if size == "large" else "1",
                s["main_us"] if server in FLEETS else "",
                (f"{main_ratios[server]:.2f}" if size == "large" else "1")
                if server in FLEETS
                else "",
                s["worker_us"] if server in FLEETS else "",
            ]
        )
    print(
        f"\nCPU per request of the server process, {n} requests ({10 * n} small for the "
        f"references), {IN_FLIGHT} in flight, {args.transport}; median of {reps} rounds"
    )
    print(
        table(
            [
                "process",
                "payload",
                "req/s",
                "MiB/s",
                "user us",
                "sys us",
                "CPU us/req",
                "x 1 KiB",
                "main thread us/req",
                "x 1 KiB",
                "worker us/req",
            ],
            rows,
        )
    )
    extra = {
        server: summary[f"{server} large"]["cpu_us"] - summary[f"{server} small"]["cpu_us"]
        for server in SERVERS
    }
    print(
        "extra CPU per request at 1 MiB over 1 KiB: "
        + ", ".join(f"{NAMES[server]} {extra[server]:,.0f} us" for server in SERVERS)
    )
    ok = ratios["broker"] <= TARGET
    main_ok = main_ratio <= TARGET
    shm_ok = ratios["shm-c"] <= TARGET
    print(
        f"target broker CPU/request 1 MiB / 1 KiB <= {TARGET}: whole process "
        f"{ratios['broker']:.2f} {verdict(ok)} (zmq.proxy, same topology: "
        f"{ratios['relay']:.2f}); the broker's own thread {main_ratio:.2f} {verdict(main_ok)}; "
        f"with a shared-memory client {ratios['shm']:.2f}, and with a small output "
        f"{ratios['shm-c']:.2f} {verdict(shm_ok)} (plain client, small output: "
        f"{ratios['broker-c']:.2f})"
    )
    for fleet in FLEETS:
        small, large = summary[f"{fleet} small"], summary[f"{fleet} large"]
        print(
            f"  {NAMES[fleet]}: broker + worker CPU per request "
            f"{small['cpu_us'] + small['worker_us']:,.0f} us (1 KiB), "
            f"{large['cpu_us'] + large['worker_us']:,.0f} us (1 MiB)"
        )
    write_json(
        "zero_copy",
        {
            "question": "broker CPU per request, 1 MiB vs 1 KiB payloads",
            "transport": args.transport,
            "quick": args.quick,
            "rounds": reps,
            "requests_per_round": n,
            "in_flight": IN_FLIGHT,
            "target": f"broker CPU/request 1 MiB / 1 KiB <= {TARGET}",
            "pass": ok,
            "pass_main_thread": main_ok,
            "pass_shared_memory": shm_ok,
            "ratio": ratios,
            "main_thread_ratio": main_ratio,
            "main_thread_ratios": main_ratios,
            "extra_us_per_mib_request": extra,
            "results": summary,
        },
    )
    plot(summary, reps)
    return 0


def plot(summary: dict[str, Any], reps: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(15, 5))
    keys = list(summary)
    names = [f"{NAMES[k.split()[0]]}\n{LABEL[k.split()[1]]}".replace(", ", "\n") for k in keys]
    ax.tick_params(axis="x", labelsize=7)
    user = [summary[k]["user_us"] for k in keys]
    system = [summary[k]["system_us"] for k in keys]
    ax.bar(names, user, label="user")
    ax.bar(names, system, bottom=user, label="system")
    small = summary["broker small"]["cpu_us"]
    ax.axhline(TARGET * small, color="k", linestyle=":", label=f"target: {TARGET} x broker 1 KiB")
    ax.set_ylabel("CPU us per request (median)")
    ax.set_title(f"server CPU per request by payload size ({reps} rounds)")
    ax.legend(fontsize=8)
    save_plot(fig, "zero_copy")


if __name__ == "__main__":
    sys.exit(main())
