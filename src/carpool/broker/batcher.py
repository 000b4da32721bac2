"""batcher.py: pending requests, grouped per (model, item shape), with deadlines.

Pure: ``now`` is passed in; no sockets, threads or clocks. Requests are plain records that
carry their payload frames untouched (the broker never looks inside a tensor).

The request records and their lifecycle are :mod:`carpool.broker.requests`; a queue reads
their state and reports the requests that leave it to the mover it is given, never
setting a state itself.

A queue keeps three lazy views of the same requests: arrival order (FIFO, and the oldest
arrival for T_max), and one earliest-deadline-first heap per priority. Records that left
QUEUED are skipped when met, so expiry and dispatch never scan a queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from heapq import heappop

from carpool.broker.requests import (
    LIVE,
    ClientId,
    PendingRequest,
    RequestKey,
    RequestState,
)
from carpool.common.protocol import TensorMeta

__all__ = [
    "BatchTally",
    "ClientId",
    "DeadlineHeap",
    "Mover",
    "PendingRequest",
    "Rank",
    "RequestKey",
    "RequestQueue",
    "RequestState",
    "request_key",
]

#: What moves a request's state (:meth:`carpool.broker.requests.RequestBook.move`): the
#: queue reports the requests that leave it, and never sets a state itself.
Mover = Callable[[PendingRequest, RequestState], None]

#: :data:`~carpool.broker.requests.LIVE` as a tuple: a test of a state against it compares
#: identities, where the frozenset hashes the Enum (Python code).
#: speed: docs/benchmarks.md "Why the hot path looks as it does"
_LIVE = tuple(LIVE)
# Enum members as globals, for speed: docs/benchmarks.md "Why the hot path looks as it does".
_QUEUED, _DISPATCHED, _EXPIRED = (
    RequestState.QUEUED,
    RequestState.DISPATCHED,
    RequestState.EXPIRED,
)


def request_key(model: str, inputs: Sequence[TensorMeta]) -> RequestKey:
    """Requests with equal keys may share a batch: same model, dtypes and item shapes."""
    return (model, tuple((t.name, t.dtype, t.shape[1:]) for t in inputs))


_Entry = tuple[float, int, PendingRequest]  # (deadline, seq, request)
#: A queue's entry in its model's urgency index (:mod:`carpool.broker.urgency`), per
#: priority: the (deadline, seq) of the head it was indexed with, a tie-break, the queue.
Rank = tuple[float, int, int, "RequestQueue"]


def _live_head(heap: list[_Entry]) -> PendingRequest | None:
    while heap and heap[0][2].state is not _QUEUED:
        heapq.heappop(heap)
    return heap[0][2] if heap else None


class BatchTally:
    """A queue's samples by priority and the batches counted for them in units of ``unit``
    samples (of its interactive samples, of all), summed in its model's ``totals``: the
    backlog's count (:meth:`carpool.broker.backlog.Backlog.ahead`), kept on the queue so
    that a request costs no lookup."""

    __slots__ = ("bulk", "every", "first", "interactive", "totals", "unit")

    def __init__(self, unit: int, totals: list[int]) -> None:
        self.unit = unit
        self.totals = totals
        self.interactive = self.bulk = self.first = self.every = 0

    def add(self, interactive: int, bulk: int) -> None:
        """Samples joined (or, negative, left) the key's queue: recount its batches."""
        self.interactive = mine = self.interactive + interactive
        self.bulk += bulk
        unit, totals = self.unit, self.totals
        first = -(-mine // unit)
        every = -(-(mine + self.bulk) // unit)
        totals[0] += first - self.first
        totals[1] += every - self.every
        self.first = first
        self.every = every

    def recount(self) -> None:
        """Count again (its ``unit`` changed)."""
        self.add(0, 0)


@dataclass(slots=True)
class RequestQueue:
    """Same-key requests; counts only requests still QUEUED."""

    key: RequestKey
    _arrivals: deque[PendingRequest] = field(default_factory=deque)
    _heaps: tuple[list[_Entry], list[_Entry]] = field(default_factory=lambda: ([], []))
    samples: int = 0
    count: int = 0
    # Recent arrivals (time, samples) over a long and a short window, with their sums.
    _long: deque[tuple[float, int]] = field(default_factory=deque)
    _short: deque[tuple[float, int]] = field(default_factory=deque)
    _long_samples: int = 0
    _short_samples: int = 0
    # Its current entries in the urgency index, interactive and bulk (that index's own).
    ranks: list[Rank | None] = field(default_factory=lambda: [None, None])
    # What the backlog counts of it (None until a request joins).
    tally: BatchTally | None = None

    #: Windows of the arrival rate: the long one is steady, the short one sees a burst.
    LONG_WINDOW_S = 1.0
    SHORT_WINDOW_S = 0.1

    def note_arrival(self, now: float, samples: int) -> None:
        """Count a new arrival for :meth:`arrival_sps`."""
        self._long.append((now, samples))
        self._short.append((now, samples))
        self._long_samples += samples
        self._short_samples += samples

    def arrival_sps(self, now: float) -> float:
        """Samples per second arriving: the larger of the last second's and the last
        100 ms's rate (fast to rise at a burst, slow to fall after it)."""
        long_, short = self._long, self._short
        while long_ and long_[0][0] < now - self.LONG_WINDOW_S:
            self._long_samples -= long_.popleft()[1]
        while short and short[0][0] < now - self.SHORT_WINDOW_S:
            self._short_samples -= short.popleft()[1]
        steady = self._long_samples / self.LONG_WINDOW_S
        burst = self._short_samples / self.SHORT_WINDOW_S
        # (max, as an expression) speed: docs/benchmarks.md "Why the hot path looks as it does"
        return burst if burst > steady else steady

    def _index(self, req: PendingRequest) -> list[_Entry]:
        return self._heaps[req.priority]

    def push(self, req: PendingRequest) -> None:
        self._arrivals.append(req)
        self._index_in(req)

    def arrive(self, req: PendingRequest) -> None:
        """:meth:`push` a new request and :meth:`note_arrival` it (at its arrival time):
        both in one call, as every request comes this way."""
        self._arrivals.append(req)
        heapq.heappush(self._heaps[req.priority], (req.deadline_s, req.seq, req))
        samples = req.samples
        self.samples += samples
        self.count += 1
        arrival = (req.arrival_s, samples)
        self._long.append(arrival)
        self._short.append(arrival)
        self._long_samples += samples
        self._short_samples += samples

    def push_front(self, req: PendingRequest) -> None:
        """Put back a request that was dispatched before (it keeps its arrival time)."""
        self._arrivals.appendleft(req)
        self._index_in(req)

    def _index_in(self, req: PendingRequest) -> None:
        heapq.heappush(self._index(req), (req.deadline_s, req.seq, req))
        self.samples += req.samples
        self.count += 1

    def forget(self, req: PendingRequest) -> None:
        """Account for a request that left QUEUED while still indexed (lazy removal)."""
        self.samples -= req.samples
        self.count -= 1
        self._compact()

    def head(self) -> PendingRequest | None:
        """The oldest request still queued (arrival order)."""
        items = self._arrivals
        while items and items[0].state is not _QUEUED:
            items.popleft()
        return items[0] if items else None

    def head_of(self, priority: int) -> PendingRequest | None:
        """The queued request of ``priority`` (0 interactive, 1 bulk) with the earliest
        deadline."""
        return _live_head(self._heaps[priority])

    def earliest_deadline(self) -> PendingRequest | None:
        """The queued request with the earliest deadline, any priority."""
        # (_live_head, inlined) speed: docs/benchmarks.md "Why the hot path looks as it does"
        heap, bulk_heap = self._heaps
        while heap and heap[0][2].state is not _QUEUED:
            heappop(heap)
        while bulk_heap and bulk_heap[0][2].state is not _QUEUED:
            heappop(bulk_heap)
        interactive = heap[0][2] if heap else None
        bulk = bulk_heap[0][2] if bulk_heap else None
        if interactive is None or bulk is None:
            return bulk if interactive is None else interactive
        if (bulk.deadline_s, bulk.seq) < (interactive.deadline_s, interactive.seq):
            return bulk
        return interactive

    def next_edf(self, now: float, promote_before_s: float) -> PendingRequest | None:
        """The request EDF-with-priorities would serve next.

        Interactive requests go first, earliest deadline first; a bulk request goes first
        once its deadline is within ``promote_before_s`` of ``now`` (so bulk requests that
        still have slack are not starved), and whenever no interactive request waits.
        """
        # (_live_head, inlined) speed: docs/benchmarks.md "Why the hot path looks as it does"
        heap, bulk_heap = self._heaps
        while heap and heap[0][2].state is not _QUEUED:
            heappop(heap)
        while bulk_heap and bulk_heap[0][2].state is not _QUEUED:
            heappop(bulk_heap)
        interactive = heap[0][2] if heap else None
        bulk = bulk_heap[0][2] if bulk_heap else None
        if bulk is not None and (interactive is None or bulk.deadline_s <= now + promote_before_s):
            if interactive is not None and interactive.deadline_s < bulk.deadline_s:
                return interactive  # both urgent: plain EDF between them
            return bulk
        return interactive

    def take(self, max_samples: int, move: Mover) -> list[PendingRequest]:
        """Pop requests in arrival (FIFO) order while their samples fit in ``max_samples``;
        each is moved to DISPATCHED."""
        taken: list[PendingRequest] = []
        room = max_samples
        items = self._arrivals
        while items:
            req = items[0]
            if req.state is not _QUEUED:
                items.popleft()
                continue
            if req.samples > room:
                break
            items.popleft()
            move(req, _DISPATCHED)
            taken.append(req)
            room -= req.samples
        self._taken(len(taken), max_samples - room)
        return taken

    def take_edf(
        self, max_samples: int, now: float, promote_before_s: float, move: Mover
    ) -> list[PendingRequest]:
        """Pop requests in EDF-with-priorities order while their samples fit; each is
        moved to DISPATCHED as it is popped, so next_edf moves on."""
        taken: list[PendingRequest] = []
        room = max_samples
        heaps = self._heaps
        while (req := self.next_edf(now, promote_before_s)) is not None:
            if req.samples > room:
                break
            heappop(heaps[req.priority])
            move(req, _DISPATCHED)
            taken.append(req)
            room -= req.samples
        self._taken(len(taken), max_samples - room)
        return taken

    def shed(self, before_s: float, move: Mover) -> list[PendingRequest]:
        """Pop every queued request whose deadline is at or before ``before_s`` (no slack
        left is hopeless; ``<=`` also makes a wake-up announced for that moment act); each
        is moved to EXPIRED, and the caller answers it."""
        out: list[PendingRequest] = []
        for heap in self._heaps:
            # (_live_head, inlined) speed: docs/benchmarks.md "Why the hot path looks as it does"
            while heap:
                req = heap[0][2]
                if req.state is not _QUEUED:  # (it left before: skipped)
                    heappop(heap)
                elif req.deadline_s <= before_s:
                    heappop(heap)
                    move(req, _EXPIRED)
                    out.append(req)
                    self.samples -= req.samples
                    self.count -= 1
                else:
                    break
        if out:  # once, with all of them marked (per request, a full queue shed would be n²)
            self._compact()
        return out

    def _taken(self, count: int, samples: int) -> None:
        self.samples -= samples
        self.count = left = self.count - count
        # (_compact's test, inlined) speed: docs/benchmarks.md "Why the hot path looks as it does"
        bound = 2 * left + 64
        heap, bulk_heap = self._heaps
        if len(self._arrivals) > bound or len(heap) > bound or len(bulk_heap) > bound:
            self._compact()

    def _compact(self) -> None:
        """Drop the records that left QUEUED once they dominate a view. Removal is lazy, and
        each view is trimmed only where it is read: FIFO takes never pop the deadline heaps,
        EDF takes leave the arrival order behind a request that stays (a bulk one that
        interactive ones overtake), and requests that expire while no worker is free leave
        both. Rebuilt at twice the live size, each costs O(1) per request amortized."""
        bound = 2 * self.count + 64
        if len(self._arrivals) > bound:
            self._arrivals = deque(r for r in self._arrivals if r.state is _QUEUED)
        for heap in self._heaps:
            if len(heap) > bound:
                live = [e for e in heap if e[2].state is _QUEUED]
                heapq.heapify(live)
                heap[:] = live

    def __iter__(self) -> Iterator[PendingRequest]:
        """Each queued request once, in arrival order. (The arrival order may hold a
        request twice: an EDF take leaves its entry behind, and a lost worker's requeue
        pushes it to the front again.)"""
        seen: set[int] = set()
        for r in self._arrivals:
            if r.state is _QUEUED and id(r) not in seen:
                seen.add(id(r))
                yield r


class DeadlineHeap:
    """Every live request by deadline, queued or in flight; stale entries are skipped.

    Answered requests leave their entries behind (lazy deletion). So that a fast stream
    of requests with long deadlines does not grow the heap by the deadline × the rate
    (10 s × 8,000/s is 80,000 entries, each pushed through a deep heap and popped again
    at its deadline), the heap drops dead entries once they are half of it.
    """

    #: Size below which the heap is never compacted.
    MIN_COMPACT = 1024

    def __init__(self) -> None:
        #: (deadline, request) entries, a heap: the earliest first (read outside this
        #: class, and pushed onto by Backlog.add, which inlines :meth:`push`).
        self.entries: list[tuple[float, PendingRequest]] = []
        #: The size at which :meth:`compact` is due (read by a push).
        self.compact_at = self.MIN_COMPACT

    def push(self, req: PendingRequest) -> None:
        heap = self.entries
        heapq.heappush(heap, (req.deadline_s, req))
        if len(heap) >= self.compact_at:
            self.compact()

    def compact(self) -> None:
        """Drop the dead entries; the next compaction is due at twice the live size."""
        heap = self.entries
        live = [e for e in heap if e[1].state in _LIVE]
        heapq.heapify(live)
        heap[:] = live
        self.compact_at = max(self.MIN_COMPACT, 2 * len(live))

    def earliest(self) -> float | None:
        heap = self.entries
        while heap and heap[0][1].state not in _LIVE:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_expired(self, now: float) -> list[PendingRequest]:
        """Remove and return live requests whose deadline is at or before ``now``."""
        out: list[PendingRequest] = []
        heap = self.entries
        while heap and heap[0][0] <= now:
            _, req = heapq.heappop(heap)
            if req.state in _LIVE:
                out.append(req)
        return out

    def __len__(self) -> int:
        return len(self.entries)
