"""A broker process stopped and started again under load loses no request of a client
that follows protocol.md §11 (a raw DEALER written from the document, and the SDK):
5 stops at 1,000 requests/s (500 unanswered a client at most), each of a broker that
serves (it answered 100 results to each client), 1,200 requests a client at least; the
run waits for events (a hang guard of 60 s each), never a wall-clock window. Counts
only (bench/stop_load.py runs the same, and a client that ignores the rule as well)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(180)

BENCH = Path(__file__).resolve().parents[2] / "bench"
SENT = 1200


@pytest.fixture(scope="module")
def stop_load() -> Iterator[ModuleType]:
    """``bench/stop_load.py``, imported as the scripts import their helpers."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("stop_load")
    finally:
        sys.path.remove(str(BENCH))


def test_clients_that_follow_the_rule_lose_nothing_to_five_stops(stop_load: ModuleType) -> None:
    counts = stop_load.run_stops(
        rounds=5,
        rate_rps=1000.0,
        per_round=100,
        min_sent=SENT,
        window=500,
        kinds=("follows", "sdk"),
    )
    assert len(counts["stops"]) == 5
    for stop in counts["stops"]:
        assert stop["lost"] == {"follows": 0, "sdk": 0}, counts
    assert counts["lost_after_last_stop"] == {"follows": 0, "sdk": 0}, counts
    for kind in ("follows", "sdk"):
        assert counts["sent"][kind] >= SENT
        # (the raw client sends again a request refused OVERLOADED: one result each)
        assert counts["answers"][kind]["result"] == counts["sent"][kind], counts
    # Each request is answered once: no answer for one answered already.
    assert "late or unknown" not in counts["answers"]["follows"], counts
