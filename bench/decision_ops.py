"""decision_ops.py: what the default policy's decisions cost the broker against fixed's,
per request, where batches wait: bytecodes of broker code, function by function.

    python bench/decision_ops.py [--rate 1000] [--seconds 3] [--top 25]

The instruction cells of bench/instructions.py send bursts to an idle worker, where the
default sends at once; this is the other path, the one of bench/policy_live.py's light
and moderate rates: each arrival re-decides while a batch fills. Method: the simulator
(carpool.sim) replays one seeded Poisson schedule (1 s timeouts) to one worker whose
engine costs 0.9 ms + 0.14 ms a sample (an MLP-like α + βB, batching pays), B_max 16 and
T_max 5 ms, once per policy, and ``sys.settrace`` counts the bytecodes executed in
``carpool`` code outside the simulator itself (the broker's core, its parts and the
protocol), per function. Bytecodes are not instructions, but they are exact and repeat,
and they name the function that spends them. Prints totals per request, the mean batch
of each policy (they should match), and the functions with the largest differences;
writes bench/out/decision_ops.json.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from types import FrameType
from typing import Any

from common import write_json

from carpool.broker.config import BatchingConfig
from carpool.sim.simulator import EngineCost, SimWorker, simulate
from carpool.sim.workload import Arrival, arrivals, poisson

POLICIES = ("fixed", "carpool")


def counted(schedule: Sequence[Arrival], policy: str) -> tuple[Counter[str], float]:
    """Bytecodes per function of broker code over one simulated run; its mean batch."""
    ops: Counter[str] = Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            path = frame.f_code.co_filename
            if "/carpool/" not in path or "/carpool/sim/" in path:
                return None
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return tracer
        if event == "opcode":
            code = frame.f_code
            ops[f"{code.co_filename.rpartition('/carpool/')[2]}:{code.co_qualname}"] += 1
        return tracer

    workers = [SimWorker("w", EngineCost(0.0009, 0.00014), max_batch=16, slots=2)]
    config = BatchingConfig(policy=policy, max_batch=16, max_wait_s=0.005)
    sys.settrace(tracer)
    try:
        result = simulate(schedule, workers, config, label=policy)
    finally:
        sys.settrace(None)
    return ops, result.mean_batch


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1000.0, help="requests per second (1000)")
    p.add_argument("--seconds", type=float, default=3.0, help="length of the schedule (3)")
    p.add_argument("--top", type=int, default=25, help="functions listed (25)")
    args = p.parse_args(argv)
    schedule = arrivals(poisson(args.rate, args.seconds), timeout_ms=1000, seed=1)
    n = len(schedule)
    runs = {policy: counted(schedule, policy) for policy in POLICIES}
    per = {policy: {k: v / n for k, v in ops.items()} for policy, (ops, _) in runs.items()}
    totals = {policy: sum(ops.values()) for policy, ops in per.items()}
    print(f"{n} requests at {args.rate:g}/s; bytecodes of broker code per request:")
    for policy in POLICIES:
        print(f"  {policy:<8} {totals[policy]:8.1f}   mean batch {runs[policy][1]:.2f}")
    print(f"  ratio    {totals['carpool'] / totals['fixed']:8.3f}")
    default, fixed = per["carpool"], per["fixed"]
    diff = {k: default.get(k, 0.0) - fixed.get(k, 0.0) for k in set(default) | set(fixed)}
    print("\ncarpool - fixed   carpool     fixed   function")
    for k in sorted(diff, key=lambda k: -abs(diff[k]))[: args.top]:
        print(f"{diff[k]:15.1f} {default.get(k, 0.0):9.1f} {fixed.get(k, 0.0):9.1f}   {k}")
    write_json(
        "decision_ops",
        {
            "rate": args.rate,
            "requests": n,
            "totals": totals,
            "mean_batch": {policy: runs[policy][1] for policy in POLICIES},
            "per_function": per,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
