"""The suite as a whole makes every request state transition of the table, and no other.

The record, installed when pytest configures (tests/conftest.py), holds every move any
RequestBook made in the run and every move one refused: a refused move raises
IllegalTransition, which the broker code that asked for it may catch, so the record
counts it before it propagates. This check runs after every other test, and only when the
whole tests/ tree was collected; a subset cannot be expected to make every transition.
"""

from __future__ import annotations

import pytest

from carpool.broker.requests import TRANSITIONS
from tests.conftest import transition_record, whole_suite_collected


@pytest.mark.suite_last
def test_the_suite_uses_each_row_of_the_transition_table_and_nothing_else(
    pytestconfig: pytest.Config,
) -> None:
    if not whole_suite_collected(pytestconfig):
        pytest.skip("the transition coverage holds only for a run of the whole tests/ tree")
    record = transition_record(pytestconfig)
    seen, asked = set(record.seen), set(record.seen) | set(record.refused)
    outside = sorted(f"{frm.name} -> {to.name}" for frm, to in asked - set(TRANSITIONS))
    unused = sorted(f"{frm.name} -> {to.name}" for frm, to in set(TRANSITIONS) - seen)
    assert outside == [], "moves the table does not hold (made, or asked for and refused)"
    assert unused == [], "rows of the table no test exercised"
