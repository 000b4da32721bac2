"""edge_profile.py: where a request's work at the broker's socket edge goes, function by
function, at two revisions — the Python view beside bench/instructions.py's count.

    python bench/edge_profile.py BASE HEAD [--cells 1:carpool,8:carpool,1:fixed,8:fixed]
        [--small-n 300] [--large-n 900] [--top 25]

Method: the worktrees of bench/compare_revs.py; in each, a child runs this checkout's
``bench/hot_path.py`` ``core_run`` (as bench/instructions.py does: the same clock, the
same hash seed) and traces only the counted edge (inside ``operator.call``: decode, core,
encode) with ``sys.settrace`` (bytecodes executed and calls, per function) and
``sys.setprofile`` (calls of C functions, by name). Each figure is per request: the
difference of a ``--large-n`` and a ``--small-n`` run over the difference of the counts.
Bytecodes are not instructions (a call, an allocation or a dict lookup costs many), but
they are exact and repeat, and they name the Python function that spends them; with the
calls beside them they say which functions a revision added to a request's path. Prints,
per cell, the totals and, by function and by file, the largest differences; writes
bench/out/edge_profile.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent

Profile = dict[str, dict[str, float]]  # "ops" / "calls" / "ccalls" -> function -> per request


def function_key(frame: FrameType) -> str:
    """``path/in/carpool.py:Qual.name``; a dataclass's generated ``__init__`` by its class."""
    code = frame.f_code
    _, inside, tail = code.co_filename.partition("/src/carpool/")
    name = tail if inside else code.co_filename.rsplit("/", 1)[-1]
    if name == "<string>" and "self" in frame.f_locals:
        return f"{type(frame.f_locals['self']).__name__}.__init__"
    return f"{name}:{code.co_qualname}"


def traced_run(k: int, policy: str, n: int) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Bytecodes and calls per function, and C calls by name, inside the counted edge of
    one ``core_run(k, policy, n)``."""
    sys.path.insert(0, str(HERE))
    import hot_path

    ops: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    ccalls: Counter[str] = Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            calls[function_key(frame)] += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            ops[function_key(frame)] += 1
        return tracer

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            ccalls[f"C:{getattr(arg, '__qualname__', repr(arg))}"] += 1

    def counted(fn: Callable[..., Any], *args: Any) -> Any:
        sys.settrace(tracer)
        sys.setprofile(profiler)
        try:
            return fn(*args)
        finally:
            sys.settrace(None)
            sys.setprofile(None)

    ticks = itertools.count()
    hot_path.core_run(k, policy, n, clock=lambda: next(ticks) * 1e-5, edge=counted)
    return ops, calls, ccalls


def per_request(
    small: Sequence[Counter[str]], large: Sequence[Counter[str]], small_n: int, large_n: int
) -> Profile:
    """Each counter's difference over the difference of the request counts."""
    span = large_n - small_n
    return {
        name: {key: (b[key] - a[key]) / span for key in b.keys() | a.keys() if b[key] != a[key]}
        for name, a, b in zip(("ops", "calls", "ccalls"), small, large, strict=True)
    }


def by_file(profile: Profile) -> dict[str, float]:
    """Bytecodes per request by file (a generated ``__init__`` under ``dataclasses``)."""
    out: dict[str, float] = defaultdict(float)
    for key, ops in profile["ops"].items():
        out[key.split(":", 1)[0] if ":" in key else "dataclasses"] += ops
    return dict(out)


def moved(base: Profile, head: Profile) -> dict[str, str]:
    """A function that moved to another file, under the same qualified name (one at each
    revision): its HEAD key, by its BASE key (so that the two are compared)."""

    def unique(keys: set[str]) -> dict[str, str]:
        names = Counter(k.split(":", 1)[-1] for k in keys)
        return {k.split(":", 1)[-1]: k for k in keys if names[k.split(":", 1)[-1]] == 1}

    b, h = unique(set(base["ops"])), unique(set(head["ops"]))
    return {b[n]: h[n] for n in b.keys() & h.keys() if b[n] != h[n]}


def report(cell: str, base: Profile, head: Profile, top: int) -> list[str]:
    """The lines printed for one cell: totals, then the largest differences."""
    lines = [f"== {cell}"]
    for name, what in (("ops", "bytecodes"), ("calls", "Python calls"), ("ccalls", "C calls")):
        b, h = sum(base[name].values()), sum(head[name].values())
        lines.append(f"  {what:13} per request: BASE {b:8.1f}  HEAD {h:8.1f}  x{h / b:.3f}")
    lines.append(f"  {'delta ops':>9}  {'BASE ops/calls':>15}  {'HEAD ops/calls':>15}  function")
    renamed = moved(base, head)
    paired = renamed.keys() | set(renamed.values())
    pairs = list(renamed.items())
    pairs += [(k, k) for k in base["ops"].keys() | head["ops"].keys() if k not in paired]

    def delta(pair: tuple[str, str]) -> float:
        return head["ops"].get(pair[1], 0.0) - base["ops"].get(pair[0], 0.0)

    for kb, kh in sorted(pairs, key=lambda pair: -abs(delta(pair)))[:top]:
        was = f"{base['ops'].get(kb, 0.0):.1f}/{base['calls'].get(kb, 0.0):.2f}"
        now = f"{head['ops'].get(kh, 0.0):.1f}/{head['calls'].get(kh, 0.0):.2f}"
        name = kh if kb == kh else f"{kh} (BASE {kb.split(':', 1)[0]})"
        lines.append(f"  {delta((kb, kh)):+9.1f}  {was:>15}  {now:>15}  {name}")
    files_b, files_h = by_file(base), by_file(head)
    lines.append("  by file (bytecodes per request):")
    for f in sorted(files_b.keys() | files_h.keys(), key=lambda f: -files_h.get(f, 0.0)):
        b, h = files_b.get(f, 0.0), files_h.get(f, 0.0)
        if max(b, h) >= 5:
            lines.append(f"  {h - b:+9.1f}  {b:15.1f}  {h:15.1f}  {f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", nargs="?")
    p.add_argument("head", nargs="?")
    p.add_argument(
        "--cells", default="1:carpool,8:carpool,1:fixed,8:fixed", help="BURST:POLICY,..."
    )
    p.add_argument("--small-n", type=int, default=300)
    p.add_argument("--large-n", type=int, default=900)
    p.add_argument("--top", type=int, default=25, help="functions listed per cell (25)")
    p.add_argument("--child", metavar="BURST:POLICY", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # in a revision's worktree: print its profile as one JSON line
        k, _, policy = args.child.partition(":")
        small = traced_run(int(k), policy, args.small_n)
        large = traced_run(int(k), policy, args.large_n)
        print(json.dumps(per_request(small, large, args.small_n, args.large_n)))
        return 0
    if not args.base or not args.head:
        p.error("BASE and HEAD are needed")
    from compare_revs import worktrees
    from instructions import parse_cells

    cells = parse_cells(args.cells)
    result: dict[str, Any] = {"small_n": args.small_n, "large_n": args.large_n, "cells": {}}
    with worktrees({"base": args.base, "head": args.head}) as revs:
        result["commits"] = {label: rev.commit for label, rev in revs.items()}
        for k, policy in cells:
            cell = f"{policy} burst {k}"
            profiles: dict[str, Profile] = {}
            for label, rev in revs.items():
                cmd = [str(Path(__file__).resolve()), "--child", f"{k}:{policy}"]
                cmd += ["--small-n", str(args.small_n), "--large-n", str(args.large_n)]
                out = subprocess.run(
                    [sys.executable, *cmd],
                    cwd=rev.tree,
                    env={**rev.env(), "PYTHONHASHSEED": "0"},  # as bench/instructions.py
                    check=True,
                    stdout=subprocess.PIPE,
                    text=True,
                    timeout=1800,
                ).stdout
                profiles[label] = json.loads(out.strip().splitlines()[-1])
            print("\n".join(report(cell, profiles["base"], profiles["head"], args.top)))
            result["cells"][cell] = profiles
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "edge_profile.json").write_text(json.dumps(result) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
