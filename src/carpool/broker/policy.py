"""policy.py: when a queue's batch leaves. Pure: never reads a clock or touches a socket.

A policy looks at one queue (its size, its oldest arrival) and the room a worker has for it,
and answers either ``Dispatch(max_samples)`` now or ``WaitUntil(t)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send a batch now, of at most ``max_samples`` samples."""

    max_samples: int


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """Nothing to do before monotonic time ``t``."""

    t: float


Decision = Dispatch | WaitUntil


@dataclass(frozen=True, slots=True)
class QueueView:
    """What a policy may know about a queue."""

    samples: int  # samples still queued
    oldest_arrival_s: float  # arrival of the oldest queued request


class BatchPolicy(Protocol):
    def decide(self, now: float, queue: QueueView, room: int) -> Decision:
        """Decide for one non-empty queue, given ``room`` samples on the best free worker."""
        ...


@dataclass(frozen=True, slots=True)
class FixedPolicy:
    """The minibus rule: leave when full (B_max) or when the oldest has waited T_max.

    ``room`` caps the batch at what the chosen worker accepts, so "full" means
    min(B_max, room). Waiting never outlives the oldest request's T_max.
    """

    max_batch: int
    max_wait_s: float

    def decide(self, now: float, queue: QueueView, room: int) -> Decision:
        limit = min(self.max_batch, room)
        if queue.samples >= limit:
            return Dispatch(limit)
        leave_at = queue.oldest_arrival_s + self.max_wait_s
        if now >= leave_at:
            return Dispatch(limit)
        return WaitUntil(leave_at)
