"""Fixtures of the broker's unit tests; the harness they build on is harness.py."""

from __future__ import annotations

import pytest

from tests.unit.broker.harness import Broker


@pytest.fixture
def broker() -> Broker:
    """A harness broker with the default knobs."""
    return Broker.make()
