"""How many requests per second can the broker pass, against a plain pyzmq echo?

Question: with an engine that costs nothing, what rate does a broker + one worker reach,
and how does it compare with the cheapest possible round trip on the same machine: a
plain pyzmq ROUTER that echoes every message (no broker logic, one hop instead of two)?

Method: three processes stay up for the whole run: a broker (``carpool broker``), one
null-engine worker (``carpool worker --synthetic 0 0``, so a batch costs nothing) and the
echo server (``python bench/common.py echo``). This process drives each of them with the
same closed loop: a fixed number of requests in flight (8 and 64), a new one sent as soon
as a reply comes back, 64-byte float32 [1, 16] payloads.

* fleet (Client): ``carpool.client.Client.submit`` / ``poll`` against the broker;
* fleet (raw DEALER): the same request frames, encoded once, sent on a bare DEALER (no
  SDK cost per request), to show how much of the rate the client library takes;
* echo (raw DEALER): the same frames on a bare DEALER against the echo server;
* local link (Client / raw DEALER): the same against a broker whose null-engine worker
  (a process) connects over the broker's local endpoint, a unix stream socket
  (``carpool broker --local unix:PATH``, ``carpool worker --broker unix:PATH``) instead
  of ZeroMQ;
* embedded (Client / raw DEALER): the same against a second broker that runs its
  null-engine worker inside its own process (``carpool broker --embed-synthetic 0 0``):
  no worker process, no hops between broker and worker;
* bare relays (raw DEALER): the same frames through ``bench/common.py bare-broker`` and
  ``bare-worker``, the echo server's loop as a broker and as a worker (each request
  forwarded alone, no batching): the fleet's three processes and four hops with no
  carpool code, the floor of that topology in Python on this machine.

Each configuration runs for a fixed time (bounded in requests too) after a warm-up; the
configurations alternate and the whole round is repeated (5 times; 2 with --quick); the
table shows medians. The ratio is the median of the per-round ratios fleet / echo (each
round's two numbers were measured back to back). CPU columns are the share of one core
that each process used during the measurement (psutil, user + system).
Note: on a 2-core machine the fleet's three busy processes (client, broker, worker) share
two cores, the echo's two do not; the CPU columns show where the time went. "CPU us/req"
adds up every process's CPU (this client's included) per request: with the cores used
alike (they are: ~1.5-1.6 of 2 at 64 in flight, fleet and echo), the ratio to the echo
is about the echo's figure divided by the configuration's.

Target: fleet (Client) >= 0.5 x echo, at each in-flight count.

Run:  .venv/bin/python bench/broker_ceiling.py            (about 1.5 minutes)
      .venv/bin/python bench/broker_ceiling.py --in-flight 64 --reps 4   (one depth)
      .venv/bin/python bench/broker_ceiling.py --quick    (a smoke run, under a minute)
      .venv/bin/python bench/broker_ceiling.py --max-batch 16   (the carpool brokers' B_max;
          default the broker's own, 8: batches of at most 8 at 64 in flight)
Writes bench/out/broker_ceiling.json and bench/out/broker_ceiling.png.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from common import (
    CpuMeter,
    FleetLoop,
    LoopResult,
    ProcessGroup,
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
from carpool.common.protocol import Command

TARGET = 0.5
IN_FLIGHT = (8, 64)
CONFIGS = (
    "echo (raw DEALER)",
    "fleet (raw DEALER)",
    "fleet (Client)",
    "local link (raw DEALER)",
    "local link (Client)",
    "embedded (raw DEALER)",
    "embedded (Client)",
    "bare relays (raw DEALER)",
)
MODEL = "synthetic"


Run = Callable[[int, int, float], LoopResult]  # (in flight, max requests, max seconds)


def measure(
    run: Run, in_flight: int, meters: dict[str, CpuMeter], duration_s: float
) -> dict[str, Any]:
    """One timed run of a loop, with the CPU share of each process over it."""
    before = {name: sum(m.read()) for name, m in meters.items()}
    t0 = time.perf_counter()
    result = run(in_flight, 10_000_000, duration_s)
    wall = time.perf_counter() - t0
    cpu = {name: (sum(m.read()) - before[name]) / wall for name, m in meters.items()}
    if result.errors:
        print(f"  warning: {result.errors} requests failed")
    return {"rate": result.rate, "completed": result.completed, "errors": result.errors, **cpu}


def share(rounds: list[dict[str, Any]], key: str) -> str:
    """Median CPU share of one process over the rounds, as a percentage of one core."""
    if key not in rounds[0]:
        return "-"
    return f"{100 * median([r[key] for r in rounds]):.0f}%"


def cpu_per_request(rounds: list[dict[str, Any]]) -> str:
    """Median CPU time of all the processes together (client included) per request, in
    us: on two shared cores the rate follows it (ratio ~ echo's / this, at equal use)."""
    per = [
        1e6 * sum(v for k, v in r.items() if k.endswith("_cpu")) / r["rate"]
        for r in rounds
        if r["rate"] > 0
    ]
    return f"{median(per):.0f}" if per else "-"


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--in-flight", type=int, nargs="+", default=list(IN_FLIGHT), help="depths (8 64)"
    )
    p.add_argument(
        "--max-batch",
        type=int,
        help="the carpool brokers' B_max (default: the broker's own, 8)",
    )
    p.add_argument(
        "--slots",
        type=int,
        help="the worker processes' slots, batches outstanding at once (default: theirs, 2)",
    )
    args = p.parse_args(argv)
    in_flight = tuple(args.in_flight)
    bmax = () if args.max_batch is None else ("--max-batch", str(args.max_batch))
    null = ("--synthetic", "0", "0", *(() if args.slots is None else ("--slots", str(args.slots))))
    quiet_logs()
    reps = args.reps or (2 if args.quick else 5)
    duration_s = 0.6 if args.quick else 2.0
    warmup_s = 0.2 if args.quick else 0.5
    x = tensor((1, 16))
    frames = request_frames(MODEL, x, timeout_s=10.0)
    # samples[(config, in_flight)] = one dict per round
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {
        (c, k): [] for c in CONFIGS for k in in_flight
    }
    with ProcessGroup(args.transport) as group:
        frontend, backend, echo_ep = (group.endpoint(n) for n in ("front", "back", "echo"))
        broker = group.broker(frontend, backend, *bmax)
        worker = group.worker(backend, *null)
        echo = group.echo(echo_ep)
        link_front, link_back = group.endpoint("link-front"), group.endpoint("link-back")
        link_broker = group.broker(
            link_front, link_back, "--local", f"unix:{group.tmp}/local", *bmax
        )
        link_worker = group.worker(f"unix:{group.tmp}/local", *null)
        emb_front, emb_back = group.endpoint("emb-front"), group.endpoint("emb-back")
        embedded = group.broker(emb_front, emb_back, "--embed-synthetic", "0", "0", *bmax)
        bare_front, bare_back = group.endpoint("bare-front"), group.endpoint("bare-back")
        bare_broker, bare_worker = group.bare_fleet(bare_front, bare_back)
        wait_workers(frontend, 1, group)
        wait_workers(emb_front, 1, group)
        wait_workers(link_front, 1, group)
        wait_echo(echo_ep, group)
        wait_echo(bare_front, group)
        me = CpuMeter()
        fleet_meters = {
            "client_cpu": me,
            "broker_cpu": CpuMeter(broker.pid),
            "worker_cpu": CpuMeter(worker.pid),
        }
        echo_meters = {"client_cpu": me, "server_cpu": CpuMeter(echo.pid)}
        embedded_meters = {"client_cpu": me, "broker_cpu": CpuMeter(embedded.pid)}
        link_meters = {
            "client_cpu": me,
            "broker_cpu": CpuMeter(link_broker.pid),
            "worker_cpu": CpuMeter(link_worker.pid),
        }
        bare_meters = {
            "client_cpu": me,
            "broker_cpu": CpuMeter(bare_broker.pid),
            "worker_cpu": CpuMeter(bare_worker.pid),
        }
        with (
            Client(frontend) as client,
            Client(emb_front) as emb_client,
            Client(link_front) as link_client,
        ):
            for c in (client, emb_client, link_client):
                y = c.infer(MODEL, {"x": x})["y"]
                assert np.allclose(y, 2 * x + 1), "the fleet gave a wrong answer"
            fleet_raw = dealer(frontend)
            link_raw = dealer(link_front)
            emb_raw = dealer(emb_front)
            echo_raw = dealer(echo_ep)
            bare_raw = dealer(bare_front)
            try:
                runs: dict[str, Run] = {}

                def client_run(c: Client) -> Run:
                    def run(k: int, n: int, s: float) -> LoopResult:
                        loop = FleetLoop(c, MODEL, {"x": x}, k)
                        result = loop.run(n, s)
                        loop.drain()
                        return result

                    return run

                runs["fleet (Client)"] = client_run(client)
                runs["embedded (Client)"] = client_run(emb_client)
                runs["local link (Client)"] = client_run(link_client)
                runs["local link (raw DEALER)"] = lambda k, n, s: raw_loop(
                    link_raw, frames, k, n, s, expect_command=Command.REPLY
                )
                runs["fleet (raw DEALER)"] = lambda k, n, s: raw_loop(
                    fleet_raw, frames, k, n, s, expect_command=Command.REPLY
                )
                runs["embedded (raw DEALER)"] = lambda k, n, s: raw_loop(
                    emb_raw, frames, k, n, s, expect_command=Command.REPLY
                )
                runs["echo (raw DEALER)"] = lambda k, n, s: raw_loop(echo_raw, frames, k, n, s)
                runs["bare relays (raw DEALER)"] = lambda k, n, s: raw_loop(
                    bare_raw, frames, k, n, s, expect_command=Command.REPLY
                )
                for rnd in range(reps + 1):  # round 0 is the warm-up
                    for k in in_flight:
                        for config in CONFIGS:
                            meters = (
                                echo_meters
                                if config.startswith("echo")
                                else embedded_meters
                                if config.startswith("embedded")
                                else bare_meters
                                if config.startswith("bare")
                                else link_meters
                                if config.startswith("local")
                                else fleet_meters
                            )
                            m = measure(
                                runs[config], k, meters, warmup_s if rnd == 0 else duration_s
                            )
                            if rnd:
                                samples[(config, k)].append(m)
                    if rnd:
                        print(f"round {rnd}/{reps} done")
            finally:
                fleet_raw.close()
                link_raw.close()
                emb_raw.close()
                echo_raw.close()
                bare_raw.close()

    rows = []
    summary: dict[str, Any] = {}
    for k in in_flight:
        echo_rates = [s["rate"] for s in samples[("echo (raw DEALER)", k)]]
        for config in CONFIGS:
            ss = samples[(config, k)]
            rates = [s["rate"] for s in ss]
            ratios = [r / e for r, e in zip(rates, echo_rates, strict=True)]
            entry = {
                "median_rate": median(rates),
                "ratio_to_echo": median(ratios),
                "rounds": ss,
            }
            summary[f"{config} @ {k}"] = entry
            rows.append(
                [
                    config,
                    k,
                    median(rates),
                    f"{min(rates):,.0f}..{max(rates):,.0f}",
                    f"{median(ratios):.3f}",
                    share(ss, "client_cpu"),
                    share(ss, "server_cpu" if config.startswith("echo") else "broker_cpu"),
                    share(ss, "worker_cpu"),
                    cpu_per_request(ss),
                ]
            )
    print(
        f"\nRequests/s, closed loop, 64-byte payloads, {args.transport}, B_max "
        f"{args.max_batch or 'default (8)'}; median of {reps} rounds (range in the next column)"
    )
    print(
        table(
            [
                "configuration",
                "in flight",
                "req/s",
                "range",
                "x echo",
                "client CPU",
                "broker/echo CPU",
                "worker CPU",
                "CPU us/req",
            ],
            rows,
        )
    )
    checks = {k: summary[f"fleet (Client) @ {k}"]["ratio_to_echo"] >= TARGET for k in in_flight}
    for k, ok in checks.items():
        ratio = summary[f"fleet (Client) @ {k}"]["ratio_to_echo"]
        emb = summary[f"embedded (Client) @ {k}"]["ratio_to_echo"]
        bare = summary[f"bare relays (raw DEALER) @ {k}"]["ratio_to_echo"]
        local = summary[f"local link (Client) @ {k}"]["ratio_to_echo"]
        print(
            f"target fleet (Client) >= {TARGET} x echo at {k} in flight: {ratio:.3f} {verdict(ok)}"
            f"; with the worker on the local link: {local:.3f} {verdict(local >= TARGET)}"
            f"; with the worker embedded in the broker: {emb:.3f} {verdict(emb >= TARGET)}"
            f"; the bare relays: {bare:.3f}"
        )
    write_json(
        "broker_ceiling",
        {
            "question": "broker + null worker requests/s vs a plain pyzmq echo",
            "transport": args.transport,
            "quick": args.quick,
            "rounds": reps,
            "duration_s": duration_s,
            "in_flight": list(in_flight),
            "max_batch": args.max_batch,
            "payload": "float32 [1, 16] (64 bytes)",
            "target": f"fleet (Client) >= {TARGET} x echo",
            "pass": all(checks.values()),
            "pass_local_link": all(
                summary[f"local link (Client) @ {k}"]["ratio_to_echo"] >= TARGET for k in in_flight
            ),
            "pass_embedded": all(
                summary[f"embedded (Client) @ {k}"]["ratio_to_echo"] >= TARGET for k in in_flight
            ),
            "results": summary,
        },
    )
    plot(summary, reps, in_flight)
    return 0


def plot(summary: dict[str, Any], reps: int, in_flight: tuple[int, ...] = IN_FLIGHT) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(CONFIGS)
    xs = np.arange(len(in_flight))
    mid = (len(CONFIGS) - 1) / 2
    for i, config in enumerate(CONFIGS):
        rates = [summary[f"{config} @ {k}"]["median_rate"] for k in in_flight]
        ax.bar(xs + (i - mid) * width, rates, width, label=config)
    for j, k in enumerate(in_flight):
        echo = summary[f"echo (raw DEALER) @ {k}"]["median_rate"]
        half = (mid + 0.5) * width
        ax.hlines(TARGET * echo, j - half, j + half, colors="k", linestyles=":")
    ax.set_xticks(xs, [f"{k} in flight" for k in in_flight])
    ax.set_ylabel("requests / s (median)")
    ax.set_title(f"broker ceiling vs plain echo (dotted: target {TARGET} x echo), {reps} rounds")
    ax.legend(fontsize=8)
    save_plot(fig, "broker_ceiling")


if __name__ == "__main__":
    sys.exit(main())
