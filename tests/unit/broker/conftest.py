"""Fixtures of the broker's unit tests; the harness they build on is harness.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.broker import harness
from tests.unit.broker.harness import Broker


@pytest.fixture(params=[False, True], ids=["immediate", "deferred"])
def pump_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run a test twice: each message pumps at once, or (as in the server) the core defers
    pumping and the harness ends each message's turn with ``on_tick``. Cores made outside
    this fixture pump at once."""
    harness.DEFER_PUMPS[0] = request.param
    yield
    harness.DEFER_PUMPS[0] = False


@pytest.fixture
def broker(pump_mode: None) -> Broker:
    """A harness broker with the default knobs, in the test's pump mode."""
    return Broker.make()
