"""inprocess.py: InProcessWorkers — workers in the broker's own process (``embedded``).

Messages pass as typed objects (``FromBroker`` one way, ``FromWorker`` the other),
through no socket and no encoder: a message for such a worker is delivered once the
messages being sent with it are all sent (the server runs :attr:`Upstream.later`), one
at a time, in order, so what the worker answers (a short batch runs right there, on the
broker's thread) may send more without recursing. Each
loop turn the workers are serviced: finished batches of their inference threads (the
poller watches each ``results_fd``) and heartbeats due.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import zmq

from carpool.broker.replies import WorkerBound
from carpool.broker.transports import Events, Upstream
from carpool.common.protocol import FromBroker, ToBroker, checked_from_worker

#: The start of an embedded worker's id (ZeroMQ never makes one: its ids are 5 bytes, a
#: zero byte and a counter).
EMBEDDED_ID = b"\x00embedded-"


class EmbeddedWorker(Protocol):
    """A worker in the broker's own process (``carpool.worker.server.WorkerServer`` made
    with ``embedded=True``): messages pass as typed objects, not through sockets, and a
    short batch runs on the broker's thread."""

    @property
    def results_fd(self) -> int:
        """Readable when the worker's inference thread has finished a batch."""
        ...

    def deliver(self, message: FromBroker) -> list[ToBroker]: ...

    def service(self, results_ready: bool) -> list[ToBroker]:
        """``results_ready``: ``results_fd`` was readable this turn."""
        ...

    def take_outbox(self) -> list[ToBroker]: ...

    def next_wakeup(self, now: float) -> float | None: ...


class InProcessWorkers:
    """The broker's embedded workers, by the ids this transport gives them
    (:data:`EMBEDDED_ID` and their index).

    Args:
        workers: the workers; their owner closes them, after the broker.
        poller: the server's; each worker's ``results_fd`` joins it.
        upstream: the core and the server's sends.
    """

    label = "embedded"
    id_prefix = EMBEDDED_ID
    # The broker's last DISCONNECT is not theirs: their owner closes them.
    hears_goodbye = False

    def __init__(
        self, workers: Sequence[EmbeddedWorker], poller: zmq.Poller, upstream: Upstream
    ) -> None:
        self._up = upstream
        self.workers = {EMBEDDED_ID + b"%d" % i: w for i, w in enumerate(workers)}
        self._queue: deque[tuple[bytes, FromBroker]] = deque()  # (id, message) to deliver
        self._scheduled = False  # _deliver waits in upstream.later
        for wid, worker in self.workers.items():
            upstream.routes[wid] = self
            poller.register(worker.results_fd, zmq.POLLIN)

    def start(self) -> None:
        """Hand each worker's first messages (READY) to the core."""
        up = self._up
        for wid, worker in self.workers.items():
            for msg in worker.take_outbox():
                up.send(up.on_worker(up.now(), wid, checked_from_worker(msg)))

    def next_wakeup(self, now: float) -> float | None:
        wake: float | None = None
        for worker in self.workers.values():
            due = worker.next_wakeup(now)
            if due is not None and (wake is None or due < wake):
                wake = due
        return wake

    def before_poll(self) -> bool:
        return False

    def on_poll(self, events: Events) -> int:
        up = self._up
        for wid, worker in self.workers.items():
            for msg in worker.service(worker.results_fd in events):
                up.send(up.on_worker(up.now(), wid, checked_from_worker(msg)))
        return 0

    def send(self, wid: bytes, message: WorkerBound) -> None:
        self._queue.append((wid, message.to_message()))
        if not self._scheduled:
            self._scheduled = True
            self._up.later.append(self._deliver)

    def _deliver(self) -> None:
        """Deliver what waits, in order; what the answers send queues behind it."""
        up = self._up
        workers, queue = self.workers, self._queue
        try:
            while queue:
                wid, message = queue.popleft()
                for reply in workers[wid].deliver(message):
                    up.send(up.on_worker(up.now(), wid, checked_from_worker(reply)))
        finally:
            self._scheduled = False

    def after_turn(self, now: float) -> None:
        pass

    def close(self, linger_ms: int) -> None:
        pass
