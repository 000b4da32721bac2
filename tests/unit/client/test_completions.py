"""client/calls.py Completions: what Client.poll counts. The I/O thread adds, callers in
any threads look (each pops what it counts off a deque, so no two count it both)."""

from __future__ import annotations

import threading

from carpool.client.calls import Completions


def test_a_wait_returns_at_once_while_completions_wait_to_be_looked_at() -> None:
    completions = Completions()
    closing = threading.Event()
    completions.add(2)
    completions.wait(None, closing)  # returns: two wait to be looked at
    assert completions.look() == 2
    assert completions.look() == 0
    completions.wait(0, closing)  # nothing new: a zero wait returns too
