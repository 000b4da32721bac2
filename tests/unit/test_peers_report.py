"""bench/peers/report.py: medians over passes, goodput, ceilings and the checks.

The harness (bench/policy_live.py) loads live servers; only its pure report is tested here.
"""

from __future__ import annotations

import math
from typing import Any

from tests.bench_scripts import load_script

rp = load_script("peers/report.py")


def cell(target: str, rate: float, p99: float | None, **kw: Any) -> dict[str, Any]:
    served = kw.get("served", rate)
    ok_share = kw.get("ok_share", 1.0)
    return {
        "target": target,
        "rate": rate,
        "gen": {
            "p50_ms": None if p99 is None else p99 / 2,
            "p99_ms": p99,
            "served_per_s": served,
            "ok_share": ok_share,
            "errors": kw.get("errors", {}),
            "cpu_us_per_request": 100.0,
            "cores": 0.2,
            "void": kw.get("void", False),
        },
        "server_us": kw.get("server_us", 400.0),
        "roles_us": {"broker": 150.0, "worker": kw.get("server_us", 400.0) - 150.0},
        "server_cores": 0.9,
        "mean_batch": kw.get("mean_batch", 8.0),
    }


def test_each_figure_is_the_median_over_passes_with_its_spread() -> None:
    cells = [cell("a", 1000, p) for p in (10.0, 30.0, 20.0)]
    cells[0]["gen"]["errors"] = {"DEADLINE_EXCEEDED": 2}
    cells[1]["gen"]["errors"] = {"DEADLINE_EXCEEDED": 1}
    row = rp.summarise(cells)["a"][1000.0]
    assert row["passes"] == 3
    assert row["p99_ms"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert row["errors"] == {"DEADLINE_EXCEEDED": 3}
    assert row["roles_us"]["broker"]["median"] == 150.0


def test_a_cell_without_answers_has_no_latency() -> None:
    row = rp.summarise([cell("a", 1000, None, ok_share=0.0)])["a"][1000.0]
    assert math.isnan(row["p99_ms"]["median"])
    assert rp.goodput({1000.0: row}) == 0.0


def test_goodput_is_the_highest_rate_within_the_objective_and_answered() -> None:
    cells = [
        cell("a", 1000, 10.0),
        cell("a", 2000, 40.0),
        cell("a", 3000, 49.0, ok_share=0.95),  # too few answered
        cell("a", 4000, 80.0),
    ]
    assert rp.goodput(rp.summarise(cells)["a"]) == 2000.0


def test_the_ceiling_is_the_largest_served_rate_of_any_cell() -> None:
    cells = [cell("a", 3000, 500.0, served=2800), cell("a", 4000, 900.0, served=2900)]
    assert rp.ceiling(cells, "a") == 2900
    assert rp.ceiling(cells, "b") == 0.0


def test_default_is_held_to_the_larger_of_105_percent_and_fixeds_spread() -> None:
    cells = [
        *(cell("carpool-fixed", 1000, p, server_us=400.0) for p in (10.0, 20.0, 30.0)),
        *(cell("carpool-default", 1000, p, server_us=430.0) for p in (28.0, 29.0, 29.5)),
        *(cell("carpool-fixed", 2000, p, server_us=400.0) for p in (20.0, 21.0, 22.0)),
        *(cell("carpool-default", 2000, p, server_us=300.0) for p in (23.0, 23.0, 23.0)),
        *(cell("greedy", r, 5.0) for r in (1000, 2000)),
        cell("carpool-fixed", 3000, 40.0),  # fixed's ceiling: 2000/s is within 0.9x of it
    ]
    summary = rp.summarise(cells)
    found = {what: held for what, held, _ in rp.checks(summary, cells, *_NAMES, None)}
    assert found["1000/s: default p99 ms <= fixed's bound"]  # within fixed's spread (30)
    assert found["1000/s: default server CPU us/req <= fixed's bound"] is False  # 430 > 420
    assert found["2000/s: default p99 ms <= fixed's bound"] is False  # 23 > max(22.05, 22)
    assert found["2000/s: default server CPU us/req <= fixed's bound"]
    assert found["goodput default >= 0.8x floor"]


def test_rates_past_09_of_fixeds_ceiling_are_not_compared() -> None:
    cells = [
        cell("carpool-fixed", 1000, 10.0),
        cell("carpool-fixed", 3000, 900.0, served=2000),
        cell("carpool-default", 1000, 10.0),
        cell("carpool-default", 3000, 990.0, served=2000),
    ]
    found = [what for what, _, _ in rp.checks(rp.summarise(cells), cells, *_NAMES, None)]
    assert not any(w.startswith("3000/s") for w in found)
    assert any(w.startswith("1000/s") for w in found)


def test_the_old_revisions_ceiling_is_checked_when_it_ran() -> None:
    cells = [cell("carpool-default", 3000, 20.0, served=2900), cell("old", 3000, 20, served=2950)]
    found = rp.checks(rp.summarise(cells), cells, *_NAMES, "old")
    assert ("ceiling default >= old", False, "2900 vs 2950") in found


def test_the_table_has_a_row_per_target_and_rate() -> None:
    cells = [cell("a", 1000, 10.0), cell("a", 2000, 20.0, void=True), cell("b", 1000, 5.0)]
    text = rp.markdown(rp.summarise(cells), cells)
    assert text.count("\n| a | ") == 3  # two rates, and its goodput row
    assert "2,000 (void)" in text


_NAMES = ("carpool-default", "carpool-fixed", "greedy")
