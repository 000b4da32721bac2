"""bench/instructions.py: its cells, its arithmetic and its output rows.

The script runs valgrind in git worktrees; only its pure parts are tested here (the edge
it counts is tested with bench/hot_path.py in tests/integration/test_bench_helpers.py).
"""

from __future__ import annotations

import sys
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
