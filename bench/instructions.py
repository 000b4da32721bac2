"""instructions.py: the broker's instructions per request at two revisions, counted by
valgrind's callgrind — a measure the load of a shared machine does not move.

    python bench/instructions.py BASE HEAD [--cells 1:carpool,8:carpool,1:fixed,8:fixed]
        [--runs 3] [--small-n 1000] [--large-n 3000] [--keep DIR]

What counts: the socket edge, from the frames a socket returns to the frames handed back
to it — the decode, the core and the encode, for client and worker messages alike. This
checkout's ``bench/hot_path.py`` (``core_run``: bursts of K requests, deferred mode, a
synthetic worker with 2 slots, as ``hot_path.py core``) drives each revision's
``BrokerCore`` through ``operator.call`` at that edge and nowhere else, and callgrind
collects only inside it (``--collect-atstart=no --toggle-collect=_operator_call``): the
harness's own encoding of requests and results, the interpreter's start and the imports
are not counted. Where a revision's core takes typed messages, their decoders
(``decode_from_worker``, ``decode_from_client``) run inside the edge, and so does the
encoder of every message the core hands back (``to_frames``).

Method: the worktrees of bench/compare_revs.py. Each run is two callgrind runs, with
``--small-n`` and with ``--large-n`` requests, with a fixed hash seed and a clock that
advances 10 µs a reading (so that every revision sees the same times and forms the same
batches); the difference of the two totals over the difference of the counts is a
request's instructions, without the one-time costs (the READY, the first layouts, the
interpreter's specialisation). A cell is the median of ``--runs`` runs per revision
(object addresses, and so some dict and set layouts, differ from run to run); every run
is printed and written. Needs valgrind. Instructions are not time (cache misses, branch
mispredictions and the allocator's page faults are not in them), but a change in them is
a change in the work the code does. Writes bench/out/instructions.json; ``--keep DIR``
keeps each cell's last large-n callgrind file per revision (for ``callgrind_annotate``).
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
from typing import Any

from compare_revs import Revision, median, worktrees

HERE = Path(__file__).resolve().parent

#: The C function of ``operator.call``, the one door of the counted edge (bench/hot_path.py).
EDGE = "_operator_call"

_DRIVER = """
import itertools, sys
sys.path.insert(0, {bench!r})
import hot_path
# The core's clock: 10 us a reading, the same at every revision (under valgrind the real
# one runs ~50 times slower, and the batches the policy forms would follow it).
ticks = itertools.count()
k, policy, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
hot_path.core_run(k, policy, n, clock=lambda: next(ticks) * 1e-5)
"""


def parse_cells(text: str) -> list[tuple[int, str]]:
    """``"1:carpool,8:fixed"`` -> ``[(1, "carpool"), (8, "fixed")]``."""
    cells = []
    for cell in text.split(","):
        burst, sep, policy = cell.strip().partition(":")
        if not sep or not burst.isdigit() or int(burst) < 1 or not policy:
            raise ValueError(f"a cell is BURST:POLICY, e.g. 8:carpool (got {cell!r})")
        cells.append((int(burst), policy))
    return cells


def summary_total(text: str) -> int:
    """The instruction total of a callgrind output file (its ``summary:`` line)."""
    for line in text.splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise ValueError("no summary line in the callgrind output")


def per_request(small: int, large: int, small_n: int, large_n: int) -> float:
    """A request's instructions: the difference of two runs' totals over that of their
    request counts."""
    return (large - small) / (large_n - small_n)


def cell_row(burst: int, policy: str, runs: dict[str, list[float]]) -> dict[str, Any]:
    """One cell of the output: every run per revision, their medians and HEAD / BASE."""
    base, head = median(runs["base"]), median(runs["head"])
    return {
        "burst": burst,
        "policy": policy,
        "base_runs": runs["base"],
        "head_runs": runs["head"],
        "base": base,
        "head": head,
        "ratio": head / base,
    }


def instructions(rev: Revision, driver: Path, k: int, policy: str, n: int, out: Path) -> int:
    """Instructions at the socket edge in one run of ``core_run(k, policy, n)`` at ``rev``."""
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--toggle-collect={EDGE}",
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
    return summary_total(out.read_text(encoding="utf-8"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("head")
    p.add_argument(
        "--cells", default="1:carpool,8:carpool,1:fixed,8:fixed", help="BURST:POLICY,..."
    )
    p.add_argument("--runs", type=int, default=3, help="runs per cell and revision (3)")
    p.add_argument("--small-n", type=int, default=1000)
    p.add_argument("--large-n", type=int, default=3000)
    p.add_argument("--keep", type=Path, help="keep the large-n callgrind files here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.runs < 1 or not 0 < args.small_n < args.large_n:
        p.error("--runs must be at least 1, and 0 < --small-n < --large-n")
    try:
        cells = parse_cells(args.cells)
    except ValueError as exc:
        p.error(str(exc))
    if shutil.which("valgrind") is None:
        print("valgrind is not installed", file=sys.stderr)
        return 2
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    rows = []
    with (
        worktrees({"base": args.base, "head": args.head}) as revs,
        tempfile.TemporaryDirectory() as tmp,
    ):
        driver = Path(tmp) / "driver.py"
        driver.write_text(_DRIVER.format(bench=str(HERE)), encoding="utf-8")
        print(f"instructions per request, n = {args.large_n} - {args.small_n}")
        for k, policy in cells:
            runs: dict[str, list[float]] = {"base": [], "head": []}
            for i in range(args.runs):
                for label in ("base", "head"):
                    rev = revs[label]
                    total = {
                        n: instructions(rev, driver, k, policy, n, Path(tmp) / f"cg.{label}.{n}")
                        for n in (args.small_n, args.large_n)
                    }
                    ir = per_request(
                        total[args.small_n], total[args.large_n], args.small_n, args.large_n
                    )
                    runs[label].append(ir)
                    print(f"  {policy} burst {k} run {i + 1} {label}: {ir:,.0f}", flush=True)
                    if args.keep is not None:
                        kept = args.keep / f"{label}.{policy}.{k}.out"
                        shutil.copy(Path(tmp) / f"cg.{label}.{args.large_n}", kept)
            row = cell_row(k, policy, runs)
            rows.append(row)
            print(
                f"{policy} burst {k}: BASE {row['base']:,.0f}  HEAD {row['head']:,.0f}  "
                f"HEAD/BASE {row['ratio']:.3f}",
                flush=True,
            )
        commits = {label: rev.commit for label, rev in revs.items()}
    print(f"\n{'cell':16}  {'BASE Ir/req':>12}  {'HEAD Ir/req':>12}  HEAD/BASE  (medians)")
    for row in rows:
        cell = f"{row['policy']} burst {row['burst']}"
        print(f"{cell:16}  {row['base']:12,.0f}  {row['head']:12,.0f}  {row['ratio']:.3f}")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    result = {
        "commits": commits,
        "names": {"base": args.base, "head": args.head},
        "counted": "socket edge: decode, core, encode",
        "small_n": args.small_n,
        "large_n": args.large_n,
        "runs": args.runs,
        "rows": rows,
    }
    (out / "instructions.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
