"""batcher.py: pending requests, grouped per (model, item shape), with deadlines.

Pure: ``now`` is passed in; no sockets, threads or clocks. Requests are plain records that
carry their payload frames untouched (the broker never looks inside a tensor).

Request lifecycle: QUEUED → DISPATCHED → DONE | EXPIRED | FAILED; a DISPATCHED request whose
worker vanished goes back to QUEUED (once) if its deadline still allows.
Queues hold references and skip records that left the QUEUED state lazily, so expiry and
dispatch never scan a queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

from carpool.common.protocol import Frame, Priority, TensorMeta

ClientId = NewType("ClientId", bytes)
RequestKey = tuple[str, tuple[tuple[str, str, tuple[int, ...]], ...]]


class RequestState(Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DONE = "done"
    EXPIRED = "expired"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class PendingRequest:
    """One client request held by the broker."""

    seq: int  # broker-wide arrival order, the FIFO tie-break
    client: ClientId
    # The client sent an empty delimiter frame (a REQ socket); replies must carry one too.
    delimited: bool
    request_id: int
    simple: bool
    model: str
    key: RequestKey
    samples: int
    priority: Priority
    arrival_s: float
    deadline_s: float
    inputs: tuple[TensorMeta, ...]
    payloads: Sequence[Frame]
    state: RequestState = RequestState.QUEUED
    attempts: int = 0

    def __lt__(self, other: PendingRequest) -> bool:
        return self.seq < other.seq


def request_key(model: str, inputs: Sequence[TensorMeta]) -> RequestKey:
    """Requests with equal keys may share a batch: same model, dtypes and item shapes."""
    return (model, tuple((t.name, t.dtype, t.shape[1:]) for t in inputs))


@dataclass(slots=True)
class RequestQueue:
    """FIFO of same-key requests; counts only requests still QUEUED."""

    key: RequestKey
    _items: deque[PendingRequest] = field(default_factory=deque)
    samples: int = 0
    count: int = 0

    def push(self, req: PendingRequest) -> None:
        self._items.append(req)
        self.samples += req.samples
        self.count += 1

    def push_front(self, req: PendingRequest) -> None:
        self._items.appendleft(req)
        self.samples += req.samples
        self.count += 1

    def forget(self, req: PendingRequest) -> None:
        """Account for a request that left QUEUED while still in the deque (lazy removal)."""
        self.samples -= req.samples
        self.count -= 1

    def _trim(self) -> None:
        items = self._items
        while items and items[0].state is not RequestState.QUEUED:
            items.popleft()

    def head(self) -> PendingRequest | None:
        """The oldest request still queued."""
        self._trim()
        return self._items[0] if self._items else None

    def take(self, max_samples: int) -> list[PendingRequest]:
        """Pop requests in FIFO order while their samples fit in ``max_samples``."""
        taken: list[PendingRequest] = []
        room = max_samples
        items = self._items
        while items:
            req = items[0]
            if req.state is not RequestState.QUEUED:
                items.popleft()
                continue
            if req.samples > room:
                break
            items.popleft()
            taken.append(req)
            room -= req.samples
        for req in taken:
            self.samples -= req.samples
            self.count -= 1
        return taken

    def __iter__(self) -> Iterator[PendingRequest]:
        return (r for r in self._items if r.state is RequestState.QUEUED)


class DeadlineHeap:
    """Every live request by deadline, queued or in flight; stale entries are skipped."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, PendingRequest]] = []

    def push(self, req: PendingRequest) -> None:
        heapq.heappush(self._heap, (req.deadline_s, req))

    def earliest(self) -> float | None:
        heap = self._heap
        while heap and heap[0][1].state not in (RequestState.QUEUED, RequestState.DISPATCHED):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_expired(self, now: float) -> list[PendingRequest]:
        """Remove and return live requests whose deadline is at or before ``now``."""
        out: list[PendingRequest] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, req = heapq.heappop(heap)
            if req.state in (RequestState.QUEUED, RequestState.DISPATCHED):
                out.append(req)
        return out

    def __len__(self) -> int:
        return len(self._heap)
