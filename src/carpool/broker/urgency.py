"""urgency.py: QueueOrder — the queues of each model, in the order a free slot is
offered to them.

Pure: no clock, sockets or threads; ``now`` comes in. A model has a queue per request
key (an item shape, or a bucket), and its workers' slots are shared by all of them: a
slot goes to the most urgent queue first. Urgency is read between queues as EDF with
priorities reads it within one (:meth:`RequestQueue.next_edf
<carpool.broker.batcher.RequestQueue.next_edf>`): queues by the deadline of their
most urgent interactive request; a queue whose most urgent request is bulk comes after
them, unless that deadline is within the promotion window and no later than theirs.

Per model, two heaps of queue heads (interactive, bulk), each entry (deadline, seq,
tie-break, queue), and each queue's current entries (``RequestQueue.ranks``). Kept
lazily: a queue's head moves earlier only when a request arrives or is put back
(:meth:`QueueOrder.arrived`, which indexes it if it heads its queue), and later
whenever one leaves (taken, shed, expired, cancelled), which costs nothing here: an
entry is checked against its queue's head when it reaches the top, and replaced there.
An arrival costs O(1), or O(log K) for K queues of its model when it becomes its
queue's head; each queue offered a slot costs O(log K).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from carpool.broker.batcher import Rank, RequestQueue
from carpool.broker.requests import PendingRequest
from carpool.common.protocol import Priority

_INTERACTIVE = Priority.INTERACTIVE

#: The promotion window of a queue's bulk head at ``now``, in seconds (what ``next_edf``
#: is given for that queue): called as ``promote_s(now, queue)``.
PromoteS = Callable[[float, RequestQueue], float]


class _Heads:
    """One model's two heaps (interactive, bulk) and the size at which each is next
    rid of the entries no queue holds any more."""

    __slots__ = ("compact_at", "heaps")

    MIN_COMPACT = 64

    def __init__(self) -> None:
        self.heaps: tuple[list[Rank], list[Rank]] = ([], [])
        self.compact_at = [self.MIN_COMPACT, self.MIN_COMPACT]


class QueueOrder:
    """Each model's queues by urgency; see the module docstring."""

    def __init__(self) -> None:
        self._models: dict[str, _Heads] = {}
        self._ties = itertools.count()

    def arrived(self, queue: RequestQueue, req: PendingRequest) -> None:
        """``req`` joined ``queue`` (new, or put back after its worker was lost)."""
        p = 0 if req.priority is _INTERACTIVE else 1
        rank = queue.ranks[p]
        # An entry never lies after its queue's head: heads move later only as requests
        # leave, and one that arrives ahead of the entry is indexed now.
        if (
            rank is None
            or req.deadline_s < rank[0]
            or (req.deadline_s == rank[0] and req.seq < rank[1])
        ):
            heads = self._models.get(queue.key[0])
            if heads is None:
                heads = self._models[queue.key[0]] = _Heads()
            self._push(heads, p, queue, req)

    def first(self, model: str, now: float, promote_s: PromoteS) -> RequestQueue | None:
        """The most urgent queue of ``model`` that holds a request (None: none does)."""
        heads = self._models.get(model)
        if heads is None:
            return None
        rank = self._next(heads, now, promote_s)
        return None if rank is None else rank[3]

    def offer(
        self,
        model: str,
        now: float,
        promote_s: PromoteS,
        visit: Callable[[RequestQueue], bool],
    ) -> None:
        """Call ``visit`` on each queue of ``model`` that holds a request, most urgent
        first, each once, until it returns False. Each queue visited is indexed again
        as ``visit`` left it once the walk ends (so a queue that keeps its requests is
        not offered the slot twice)."""
        heads = self._models.get(model)
        if heads is None:
            return
        visited: list[RequestQueue] = []
        try:
            while (rank := self._next(heads, now, promote_s)) is not None:
                queue = rank[3]
                heapq.heappop(heads.heaps[0 if queue.ranks[0] is rank else 1])
                queue.ranks[0] = queue.ranks[1] = None  # (its other entry, if any, is stale)
                visited.append(queue)
                if not visit(queue):
                    break
        finally:
            for queue in visited:
                for p in (0, 1):
                    head = queue.head_of(p)
                    if head is not None and queue.ranks[p] is None:
                        self._push(heads, p, queue, head)

    def forget(self, model: str) -> None:
        """A model is forgotten (it has no queue left)."""
        self._models.pop(model, None)

    def _next(self, heads: _Heads, now: float, promote_s: PromoteS) -> Rank | None:
        """The entry of the most urgent queue, as EDF with priorities reads it: the
        earliest interactive head, unless the earliest bulk head is due within its
        promotion window and no later."""
        interactive = self._top(heads, 0)
        bulk = self._top(heads, 1)
        if bulk is not None and (
            interactive is None
            or (bulk[0] <= interactive[0] and bulk[0] <= now + promote_s(now, bulk[3]))
        ):
            return bulk
        return interactive

    def _top(self, heads: _Heads, p: int) -> Rank | None:
        """Heap ``p``'s first entry that is its queue's current head, mending on the way
        the entries whose queue's head has moved on."""
        heap = heads.heaps[p]
        while heap:
            rank = heap[0]
            queue = rank[3]
            if queue.ranks[p] is not rank:  # superseded, or its queue was visited
                heapq.heappop(heap)
                continue
            head = queue.head_of(p)
            if head is None:  # the queue holds no request of this priority now
                heapq.heappop(heap)
                queue.ranks[p] = None
            elif head.seq != rank[1]:  # its head left: the entry moves to the new one
                queue.ranks[p] = fresh = (head.deadline_s, head.seq, next(self._ties), queue)
                heapq.heapreplace(heap, fresh)
            else:
                return rank
        return None

    def _push(self, heads: _Heads, p: int, queue: RequestQueue, head: PendingRequest) -> None:
        heap = heads.heaps[p]
        queue.ranks[p] = rank = (head.deadline_s, head.seq, next(self._ties), queue)
        heapq.heappush(heap, rank)
        if len(heap) >= heads.compact_at[p]:
            # Entries superseded by an earlier arrival wait in the heap until they reach
            # its top; drop them all once they are half of it.
            live = [r for r in heap if r[3].ranks[p] is r]
            heapq.heapify(live)
            heap[:] = live
            heads.compact_at[p] = max(_Heads.MIN_COMPACT, 2 * len(live))


def rank_of(queue: RequestQueue, now: float, promote_s: PromoteS) -> tuple[int, float]:
    """A queue's urgency as a sort key (smaller first), as :class:`QueueOrder` reads it:
    (0, deadline) for an interactive head, or a bulk one within its promotion window and
    no later; (1, deadline) for a bulk head alone outside its window; (2, inf) for an
    empty queue."""
    interactive, bulk = queue.head_of(0), queue.head_of(1)
    if bulk is not None:
        promoted = bulk.deadline_s <= now + promote_s(now, queue)
        if interactive is None:
            return (0 if promoted else 1, bulk.deadline_s)
        if promoted and bulk.deadline_s <= interactive.deadline_s:
            return (0, bulk.deadline_s)
    if interactive is not None:
        return (0, interactive.deadline_s)
    return (2, math.inf)
