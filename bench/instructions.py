"""instructions.py: BrokerCore's instructions per request at two revisions, counted by
valgrind's callgrind — a measure the load of a shared machine does not move.

    python bench/instructions.py BASE HEAD [--cells 1:carpool,8:carpool,8:fixed]

Method: the worktrees of bench/compare_revs.py; in each, this checkout's
``bench/hot_path.py`` drives the revision's ``BrokerCore`` (``core_run``: bursts of K
requests, deferred mode, as ``hot_path.py core``) under ``valgrind --tool=callgrind``,
once with ``--small-n`` and once with ``--large-n`` requests, with a fixed hash seed and
a clock that advances 10 µs a reading (so that runs repeat, and every revision sees the
same times and forms the same batches); the difference of the two instruction totals
over the difference of the counts is the cost of a request, without the interpreter's
start and imports. Needs valgrind (about a minute a run). Instructions are not time
(cache misses, branch mispredictions and the allocator's page faults are not in them),
but a change in them is a change in the work the code does. Writes
bench/out/instructions.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from compare_revs import Revision, worktrees

HERE = Path(__file__).resolve().parent

_DRIVER = """
import itertools, sys, time
sys.path.insert(0, {bench!r})
import hot_path
# The core's clock: 10 us a reading, the same at every revision (under valgrind the real
# one runs ~50 times slower, and the batches the policy forms would follow it).
ticks = itertools.count()
class Clock:
    monotonic = staticmethod(lambda: next(ticks) * 1e-5)
    perf_counter = staticmethod(time.perf_counter)
    process_time = staticmethod(time.process_time)
hot_path.time = Clock
k, policy, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
hot_path.core_run(k, policy, n)
"""


def instructions(rev: Revision, driver: Path, k: int, policy: str, n: int, out: Path) -> int:
    """Total instructions of one run of ``core_run(k, policy, n)`` at ``rev``."""
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            str(driver),
            str(k),
            policy,
            str(n),
        ],
        cwd=rev.tree,
        # A fixed hash seed: with a random one, set and dict layouts (and so the counts)
        # differ from run to run by a few percent of a request's.
        env={**rev.env(), "PYTHONHASHSEED": "0"},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=1800,
    )
    for line in out.read_text(encoding="utf-8").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {out}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("head")
    p.add_argument("--cells", default="1:carpool,8:carpool,8:fixed", help="K:POLICY,...")
    p.add_argument("--small-n", type=int, default=1000)
    p.add_argument("--large-n", type=int, default=3000)
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed", file=sys.stderr)
        return 2
    cells = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.cells.split(",")]
    rows = []
    with (
        worktrees({"base": args.base, "head": args.head}) as revs,
        tempfile.TemporaryDirectory() as tmp,
    ):
        driver = Path(tmp) / "driver.py"
        driver.write_text(_DRIVER.format(bench=str(HERE)), encoding="utf-8")
        print(f"{'cell':16}  {'BASE Ir/req':>12}  {'HEAD Ir/req':>12}  HEAD/BASE")
        for k, policy in cells:
            per: dict[str, float] = {}
            for label in ("base", "head"):
                rev = revs[label]
                total = [
                    instructions(rev, driver, k, policy, n, Path(tmp) / f"cg.{label}.{n}")
                    for n in (args.small_n, args.large_n)
                ]
                per[label] = (total[1] - total[0]) / (args.large_n - args.small_n)
            ratio = per["head"] / per["base"]
            cell = f"{policy} burst {k}"
            print(f"{cell:16}  {per['base']:12.0f}  {per['head']:12.0f}  {ratio:.3f}")
            rows.append({"burst": k, "policy": policy, **per, "ratio": ratio})
        commits = {label: rev.commit for label, rev in revs.items()}
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "instructions.json").write_text(
        json.dumps({"commits": commits, "rows": rows}, indent=1), encoding="utf-8"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
