"""fleet.py: what ``carpool status`` and ``carpool top`` show, from one STATS reply.

Pure: a STATS map in (docs/protocol.md §6.4: ``models``, ``workers``, the counters), the
fleet's verdict and its tables out, as plain rows of text that a terminal draws with
rich and a pipe gets as aligned columns. No sockets here (:mod:`carpool.ops.status`
asks the broker).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: ``carpool status``'s exit codes.
HEALTHY, NO_WORKER, UNREACHABLE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def problems(stats: Mapping[str, Any]) -> list[str]:
    """Why the fleet is not healthy: a model (served before, or named in the broker's
    configuration) that no live worker serves, or no live worker at all."""
    found = [
        f"model {name}: no live worker serves it"
        for name, row in sorted(stats.get("models", {}).items())
        if row["workers"] == 0
    ]
    if not stats.get("workers"):
        found.append("no worker is registered with the broker")
    return found


def verdict(stats: Mapping[str, Any]) -> int:
    """``carpool status``'s exit code for a broker that answered."""
    return NO_WORKER if problems(stats) else HEALTHY


def rates(
    before: Mapping[str, Any] | None, after: Mapping[str, Any], elapsed_s: float
) -> dict[str, float]:
    """Answers per second per model between two STATS replies ``elapsed_s`` apart."""
    if before is None or elapsed_s <= 0:
        return {}
    old = before.get("models", {})
    return {
        name: max(0, row["answered"] - old[name]["answered"]) / elapsed_s
        for name, row in after.get("models", {}).items()
        if name in old
    }


def summary(stats: Mapping[str, Any]) -> str:
    errors = sum(stats.get("errors", {}).values())
    return (
        f"requests {stats['requests']}  replies {stats['replies']}  errors {errors}  "
        f"queued {stats['queued']}  in flight {stats['inflight_batches']}  "
        f"shed {stats['shed']}  workers {len(stats['workers'])}"
    )


def tables(stats: Mapping[str, Any], per_s: Mapping[str, float] | None = None) -> list[Table]:
    """The models table and the workers table; ``per_s``: answers per second by model
    (``carpool top``), shown as a column when given."""
    model_headers: tuple[str, ...] = ("model", "workers", "B_max", "T_max ms", "queued")
    model_headers += ("answered",)
    model_headers += ("req/s",) if per_s is not None else ()
    model_headers += ("errors", "p50 ms", "p95 ms", "p99 ms")
    model_rows = []
    bound_by = stats.get("max_batch_bound_by", {})  # which limit binds B_max (§6.4)
    for name, row in sorted(stats.get("models", {}).items()):
        latency = row.get("latency") or {}
        cells = [
            name,
            f"{row['healthy_workers']}/{row['workers']}",
            _bound(row["b_max"], bound_by.get(name)),
            f"{row['max_wait_ms']:g}",
            str(row["queued"]),
            str(row["answered"]),
        ]
        if per_s is not None:
            cells.append(f"{per_s.get(name, 0.0):.1f}")
        cells.append(_errors(row["errors"]))
        cells += [_ms(latency.get(f"p{q}_ms")) for q in (50, 95, 99)]
        model_rows.append(tuple(cells))
    worker_headers = ("worker", "transport", "health", "slots", "in flight", "rho", "B_max")
    worker_rows = [
        (
            w["name"],
            w["transport"],
            w["health"],
            str(w["slots"]),
            str(w["outstanding"]),
            f"{w['rho']:.2f}",
            " ".join(
                f"{m}={_bound(lane['b_max'], lane.get('max_batch_bound_by'))}"
                for m, lane in sorted(w["lanes"].items())
            ),
        )
        for w in stats.get("workers", [])
    ]
    return [
        Table("models", model_headers, tuple(model_rows)),
        Table("workers", worker_headers, tuple(worker_rows)),
    ]


def _bound(b_max: int, by: str | None) -> str:
    """A B_max with the limit that binds it: ``16 (broker)``, ``8 (worker)``."""
    return f"{b_max} ({by})" if by else str(b_max)


def _errors(errors: Mapping[str, int]) -> str:
    return " ".join(f"{code.lower()}={n}" for code, n in sorted(errors.items())) or "0"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def plain(lines: Sequence[str], blocks: Sequence[Table]) -> str:
    """Text for a pipe: ``lines``, then each table as aligned columns."""
    out = list(lines)
    for table in blocks:
        out.append("")
        out.append(f"{table.title}:")
        grid = [table.headers, *table.rows]
        widths = [max(len(r[i]) for r in grid) for i in range(len(table.headers))]
        out += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in grid
        ]
        if not table.rows:
            out.append("(none)")
    return "\n".join(out) + "\n"
