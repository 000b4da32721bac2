"""Broker CPU per request at two revisions, measured in one run: does HEAD cost more than BASE?

Method: two git worktrees (``git worktree add --detach``, in a temporary folder removed
at the end) at BASE and HEAD. Each round runs each revision's own ``bench/hot_path.py
core`` (the ``BrokerCore`` alone, no sockets: microseconds per request for the ``carpool``
and ``fixed`` policies at bursts of 1, 4 and 8), BASE then HEAD, then the next round HEAD
then BASE, and so on, so that a drift in the machine's load falls on both alike. Each
child runs with this interpreter (this virtual environment's packages) and ``PYTHONPATH``
at its worktree's ``src``; which ``carpool`` it imports is checked and printed once per
revision. With ``--worker`` and ``--client``, ``hot_path.py worker --burst 8`` and
``client --burst 8`` (their floors: the least disturbed chunk) join each round.

For each setting the ratio HEAD / BASE is taken per round; the report gives its median
over the rounds and its spread (min-max). The run fails (exit status 1) when a setting's
median ratio is over ``--max-ratio`` (default 1.05).

With ``--zero-copy``, each revision's ``bench/zero_copy.py --quick`` runs too (alternating
as above, ``--zero-copy-rounds`` times each): its broker CPU per request at 1 MiB over
1 KiB. Its ``carpool broker`` and worker processes are started by that revision's code
(``python -m carpool`` under the same ``PYTHONPATH``). HEAD's median ratio must be no
worse than BASE's (within ``--zero-copy-max-ratio``).

Wall time per request is what ``hot_path.py`` reports by default; ``--cpu`` has
``hot_path.py core`` count its process's CPU time instead (broker CPU per request, which
other work on the machine disturbs less). ``--harness this`` measures both revisions with
this checkout's ``hot_path.py`` (the same instrument for both; its API use must exist at
BASE). On a machine shared with other work the alternation, the medians and the spread
are what make the ratio readable.

Run:  .venv/bin/python bench/compare_revs.py BASE HEAD [--rounds 5] [--worker] [--client]
          [--zero-copy] [--max-ratio 1.05] [--harness own|this] [--cpu]
      e.g. .venv/bin/python bench/compare_revs.py main~1 main
Writes bench/out/compare_revs.json. Only committed revisions are compared (a worktree is
checked out from a commit), so commit what is to be measured first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"

#: One line of ``hot_path.py core``'s table: the policy, then "burst K: US us (MEAN)" cells.
_CORE_CELL = re.compile(r"burst (\d+):\s*([0-9.]+) us \(([0-9.]+)\)")
#: ``hot_path.py worker`` / ``client``: "...: floor US us per UNIT, median US (...)".
_FLOOR = re.compile(r"floor ([0-9.]+) us per (\w+), median ([0-9.]+)")


# ---------------------------------------------------------------------- pure parts


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two of an even count); NaN for none."""
    data = sorted(values)
    n = len(data)
    if n == 0:
        return float("nan")
    mid = n // 2
    return data[mid] if n % 2 else (data[mid - 1] + data[mid]) / 2


@dataclass(frozen=True, slots=True)
class RatioSummary:
    """HEAD / BASE of one setting over the rounds."""

    per_round: tuple[float, ...]
    median: float
    low: float
    high: float

    def to_json(self) -> dict[str, Any]:
        return {
            "per_round": list(self.per_round),
            "median": self.median,
            "min": self.low,
            "max": self.high,
        }


def ratios(base: Sequence[float], head: Sequence[float]) -> RatioSummary:
    """Per-round ratios ``head[i] / base[i]``, their median and spread (min-max).

    A round where BASE measured 0 (or less) has no ratio and is left out."""
    if len(base) != len(head):
        raise ValueError(f"{len(base)} BASE rounds against {len(head)} HEAD rounds")
    per_round = tuple(h / b for b, h in zip(base, head, strict=True) if b > 0)
    if not per_round:
        nan = float("nan")
        return RatioSummary((), nan, nan, nan)
    return RatioSummary(per_round, median(per_round), min(per_round), max(per_round))


def parse_core(text: str) -> dict[str, float]:
    """Microseconds per request by setting (``core carpool burst 1``, ...) from the output
    of ``hot_path.py core``: its ``--json`` object, or its table where it has none."""
    for line in text.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            return {
                f"core {row['policy']} burst {row['burst']}": float(row["us_per_request"])
                for row in data["rows"]
            }
    out: dict[str, float] = {}
    for line in text.splitlines():
        cells = _CORE_CELL.findall(line)
        if cells:
            policy = line.split()[0]
            for burst, us, _mean in cells:
                out[f"core {policy} burst {burst}"] = float(us)
    if not out:
        raise ValueError(f"no 'burst K: US us (MEAN)' cells in hot_path.py core's output:\n{text}")
    return out


def parse_floor(text: str, mode: str) -> dict[str, float]:
    """The floor (and the median) per batch or request of ``hot_path.py worker`` or
    ``client``: its ``--json`` object, or its summary line."""
    for line in text.splitlines():
        if line.startswith("{"):
            data = json.loads(line)
            return {
                f"{mode} floor": float(data["floor_us"]),
                f"{mode} median": float(data["median_us"]),
            }
    match = _FLOOR.search(text)
    if match is None:
        raise ValueError(
            f"no 'floor US us per UNIT, median US' in hot_path.py {mode}'s output:\n{text}"
        )
    return {f"{mode} floor": float(match[1]), f"{mode} median": float(match[3])}


def zero_copy_ratio(data: Mapping[str, Any]) -> float:
    """The broker's CPU per request, 1 MiB over 1 KiB, from ``bench/out/zero_copy.json``."""
    return float(data["ratio"]["broker"])


def order(round_index: int) -> tuple[str, str]:
    """Which revision runs first in a round: BASE in even rounds, HEAD in odd ones."""
    return ("base", "head") if round_index % 2 == 0 else ("head", "base")


#: Settings that are reported but not held to --max-ratio: a median beside its floor.
INFORMATIVE = ("worker median", "client median")


def verdicts(summaries: Mapping[str, RatioSummary], max_ratio: float) -> dict[str, bool]:
    """Whether each gated setting's median ratio is at most ``max_ratio`` (a NaN fails)."""
    return {name: s.median <= max_ratio for name, s in summaries.items() if name not in INFORMATIVE}


def report_lines(
    base_us: Mapping[str, Sequence[float]],
    head_us: Mapping[str, Sequence[float]],
    summaries: Mapping[str, RatioSummary],
    max_ratio: float,
) -> list[str]:
    """The table printed at the end: per setting BASE and HEAD medians, ratio, spread."""
    width = max(len(name) for name in summaries)
    lines = [
        f"{'setting':{width}}  {'BASE us':>9}  {'HEAD us':>9}  {'HEAD/BASE':>9}  spread (min-max)",
    ]
    ok = verdicts(summaries, max_ratio)
    for name, s in summaries.items():
        mark = "" if name not in ok else ("  ok" if ok[name] else f"  OVER {max_ratio:g}")
        lines.append(
            f"{name:{width}}  {median(base_us[name]):9.2f}  {median(head_us[name]):9.2f}  "
            f"{s.median:9.3f}  {s.low:.3f}-{s.high:.3f}{mark}"
        )
    return lines


# ---------------------------------------------------------------------- the shell


@dataclass(frozen=True, slots=True)
class Revision:
    label: str  # "base" or "head"
    name: str  # as given on the command line
    commit: str
    tree: Path  # its worktree

    def env(self) -> dict[str, str]:
        """This interpreter's environment, with the revision's ``src`` first on the path
        and this interpreter's folder first on PATH (for ``carpool`` commands)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(self.tree / "src")
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.pop("PYTHONHOME", None)
        return env

    def run(self, args: Sequence[str], timeout_s: float) -> str:
        """Run this interpreter on ``args`` in the worktree; its stdout (stderr passes)."""
        proc = subprocess.run(
            [sys.executable, *args],
            cwd=self.tree,
            env=self.env(),
            stdout=subprocess.PIPE,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{self.label} ({self.name}): {' '.join(args)} exited {proc.returncode}:\n"
                f"{proc.stdout}"
            )
        return proc.stdout

    def check_import(self) -> str:
        """Where the child's ``carpool`` comes from; it must be this worktree's."""
        where = self.run(["-c", "import carpool; print(carpool.__file__)"], 60).strip()
        if not Path(where).resolve().is_relative_to((self.tree / "src").resolve()):
            raise RuntimeError(f"{self.label} imports carpool from {where}, not {self.tree}")
        return where

    def supports(self, script: str, flag: str) -> bool:
        """Whether this revision's ``bench/SCRIPT`` knows ``flag`` (older ones print text)."""
        path = self.tree / "bench" / script
        return path.is_file() and f'"{flag}"' in path.read_text(encoding="utf-8")


def git(*args: str, cwd: Path = HERE) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()


@contextlib.contextmanager
def worktrees(names: Mapping[str, str]) -> Iterator[dict[str, Revision]]:
    """A detached worktree per revision in a temporary folder, removed on exit."""
    repo = Path(git("rev-parse", "--show-toplevel"))
    commits = {
        label: git("rev-parse", "--verify", f"{name}^{{commit}}") for label, name in names.items()
    }
    tmp = Path(tempfile.mkdtemp(prefix="carpool-compare-"))
    made: list[Path] = []
    try:
        revisions = {}
        for label, name in names.items():
            tree = tmp / label
            git("worktree", "add", "--detach", "--quiet", str(tree), commits[label], cwd=repo)
            made.append(tree)
            revisions[label] = Revision(label, name, commits[label], tree)
        yield revisions
    finally:
        for tree in made:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=repo, check=False
            )
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=repo, check=False)


def harness(rev: Revision, args: argparse.Namespace) -> tuple[str, bool]:
    """The hot_path.py that measures ``rev`` (its own, or this checkout's with
    ``--harness this``), and whether it takes ``--json``."""
    if args.harness == "this":
        return str(HERE / "hot_path.py"), True
    return "bench/hot_path.py", rev.supports("hot_path.py", "--json")


def measure(rev: Revision, args: argparse.Namespace) -> dict[str, float]:
    """One round's figures of one revision: core, and worker/client if asked."""
    script, has_json = harness(rev, args)
    core = [script, "core"]
    if has_json:
        core.append("--json")
    if args.cpu:
        core.append("--cpu")
    figures = parse_core(rev.run(core, args.timeout_s))
    for mode in ("worker", "client"):
        if getattr(args, mode):
            cmd = [script, mode, "--burst", str(args.burst)]
            if has_json:
                cmd.append("--json")
            figures.update(parse_floor(rev.run(cmd, args.timeout_s), mode))
    return figures


def measure_zero_copy(rev: Revision, args: argparse.Namespace) -> float:
    rev.run(["bench/zero_copy.py", "--quick"], args.timeout_s)
    data = json.loads((rev.tree / "bench" / "out" / "zero_copy.json").read_text(encoding="utf-8"))
    return zero_copy_ratio(data)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("base", help="the revision measured against (e.g. main~1)")
    p.add_argument("head", help="the revision measured (e.g. main)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each running both (5)")
    p.add_argument("--max-ratio", type=float, default=1.05, help="largest median HEAD/BASE (1.05)")
    p.add_argument("--worker", action="store_true", help="also hot_path.py worker --burst K")
    p.add_argument("--client", action="store_true", help="also hot_path.py client --burst K")
    p.add_argument("--burst", type=int, default=8, help="K of --worker and --client (8)")
    p.add_argument("--zero-copy", action="store_true", help="also bench/zero_copy.py --quick")
    p.add_argument("--zero-copy-rounds", type=int, default=1, help="zero_copy runs of each (1)")
    p.add_argument(
        "--zero-copy-max-ratio",
        type=float,
        default=1.05,
        help="largest HEAD/BASE of zero_copy's 1 MiB / 1 KiB ratio (1.05)",
    )
    p.add_argument(
        "--harness",
        choices=("own", "this"),
        default="own",
        help="measure each revision with its own bench/hot_path.py, or both with this "
        "checkout's (the same instrument for both; it must run against BASE's API) (own)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="core: the process's CPU time per request, not wall time (needs --harness this "
        "where BASE's hot_path.py has no --cpu)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="per child run (600)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.zero_copy_rounds < 1:
        p.error("--rounds and --zero-copy-rounds must be at least 1")

    figures: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    zero_copy: dict[str, list[float]] = {"base": [], "head": []}
    with worktrees({"base": args.base, "head": args.head}) as revs:
        imports = {label: rev.check_import() for label, rev in revs.items()}
        for label, rev in revs.items():
            print(f"{label} {rev.name} ({rev.commit[:12]}): carpool from {imports[label]}")
        for rnd in range(args.rounds):
            for label in order(rnd):
                figures[label].append(measure(revs[label], args))
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        if args.zero_copy:
            for rnd in range(args.zero_copy_rounds):
                for label in order(rnd):
                    zero_copy[label].append(measure_zero_copy(revs[label], args))
                print(f"zero_copy round {rnd + 1}/{args.zero_copy_rounds} done", flush=True)
        commits = {label: rev.commit for label, rev in revs.items()}

    names = [k for k in figures["base"][0] if all(k in f for f in figures["head"])]
    base_us = {k: [f[k] for f in figures["base"]] for k in names}
    head_us = {k: [f[k] for f in figures["head"]] for k in names}
    summaries = {k: ratios(base_us[k], head_us[k]) for k in names}
    print(f"\nHEAD {args.head} over BASE {args.base}, {args.rounds} rounds (us: medians)")
    for line in report_lines(base_us, head_us, summaries, args.max_ratio):
        print(line)
    ok = verdicts(summaries, args.max_ratio)
    passed = all(ok.values())
    result: dict[str, Any] = {
        "base": {"rev": args.base, "commit": commits["base"], "carpool": imports["base"]},
        "head": {"rev": args.head, "commit": commits["head"], "carpool": imports["head"]},
        "rounds": args.rounds,
        "max_ratio": args.max_ratio,
        "harness": args.harness,
        "timer": "cpu" if args.cpu else "wall",
        "settings": {
            k: {"base_us": base_us[k], "head_us": head_us[k], "ratio": summaries[k].to_json()}
            for k in names
        },
        "over": sorted(k for k, good in ok.items() if not good),
    }
    if args.zero_copy:
        zc_base, zc_head = median(zero_copy["base"]), median(zero_copy["head"])
        zc_ok = zc_head <= zc_base * args.zero_copy_max_ratio
        print(
            f"zero_copy broker CPU 1 MiB / 1 KiB: BASE {zc_base:.2f}, HEAD {zc_head:.2f} "
            f"({'no worse' if zc_ok else 'WORSE'}; runs {zero_copy['base']} / {zero_copy['head']})"
        )
        result["zero_copy"] = {
            "base": zero_copy["base"],
            "head": zero_copy["head"],
            "max_ratio": args.zero_copy_max_ratio,
            "pass": zc_ok,
        }
        passed = passed and zc_ok
    result["pass"] = passed
    OUT.mkdir(exist_ok=True)
    (OUT / "compare_revs.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'PASS' if passed else 'FAIL'}: written {OUT / 'compare_revs.json'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
