"""inprocess.py: InProcessWorkers — workers in the broker's own process (``embedded``).

Messages pass as lists of frames, through no socket: a message for such a worker is
delivered once the messages being sent with it are all sent (the server runs
:attr:`Upstream.later`), one at a time, in order, so what the worker answers (a short
batch runs right there, on the broker's thread) may send more without recursing. Each
loop turn the workers are serviced: finished batches of their inference threads (the
poller watches each ``results_fd``) and heartbeats due.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

from carpool.broker.transports import Events, Upstream
from carpool.common.protocol import decode_from_worker

#: The start of an embedded worker's id (ZeroMQ never makes one: its ids are 5 bytes, a
#: zero byte and a counter).
EMBEDDED_ID = b"\x00embedded-"


class EmbeddedWorker(Protocol):
    """A worker in the broker's own process (``carpool.worker.server.WorkerServer`` made
    with ``embedded=True``): messages pass as lists of frames, not through sockets, and a
    short batch runs on the broker's thread."""

    @property
    def results_fd(self) -> int:
        """Readable when the worker's inference thread has finished a batch."""
        ...

    @property
    def local_metas(self) -> bool:
        """BATCH and RESULT metas pass as BatchMeta / ResultMeta objects, not msgpack."""
        ...

    def deliver(self, frames: list[Any]) -> list[list[Any]]: ...

    def service(self, results_ready: bool) -> list[list[Any]]:
        """``results_ready``: ``results_fd`` was readable this turn."""
        ...

    def take_outbox(self) -> list[list[Any]]: ...

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
        self._queue: deque[tuple[bytes, list[Any]]] = deque()  # (id, frames) to deliver
        self._scheduled = False  # _deliver waits in upstream.later
        for wid, worker in self.workers.items():
            upstream.routes[wid] = self
            poller.register(worker.results_fd, zmq.POLLIN)

    @property
    def local_ids(self) -> set[bytes]:
        """The ids of the workers that take BATCH and give RESULT as objects."""
        return {wid for wid, w in self.workers.items() if w.local_metas}

    def start(self) -> None:
        """Hand each worker's first messages (READY) to the core."""
        up = self._up
        for wid, worker in self.workers.items():
            for frames in worker.take_outbox():
                up.send(up.on_worker(up.now(), wid, decode_from_worker(frames)))

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
            for frames in worker.service(worker.results_fd in events):
                up.send(up.on_worker(up.now(), wid, decode_from_worker(frames)))
        return 0

    def send(self, wid: bytes, frames: Sequence[Any]) -> None:
        self._queue.append((wid, list(frames)))
        if not self._scheduled:
            self._scheduled = True
            self._up.later.append(self._deliver)

    def _deliver(self) -> None:
        """Deliver what waits, in order; what the answers send queues behind it."""
        up = self._up
        workers, queue = self.workers, self._queue
        try:
            while queue:
                wid, frames = queue.popleft()
                for reply in workers[wid].deliver(frames):
                    up.send(up.on_worker(up.now(), wid, decode_from_worker(reply)))
        finally:
            self._scheduled = False

    def after_turn(self, now: float) -> None:
        pass

    def close(self, linger_ms: int) -> None:
        pass
