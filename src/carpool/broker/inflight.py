"""inflight.py: InflightTable — the batches at workers, by batch id and per worker.

Pure: no sockets, threads or clocks. A batch enters when it is dispatched and leaves
when its worker answers it, when the worker is lost, or when the broker stops; each
worker's ``outstanding`` set (its credits in use) changes only here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from carpool.broker.registry import WorkerId, WorkerState
from carpool.broker.requests import PendingRequest, RequestKey


@dataclass(slots=True)
class InflightBatch:
    batch_id: int
    worker: WorkerId
    requests: list[PendingRequest]
    key: RequestKey  # key[0] is the model
    samples: int
    predicted_s: float  # the cost model's duration estimate at dispatch


class InflightTable:
    """The batches at workers; see the module docstring."""

    def __init__(self) -> None:
        self.batches: dict[int, InflightBatch] = {}
        self._batch_seq = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[InflightBatch]:
        return iter(self.batches.values())

    def next_id(self) -> int:
        self._batch_seq += 1
        return self._batch_seq

    def add(self, worker: WorkerState, batch: InflightBatch) -> None:
        self.batches[batch.batch_id] = batch
        worker.outstanding.add(batch.batch_id)

    def take(self, worker: WorkerState, batch_id: int) -> InflightBatch | None:
        """The batch ``worker`` answered, out of the table; None if it no longer owns it
        (it was requeued after a presumed loss)."""
        batch = self.batches.get(batch_id)
        if batch is None or batch.worker != worker.wid:
            return None
        del self.batches[batch_id]
        worker.outstanding.discard(batch_id)
        return batch

    def take_all(self, worker: WorkerState) -> list[InflightBatch]:
        """Every batch ``worker`` holds, out of the table, newest first."""
        taken = []
        for batch_id in sorted(worker.outstanding, reverse=True):
            batch = self.batches.pop(batch_id, None)
            if batch is not None:
                taken.append(batch)
        worker.outstanding.clear()
        return taken

    def clear(self) -> None:
        self.batches.clear()
