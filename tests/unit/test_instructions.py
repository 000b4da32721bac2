"""bench/instructions.py and bench/edge_profile.py: cells, arithmetic, output rows.

The scripts run valgrind or a tracer in git worktrees; only their pure parts are tested
here (the edge they count is tested with bench/hot_path.py in
tests/integration/test_bench_helpers.py).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench_scripts import BENCH, load_script


@pytest.fixture(scope="module")
def ins() -> Iterator[ModuleType]:
    """``bench/instructions.py``, its directory on the path (it imports compare_revs)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield load_script("instructions.py")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def edge() -> ModuleType:
    return load_script("edge_profile.py")


def test_by_default_both_policies_at_bursts_1_and_8_run_3_times_each(ins: ModuleType) -> None:
    args = ins.parser().parse_args(["482d38b", "main"])
    assert args.runs == 3
    assert ins.parse_cells(args.cells) == [
        (1, "carpool"),
        (8, "carpool"),
        (1, "fixed"),
        (8, "fixed"),
    ]


@pytest.mark.parametrize("text", ["8", "x:fixed", "0:fixed", "8:", "1:carpool,,8:fixed"])
def test_a_malformed_cell_is_refused(ins: ModuleType, text: str) -> None:
    with pytest.raises(ValueError, match="BURST:POLICY"):
        ins.parse_cells(text)


def test_the_total_is_callgrinds_summary_line(ins: ModuleType) -> None:
    text = "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 43476411\ntotals: 1\n"
    assert ins.summary_total(text) == 43_476_411
    with pytest.raises(ValueError, match="summary"):
        ins.summary_total("events: Ir\n")


def test_a_request_costs_the_difference_over_the_difference_of_counts(ins: ModuleType) -> None:
    # One-time costs (start, imports, warm-up) are in both totals and cancel.
    assert ins.per_request(5_000_000 + 1000 * 120, 5_000_000 + 3000 * 120, 1000, 3000) == 120


def test_a_cell_is_the_median_of_its_runs_and_keeps_every_run(ins: ModuleType) -> None:
    row = ins.cell_row(8, "fixed", {"base": [100.0, 104.0, 98.0], "head": [99.0, 90.0, 97.0]})
    assert row["base_runs"] == [100.0, 104.0, 98.0]
    assert row["head_runs"] == [99.0, 90.0, 97.0]
    assert (row["base"], row["head"]) == (100.0, 97.0)
    assert row["ratio"] == pytest.approx(0.97)
    assert (row["burst"], row["policy"]) == (8, "fixed")


def test_the_edge_profile_is_per_request_and_pairs_moved_functions(edge: ModuleType) -> None:
    small = [Counter({"a.py:f": 10, "a.py:g": 4}), Counter({"a.py:f": 1}), Counter()]
    large = [Counter({"a.py:f": 30, "a.py:g": 4, "b.py:h": 8}), Counter({"a.py:f": 3}), Counter()]
    profile = edge.per_request(small, large, 100, 300)
    # Work that does not grow with the requests (g) is not a request's.
    assert profile == {
        "ops": {"a.py:f": 0.1, "b.py:h": 0.04},
        "calls": {"a.py:f": 0.01},
        "ccalls": {},
    }
    assert edge.by_file(profile) == {"a.py": 0.1, "b.py": 0.04}
    base = {"ops": {"old.py:C.f": 1.0, "x.py:k": 1.0, "x.py:C.g": 1.0, "y.py:C.g": 1.0}}
    head = {"ops": {"new.py:C.f": 1.0, "x.py:k": 1.0, "z.py:C.g": 1.0}}
    # C.f moved (one of it at each revision); C.g is two at BASE, so it is not paired.
    assert edge.moved(base, head) == {"old.py:C.f": "new.py:C.f"}
