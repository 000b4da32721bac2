"""shapes.py: several item shapes of one model: share of admitted requests on time.

A model with a dynamic item dim queues each shape apart (docs/batching.md, "Several
queues of one model"): its queues share the workers' slots, and the door predicts a
request's completion behind all of them. One synthetic worker of 40 ms + 4 ms a sample,
batches of 8, 2 slots (111 samples/s at full batches); requests of one sample with 1 s
timeouts, evenly spaced, of shapes [1, 16 + i] in turn for i < shapes: 1.5 s at half
the capacity (the broker fits the batch cost), then ``--seconds`` at the load.

- ``sim``: the simulator (``carpool.sim``, the real ``BrokerCore`` on a simulated
  clock, one event at a time);
- ``live``: a broker process with the worker embedded (``carpool broker
  --embed-config``, on ``ipc://``) and the carpool ``Client`` sending open loop; every
  answer is awaited (5 s at most each).

Per run: requests sent, admitted (not refused at the door), answered with outputs (on
time: the broker drops a result that comes after the deadline), the share of the
admitted on time, refusals at the door, and requests shed after admission. Live runs
are repeated ``--passes`` times (the machine's load moves them; the simulator is
deterministic).

Run: ``.venv/bin/python bench/shapes.py [--shapes 1,8] [--loads 0.5,0.8,3]
[--seconds 8] [--passes 3] [--sim-only | --live-only]``. Another revision: put its
``src`` first, ``PYTHONPATH=/path/to/checkout/src`` (the broker process inherits it);
alternate revisions pass by pass to compare them. Writes bench/out/shapes.json.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
from common import ProcessGroup, parser, quiet_logs, table, write_json

import carpool
from carpool.broker.config import BatchingConfig
from carpool.client import Client, DeadlineExceeded, Overloaded, RequestError
from carpool.sim.simulator import EngineCost, SimWorker, simulate
from carpool.sim.workload import Arrival

FIXED_S, PER_SAMPLE_S, MAX_BATCH, SLOTS = 0.040, 0.004, 8, 2
CAPACITY_SPS = MAX_BATCH / (FIXED_S + PER_SAMPLE_S * MAX_BATCH)
WARM_S, WARM_LOAD = 1.5, 0.5
TIMEOUT_S = 1.0
MODEL = "synthetic"
WORKER_TOML = f"""\
[[models]]
name = "{MODEL}"
engine = "synthetic"
fixed_cost_s = {FIXED_S}
per_sample_s = {PER_SAMPLE_S}
item_shape = [-1]
max_batch = {MAX_BATCH}
"""


def sim_run(shapes: int, load: float, seconds: float) -> dict[str, Any]:
    arrivals: list[Arrival] = []
    start_s = 0.0
    for rate, span_s in ((WARM_LOAD * CAPACITY_SPS, WARM_S), (load * CAPACITY_SPS, seconds)):
        for i in range(round(rate * span_s)):
            shape = (1, 16 + len(arrivals) % shapes)
            arrivals.append(Arrival(start_s + i / rate, MODEL, shape, round(1000 * TIMEOUT_S)))
        start_s += span_s
    worker = SimWorker("w", EngineCost(FIXED_S, PER_SAMPLE_S), MAX_BATCH, slots=SLOTS)
    result = simulate(arrivals, [worker], BatchingConfig(max_batch=MAX_BATCH), seed=1)
    door = int(result.broker["shed_at_door"])  # type: ignore[call-overload]
    shed = int(result.broker["shed"])  # type: ignore[call-overload]
    refused = door + result.errors.get("OVERLOADED", 0)
    return _row("sim", shapes, load, result.sent, refused, result.on_time, door, shed - door)


def _pace(client: Client, inputs: list[Any], rate: float, seconds: float) -> list[Any]:
    """Send open loop at ``rate`` for ``seconds``, the shapes in turn; the futures."""
    sent: list[Any] = []
    start = time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        due = start + len(sent) / rate
        if now < due:
            client.poll(min(due - now, 0.005))
            continue
        x = inputs[len(sent) % len(inputs)]
        sent.append(client.submit(MODEL, {"x": x}, timeout_s=TIMEOUT_S))
    return sent


def live_run(group: ProcessGroup, shapes: int, load: float, seconds: float) -> dict[str, Any]:
    config = group.tmp / "worker.toml"
    config.write_text(WORKER_TOML)
    frontend, backend = group.endpoint(f"fe{shapes}-{load}"), group.endpoint(f"be{shapes}-{load}")
    broker = group.broker(
        frontend, backend, "--max-batch", str(MAX_BATCH), "--embed-config", str(config)
    )
    inputs = [np.ones((1, 16 + i), np.float32) for i in range(shapes)]
    try:
        with Client(frontend, default_timeout_s=TIMEOUT_S) as client:
            for future in _pace(client, inputs, WARM_LOAD * CAPACITY_SPS, WARM_S):
                with contextlib.suppress(RequestError):
                    future.result(5.0)
            before = client.stats()
            sent = _pace(client, inputs, load * CAPACITY_SPS, seconds)
            outcomes: Counter[str] = Counter()
            for future in sent:
                try:
                    future.result(5.0)
                    outcomes["ok"] += 1
                except (DeadlineExceeded, Overloaded) as exc:
                    outcomes[type(exc).__name__] += 1
            after = client.stats()
    finally:
        group.stop(broker)
    door = after["shed_at_door"] - before["shed_at_door"]
    shed = after["shed"] - before["shed"]
    errors_before, errors_after = before["errors"], after["errors"]
    overloaded = errors_after.get("OVERLOADED", 0) - errors_before.get("OVERLOADED", 0)
    return _row(
        "live", shapes, load, len(sent), door + overloaded, outcomes["ok"], door, shed - door
    )


def _row(
    where: str, shapes: int, load: float, sent: int, refused: int, ok: int, door: int, late: int
) -> dict[str, Any]:
    admitted = sent - refused
    return {
        "where": where,
        "shapes": shapes,
        "load": load,
        "sent": sent,
        "admitted": admitted,
        "on_time": ok,
        "on_time_share": round(ok / admitted, 4) if admitted else None,
        "refused_at_door": door,
        "shed_after_admission": late,
    }


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--shapes", default="1,8", help="numbers of shapes, comma-separated")
    p.add_argument("--loads", default="0.5,0.8,3", help="loads (x capacity), comma-separated")
    p.add_argument("--seconds", type=float, default=8.0, help="time at the load (8)")
    p.add_argument("--passes", type=int, default=3, help="live runs of each setting (3)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--sim-only", action="store_true")
    which.add_argument("--live-only", action="store_true")
    args = p.parse_args()
    quiet_logs()
    shapes = [int(s) for s in args.shapes.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    seconds = 2.0 if args.quick else args.seconds
    passes = 1 if args.quick else args.passes
    rows: list[dict[str, Any]] = []
    if not args.live_only:
        rows += [sim_run(n, load, seconds) for load in loads for n in shapes]
    if not args.sim_only:
        for _ in range(passes):
            for load in loads:
                for n in shapes:
                    with ProcessGroup(args.transport) as group:
                        rows.append(live_run(group, n, load, seconds))
    where = os.path.dirname(carpool.__file__)
    print(f"carpool from {where}")
    headers = ["where", "shapes", "load", "sent", "admitted", "on_time", "on_time_share"]
    headers += ["refused_at_door", "shed_after_admission"]
    print(table(headers, [[r[h] for h in headers] for r in rows]))
    write_json("shapes", {"carpool": where, "seconds": seconds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
