"""bench/compare_revs.py: the arithmetic of its ratios and the parsing of hot_path.py's output.

The script itself runs benchmarks in git worktrees; only its pure parts are tested here.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.bench_scripts import load_script

cr = load_script("compare_revs.py")

CORE_TEXT = """BrokerCore alone, deferred mode: us per request (mean batch size)
carpool  burst 1:   31.2 us (1.0)   burst 4:   18.5 us (3.9)   burst 8:   14.0 us (7.2)
fixed    burst 1:   29.9 us (1.0)   burst 4:   17.1 us (4.0)   burst 8:   12.8 us (8.0)
"""


def test_median_of_odd_and_even_counts() -> None:
    assert cr.median([3.0, 1.0, 2.0]) == 2.0
    assert cr.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert cr.median([7.0]) == 7.0
    assert math.isnan(cr.median([]))


def test_ratios_are_per_round_with_median_and_spread() -> None:
    s = cr.ratios([10.0, 20.0, 10.0, 10.0, 10.0], [11.0, 20.0, 9.0, 10.5, 12.0])
    assert s.per_round == pytest.approx((1.1, 1.0, 0.9, 1.05, 1.2))
    assert s.median == pytest.approx(1.05)
    assert (s.low, s.high) == pytest.approx((0.9, 1.2))
    assert s.to_json() == {
        "per_round": list(s.per_round),
        "median": s.median,
        "min": s.low,
        "max": s.high,
    }


def test_ratios_leave_out_a_round_without_a_base_figure() -> None:
    s = cr.ratios([0.0, 2.0], [5.0, 3.0])
    assert s.per_round == (1.5,)
    none = cr.ratios([0.0], [1.0])
    assert none.per_round == ()
    assert math.isnan(none.median)


def test_ratios_refuse_unequal_round_counts() -> None:
    with pytest.raises(ValueError, match="2 BASE rounds against 1 HEAD"):
        cr.ratios([1.0, 2.0], [1.0])


def test_verdicts_hold_each_gated_setting_to_the_threshold() -> None:
    summaries = {
        "core carpool burst 1": cr.ratios([10.0], [10.4]),
        "core fixed burst 8": cr.ratios([10.0], [10.6]),
        "worker median": cr.ratios([10.0], [20.0]),  # reported, not gated
        "empty": cr.ratios([0.0], [1.0]),  # NaN: fails
    }
    assert cr.verdicts(summaries, 1.05) == {
        "core carpool burst 1": True,
        "core fixed burst 8": False,
        "empty": False,
    }


def test_rounds_alternate_which_revision_goes_first() -> None:
    assert [cr.order(i) for i in range(3)] == [
        ("base", "head"),
        ("head", "base"),
        ("base", "head"),
    ]


def test_core_table_is_parsed_by_policy_and_burst() -> None:
    assert cr.parse_core(CORE_TEXT) == {
        "core carpool burst 1": 31.2,
        "core carpool burst 4": 18.5,
        "core carpool burst 8": 14.0,
        "core fixed burst 1": 29.9,
        "core fixed burst 4": 17.1,
        "core fixed burst 8": 12.8,
    }


def test_core_json_is_preferred_to_the_table() -> None:
    rows = [
        {"policy": "carpool", "burst": 1, "us_per_request": 30.5, "mean_batch": 1.0},
        {"policy": "fixed", "burst": 8, "us_per_request": 12.25, "mean_batch": 8.0},
    ]
    text = "a log line\n" + json.dumps({"mode": "core", "rows": rows}) + "\n"
    assert cr.parse_core(text) == {"core carpool burst 1": 30.5, "core fixed burst 8": 12.25}


def test_core_output_without_figures_is_an_error() -> None:
    with pytest.raises(ValueError, match="no 'burst K"):
        cr.parse_core("Traceback (most recent call last):\n")


def test_floor_line_and_json_are_parsed() -> None:
    text = "worker stepped in-process under a ROUTER, batches of 8: floor 41.3 us per batch, "
    text += "median 45.0 (chunks of 500)\n"
    assert cr.parse_floor(text, "worker") == {"worker floor": 41.3, "worker median": 45.0}
    line = json.dumps({"mode": "client", "unit": "request", "floor_us": 9.5, "median_us": 10.0})
    assert cr.parse_floor(line, "client") == {"client floor": 9.5, "client median": 10.0}
    with pytest.raises(ValueError, match="no 'floor"):
        cr.parse_floor("nothing\n", "client")


def test_zero_copy_ratio_is_the_brokers() -> None:
    assert cr.zero_copy_ratio({"ratio": {"broker": 1.21, "relay": 1.9}}) == 1.21


def test_report_has_a_row_per_setting_with_its_verdict() -> None:
    base = {"core carpool burst 1": [10.0, 10.0], "worker median": [5.0, 5.0]}
    head = {"core carpool burst 1": [12.0, 11.0], "worker median": [5.0, 5.0]}
    summaries = {k: cr.ratios(base[k], head[k]) for k in base}
    lines = cr.report_lines(base, head, summaries, 1.05)
    assert lines[0].split()[:4] == ["setting", "BASE", "us", "HEAD"]
    row = "core carpool burst 1 10.00 11.50 1.150 1.100-1.200 OVER 1.05"
    assert lines[1].split() == row.split()
    assert lines[2].split() == ["worker", "median", "5.00", "5.00", "1.000", "1.000-1.000"]
