"""How much latency does the fleet add at low load?

Question: with one request in flight at a time, what is the round trip through client ->
broker -> worker -> broker -> client, against the cheapest round trip on the same machine
(a plain pyzmq ROUTER echo) and against calling the engine in-process?

Method: a broker, one null-engine worker (``carpool worker --synthetic 0 0``) and the
echo server (``python bench/common.py echo``) run as processes for the whole run. This
process sends requests one at a time (the next only after the reply) with 64-byte float32
[1, 16] payloads and times each round trip (``time.perf_counter``):

* in-process engine: ``SyntheticEngine().run({"x": x})`` called directly (no sockets);
* echo (raw DEALER): the request frames on a bare DEALER to the echo server;
* fleet (raw DEALER): the same frames, encoded once, to the broker (no SDK cost);
* local link (raw DEALER / Client): the same against a broker whose worker connects
  over its local endpoint, a unix stream socket (``carpool broker --local unix:PATH``,
  ``carpool worker --broker unix:PATH``; carpool.common.link) instead of ZeroMQ;
* embedded (raw DEALER / Client): the same against a second broker that runs its
  null-engine worker inside its own process (``carpool broker --embed-synthetic 0 0``);
* fleet (Client): ``carpool.client.Client.submit`` then ``poll`` until the reply, one
  request at a time, as ``Client.infer`` does (encode, send, wait, decode);
* bare relays (raw DEALER): the same frames through ``bench/common.py bare-broker`` and
  ``bare-worker``, the echo server's loop as a broker and as a worker: the fleet's three
  processes and four hops with no carpool code (no validation, batching, deadlines or
  errors), the floor of that topology in Python on this machine;
* bare relays, unix link (raw DEALER): the same two processes with a unix stream socket
  between them instead of the backend ROUTER/DEALER: what the broker-worker hops cost
  outside libzmq's I/O threads.

The configurations alternate within a round of 3,000 requests each (300 with --quick)
after a warm-up; the round is repeated 5 times (2 with --quick). The table shows the
median over the rounds of each round's p50 and p99.

Target: fleet (Client) p50 <= 3 x echo p50 (the p99 ratio is reported too).

Run:  .venv/bin/python bench/added_latency.py            (about a minute)
      .venv/bin/python bench/added_latency.py --quick    (a smoke run, under a minute)
Writes bench/out/added_latency.json and bench/out/added_latency.png.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from common import (
    FleetLoop,
    ProcessGroup,
    dealer,
    median,
    parser,
    pct,
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
from carpool.worker.engines.synthetic import SyntheticEngine

TARGET = 3.0
MODEL = "synthetic"
CONFIGS = (
    "in-process engine",
    "echo (raw DEALER)",
    "fleet (raw DEALER)",
    "fleet (Client)",
    "local link (raw DEALER)",
    "local link (Client)",
    "embedded (raw DEALER)",
    "embedded (Client)",
    "bare relays (raw DEALER)",
    "bare relays, unix link (raw DEALER)",
)


def in_process(engine: SyntheticEngine, x: Any, n: int, max_s: float) -> list[float]:
    out = []
    until = time.perf_counter() + max_s
    inputs = {"x": x}
    for _ in range(n):
        t0 = time.perf_counter()
        engine.run(inputs)
        t1 = time.perf_counter()
        out.append(t1 - t0)
        if t1 > until:
            break
    engine.batches.clear()  # the engine keeps a record of every batch; keep memory flat
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    quiet_logs()
    reps = args.reps or (2 if args.quick else 5)
    n = 300 if args.quick else 3000
    max_s = 10.0 if args.quick else 30.0  # per configuration and round, a bound only
    x = tensor((1, 16))
    frames = request_frames(MODEL, x, timeout_s=10.0)
    engine = SyntheticEngine()
    latencies: dict[str, list[list[float]]] = {c: [] for c in CONFIGS}
    with ProcessGroup(args.transport) as group:
        frontend, backend, echo_ep = (group.endpoint(n) for n in ("front", "back", "echo"))
        group.broker(frontend, backend)
        group.worker(backend, "--synthetic", "0", "0")
        link_front, link_back = group.endpoint("link-front"), group.endpoint("link-back")
        group.broker(link_front, link_back, "--local", f"unix:{group.tmp}/local-link")
        group.worker(f"unix:{group.tmp}/local-link", "--synthetic", "0", "0")
        emb_front, emb_back = group.endpoint("emb-front"), group.endpoint("emb-back")
        group.broker(emb_front, emb_back, "--embed-synthetic", "0", "0")
        wait_workers(emb_front, 1, group)
        group.echo(echo_ep)
        bare_front, bare_back = group.endpoint("bare-front"), group.endpoint("bare-back")
        group.bare_fleet(bare_front, bare_back)
        unix_front = group.endpoint("unix-front")
        group.bare_fleet(unix_front, f"unix:{group.tmp}/bare-link")
        wait_workers(frontend, 1, group)
        wait_workers(link_front, 1, group)
        wait_echo(echo_ep, group)
        wait_echo(bare_front, group)
        wait_echo(unix_front, group)
        with (
            Client(frontend) as client,
            Client(emb_front) as emb_client,
            Client(link_front) as link_client,
        ):
            y = link_client.infer(MODEL, {"x": x})["y"]
            assert np.allclose(y, 2 * x + 1), "the fleet over a local link gave a wrong answer"
            link_raw = dealer(link_front)
            link_loop = FleetLoop(link_client, MODEL, {"x": x}, 1, latencies=True)
            y = emb_client.infer(MODEL, {"x": x})["y"]
            assert np.allclose(y, 2 * x + 1), "the embedded fleet gave a wrong answer"
            emb_raw = dealer(emb_front)
            emb_loop = FleetLoop(emb_client, MODEL, {"x": x}, 1, latencies=True)
            y = client.infer(MODEL, {"x": x})["y"]
            assert np.allclose(y, 2 * x + 1), "the fleet gave a wrong answer"
            fleet_raw = dealer(frontend)
            echo_raw = dealer(echo_ep)
            bare_raw = dealer(bare_front)
            unix_raw = dealer(unix_front)
            loop = FleetLoop(client, MODEL, {"x": x}, 1, latencies=True)
            try:

                def replies(sock: Any) -> Callable[[int], list[float]]:
                    """One in flight on a raw DEALER; a reply that is not a REPLY fails."""
                    return lambda k: (
                        raw_loop(
                            sock, frames, 1, k, max_s, expect_command=Command.REPLY, latencies=True
                        ).latencies_s
                    )

                runs: dict[str, Callable[[int], list[float]]] = {
                    "in-process engine": lambda k: in_process(engine, x, k, max_s),
                    "echo (raw DEALER)": lambda k: (
                        raw_loop(echo_raw, frames, 1, k, max_s, latencies=True).latencies_s
                    ),
                    "fleet (raw DEALER)": replies(fleet_raw),
                    "fleet (Client)": lambda k: loop.run(k, max_s).latencies_s,
                    "local link (raw DEALER)": replies(link_raw),
                    "local link (Client)": lambda k: link_loop.run(k, max_s).latencies_s,
                    "embedded (raw DEALER)": replies(emb_raw),
                    "embedded (Client)": lambda k: emb_loop.run(k, max_s).latencies_s,
                    "bare relays (raw DEALER)": replies(bare_raw),
                    "bare relays, unix link (raw DEALER)": replies(unix_raw),
                }
                for rnd in range(reps + 1):  # round 0 is the warm-up
                    for config in CONFIGS:
                        lat = runs[config](n if rnd else n // 5)
                        if rnd:
                            latencies[config].append(lat)
                    if rnd:
                        print(f"round {rnd}/{reps} done")
            finally:
                fleet_raw.close()
                link_raw.close()
                emb_raw.close()
                echo_raw.close()
                bare_raw.close()
                unix_raw.close()

    summary: dict[str, Any] = {}
    for config in CONFIGS:
        rounds = latencies[config]
        summary[config] = {
            "p50_us": median([1e6 * pct(r, 50) for r in rounds]),
            "p99_us": median([1e6 * pct(r, 99) for r in rounds]),
            "mean_us": median([1e6 * float(np.mean(r)) for r in rounds]),
            "per_round_p50_us": [1e6 * pct(r, 50) for r in rounds],
            "per_round_p99_us": [1e6 * pct(r, 99) for r in rounds],
            "requests_per_round": [len(r) for r in rounds],
        }
    echo = summary["echo (raw DEALER)"]
    for entry in summary.values():
        entry["p50_x_echo"] = entry["p50_us"] / echo["p50_us"]
        entry["p99_x_echo"] = entry["p99_us"] / echo["p99_us"]
    rows = [
        [
            c,
            summary[c]["p50_us"],
            summary[c]["p99_us"],
            summary[c]["mean_us"],
            f"{summary[c]['p50_x_echo']:.2f}",
            f"{summary[c]['p99_x_echo']:.2f}",
        ]
        for c in CONFIGS
    ]
    print(
        f"\nRound trip, one request in flight, 64-byte payloads, {args.transport}; "
        f"median over {reps} rounds of {n} requests"
    )
    print(table(["configuration", "p50 us", "p99 us", "mean us", "p50 x echo", "p99 x echo"], rows))
    ratio = summary["fleet (Client)"]["p50_x_echo"]
    ok = ratio <= TARGET
    emb = summary["embedded (Client)"]["p50_x_echo"]
    bare = summary["bare relays (raw DEALER)"]["p50_x_echo"]
    unix = summary["bare relays, unix link (raw DEALER)"]["p50_x_echo"]
    local = summary["local link (Client)"]["p50_x_echo"]
    print(
        f"target fleet (Client) p50 <= {TARGET:g} x echo p50: {ratio:.2f} {verdict(ok)}; "
        f"with the worker on the local link: {local:.2f} {verdict(local <= TARGET)}; "
        f"with the worker embedded in the broker: {emb:.2f} {verdict(emb <= TARGET)}; "
        f"the bare relays (this topology with no carpool code): {bare:.2f}, "
        f"with a unix link between them: {unix:.2f}"
    )
    write_json(
        "added_latency",
        {
            "question": "round trip at one request in flight: fleet vs echo vs in-process",
            "transport": args.transport,
            "quick": args.quick,
            "rounds": reps,
            "requests_per_round": n,
            "target": f"fleet (Client) p50 <= {TARGET:g} x echo p50",
            "pass": ok,
            "pass_embedded": emb <= TARGET,
            "pass_local_link": local <= TARGET,
            "results": summary,
        },
    )
    plot(latencies, reps)
    return 0


def plot(latencies: dict[str, list[list[float]]], reps: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for config in CONFIGS:
        values = np.sort(1e6 * np.concatenate([np.asarray(r) for r in latencies[config]]))
        ax.plot(values, np.linspace(0, 1, len(values)), label=config)
    ax.set_xscale("log")
    ax.set_xlabel("round trip (us, log scale)")
    ax.set_ylabel("cumulative share")
    ax.set_title(f"latency at one request in flight (all {reps} rounds pooled)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_plot(fig, "added_latency")


if __name__ == "__main__":
    sys.exit(main())
