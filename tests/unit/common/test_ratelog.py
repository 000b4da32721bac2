"""ratelog.py: lines a peer can cause are written at most per_min a minute."""

from __future__ import annotations

import logging

import pytest

from carpool.common.ratelog import RateLimitedLog
from carpool.common.testing import FakeClock

LOGGER = logging.getLogger("carpool.test.ratelog")


def test_at_most_per_min_lines_a_minute_then_the_count_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    log = RateLimitedLog(LOGGER, 3, clock=clock)
    with caplog.at_level(logging.WARNING, LOGGER.name):
        for _ in range(1000):
            log("key %s refused", "k")
        assert len(caplog.records) == 3
        clock.advance(60.0)
        log("key %s refused", "k")
    assert len(caplog.records) == 4
    assert caplog.records[-1].getMessage() == "key k refused (997 more like it not logged)"
    assert log.total == 1001
    assert log.suppressed == 0


def test_a_pure_caller_passes_its_own_clock_reading(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(LOGGER, 1, level=logging.INFO)
    with caplog.at_level(logging.INFO, LOGGER.name):
        log("one", now=100.0)
        log("two", now=130.0)  # same minute: left out
        log("three", now=160.0)
    assert [r.getMessage() for r in caplog.records] == ["one", "three (1 more like it not logged)"]
    assert {r.levelno for r in caplog.records} == {logging.INFO}
