"""report.py: the peers harness's figures from its cells — medians, goodput, ceilings, checks.

Pure: it reads the cell records that bench/policy_live.py writes (one per target, rate
and pass) and returns numbers and text; it starts nothing and reads no clock.

A cell record holds ``target``, ``rate``, ``pass``, ``gen`` (the load generator's JSON,
bench/peers/openloop.py), ``server_us`` (the target's processes' CPU per answered
request, all of them together), ``roles_us`` (the same per process role),
``server_cores``, ``mean_batch`` and ``batch_hist``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: The latency objective of goodput, and the share of requests that must be answered.
SLO_MS = 50.0
MIN_OK_SHARE = 0.99
#: The cores the fleet and the generator share on the machine these figures come from.
CORES = 2


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two of an even count); NaN for none."""
    data = sorted(v for v in values if not math.isnan(v))
    n = len(data)
    if n == 0:
        return math.nan
    return data[n // 2] if n % 2 else (data[n // 2 - 1] + data[n // 2]) / 2


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def _stat(values: Sequence[float]) -> dict[str, float]:
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": median(kept), "min": min(kept), "max": max(kept)}


def summarise(cells: Iterable[Mapping[str, Any]]) -> dict[str, dict[float, dict[str, Any]]]:
    """Per target and offered rate: each figure's median over passes and its spread."""
    groups: dict[str, dict[float, list[Mapping[str, Any]]]] = {}
    for cell in cells:
        groups.setdefault(cell["target"], {}).setdefault(float(cell["rate"]), []).append(cell)
    out: dict[str, dict[float, dict[str, Any]]] = {}
    for target, by_rate in groups.items():
        for rate, group in sorted(by_rate.items()):
            gens = [c["gen"] for c in group]
            errors: dict[str, int] = {}
            for g in gens:
                for code, count in g["errors"].items():
                    errors[code] = errors.get(code, 0) + count
            roles = sorted({r for c in group for r in c["roles_us"]})
            out.setdefault(target, {})[rate] = {
                "passes": len(group),
                "p50_ms": _stat([_num(g["p50_ms"]) for g in gens]),
                "p99_ms": _stat([_num(g["p99_ms"]) for g in gens]),
                "served_per_s": _stat([g["served_per_s"] for g in gens]),
                "ok_share": _stat([g["ok_share"] for g in gens]),
                "errors": errors,
                "mean_batch": _stat([_num(c["mean_batch"]) for c in group]),
                "server_us": _stat([_num(c["server_us"]) for c in group]),
                "server_cores": _stat([c["server_cores"] for c in group]),
                "roles_us": {r: _stat([_num(c["roles_us"].get(r)) for c in group]) for r in roles},
                "gen_us": _stat([_num(g["cpu_us_per_request"]) for g in gens]),
                "gen_cores": _stat([g["cores"] for g in gens]),
                "void": any(g["void"] for g in gens),
                "restarts": sum(1 for c in group if c.get("restarted")),
            }
    return out


def goodput(rows: Mapping[float, Mapping[str, Any]]) -> float:
    """The highest offered rate whose median p99 is within SLO_MS with at least
    MIN_OK_SHARE of the requests answered (median over passes); 0 for none."""
    good = [
        rate
        for rate, row in rows.items()
        if row["p99_ms"]["median"] <= SLO_MS and row["ok_share"]["median"] >= MIN_OK_SHARE
    ]
    return max(good, default=0.0)


def ceiling(cells: Iterable[Mapping[str, Any]], target: str) -> float:
    """The largest served/s of any cell of ``target``."""
    return max((c["gen"]["served_per_s"] for c in cells if c["target"] == target), default=0.0)


def _within(value: float, ref: Mapping[str, float], factor: float = 1.05) -> tuple[bool, float]:
    """Whether ``value`` is at most max(factor x ref's median, ref's max): the bound too."""
    bound = max(factor * ref["median"], ref["max"])
    return value <= bound, bound


def checks(
    summary: Mapping[str, Mapping[float, Mapping[str, Any]]],
    cells: Sequence[Mapping[str, Any]],
    default: str,
    fixed: str,
    floor: str,
    old: str | None,
) -> list[tuple[str, bool, str]]:
    """The comparisons the harness exists for, each (what, held, the figures)."""
    out: list[tuple[str, bool, str]] = []
    ceil = {t: ceiling(cells, t) for t in summary}
    if default in summary and fixed in summary:
        limit = 0.9 * ceil[fixed]
        for rate, row in summary[default].items():
            ref = summary[fixed].get(rate)
            if ref is None or rate > limit:
                continue
            for key, what in (("p99_ms", "p99 ms"), ("server_us", "server CPU us/req")):
                value = row[key]["median"]
                ok, bound = _within(value, ref[key])
                out.append(
                    (
                        f"{rate:g}/s: default {what} <= fixed's bound",
                        ok,
                        f"{value:.1f} vs {bound:.1f}",
                    )
                )
    if default in summary and floor in summary:
        g_def, g_floor = goodput(summary[default]), goodput(summary[floor])
        out.append(
            (
                "goodput default >= 0.8x floor",
                g_def >= 0.8 * g_floor,
                f"{g_def:g} vs 0.8x{g_floor:g}",
            )
        )
        out.append(
            (
                "ceiling default >= 0.8x floor",
                ceil[default] >= 0.8 * ceil[floor],
                f"{ceil[default]:.0f} vs 0.8x{ceil[floor]:.0f}",
            )
        )
    if old is not None and default in summary and old in summary:
        out.append(
            (
                f"ceiling default >= {old}",
                ceil[default] >= ceil[old],
                f"{ceil[default]:.0f} vs {ceil[old]:.0f}",
            )
        )
    return out


def _ms(stat: Mapping[str, float], spread: bool = True) -> str:
    if math.isnan(stat["median"]):
        return "-"
    text = f"{stat['median']:.1f}"
    return f"{text} ({stat['min']:.1f}-{stat['max']:.1f})" if spread else text


def markdown(
    summary: Mapping[str, Mapping[float, Mapping[str, Any]]], cells: Sequence[Mapping[str, Any]]
) -> str:
    """The per-target, per-rate table (medians over passes, spreads in brackets), then
    goodput, ceiling and the CPU-bound rate of each target."""
    head = (
        "| target | offered/s | served/s | ok (errors, all passes) | p50 ms | p99 ms (min-max) "
        "| mean batch | server us/req (min-max) | per process us/req | generator us/req "
        "| server cores |"
    )
    lines = [head, "|" + "---|" * 11]
    for target, rows in summary.items():
        for rate, row in rows.items():
            roles = ", ".join(f"{r} {s['median']:.0f}" for r, s in row["roles_us"].items())
            flag = " (void)" if row["void"] else ""
            errs = ", ".join(f"{k} {v}" for k, v in sorted(row["errors"].items()))
            ok = f"{100 * row['ok_share']['median']:.1f}%" + (f" [{errs}]" if errs else "")
            lines.append(
                f"| {target} | {rate:,.0f}{flag} | {row['served_per_s']['median']:,.0f} | {ok} "
                f"| {_ms(row['p50_ms'], False)} | {_ms(row['p99_ms'])} "
                f"| {_ms(row['mean_batch'], False)} | {_ms(row['server_us'])} | {roles} "
                f"| {_ms(row['gen_us'], False)} | {row['server_cores']['median']:.2f} |"
            )
    lines += ["", "| target | goodput/s (p99 <= 50 ms) | ceiling served/s | CPU-bound rate/s |"]
    lines.append("|---|---|---|---|")
    for target, rows in summary.items():
        lines.append(
            f"| {target} | {goodput(rows):,.0f} | {ceiling(cells, target):,.0f} "
            f"| {cpu_bound_rate(rows):,.0f} |"
        )
    return "\n".join(lines)


def cpu_bound_rate(rows: Mapping[float, Mapping[str, Any]]) -> float:
    """The rate at which CORES cores would be spent on this target's processes and the
    generator alone, at the CPU per request of its highest rate (measured, per process)."""
    if not rows:
        return math.nan
    top = rows[max(rows)]
    per_request = top["server_us"]["median"] + top["gen_us"]["median"]
    return CORES * 1e6 / per_request if per_request > 0 else math.nan
