"""inference.py: InferenceThread — the worker's one thread that owns its engines.

It builds the engines (so a GPU context lives on the thread that uses it), warms them
up, runs the batches handed to it in order (on an engine that queues batches, the next
queued before the one before is collected), and hands each :class:`JobOutcome` back
through a queue, waking the loop through a pipe (``wake_fd``: registered in the loop's
poll, or the broker's for an embedded worker). No zmq socket is touched here; the loop
thread owns the connection to the broker. What the loop runs itself (short batches,
:meth:`WorkerCore.runs_inline <carpool.worker.core.WorkerCore.runs_inline>`) uses the
same engines, which are then thread-free.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping

from carpool.common.clock import Clock
from carpool.common.errors import ConfigError, ProtocolError
from carpool.common.protocol import ModelSpec
from carpool.common.shm import RegionReader
from carpool.common.wake import WakePipe
from carpool.worker.core import JobOutcome, RunBatch
from carpool.worker.engines.base import Engine, queue_depth
from carpool.worker.run import LazyRing, StartedJob, finish_job, start_job
from carpool.worker.warmup import warm_up

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], Engine]

#: How long a start waits for its engines by default (``start_timeout_s``).
START_TIMEOUT_S = 300.0
#: How often a start still under way says so (``starting``).
STARTING_EVERY_S = 10.0


def check_specs(specs: list[ModelSpec]) -> None:
    """Refuse, at start, a model the broker would refuse: its READY would be dropped as a
    protocol error, and the worker would try again for ever (a name over 256 characters,
    a rank over 8, more than 64 outputs).

    Raises:
        ConfigError: naming the model and what is wrong.
    """
    name = ""
    try:
        for spec in specs:
            name = spec.name
            ModelSpec.from_wire(spec.to_wire())
    except ProtocolError as exc:
        raise ConfigError(f"model {name!r} cannot be served: {exc}") from None


def close_all(engines: Mapping[str, Engine]) -> None:
    """Close every engine, each even where closing one before it failed (logged: the
    worker is stopping, and each engine's GPU context must still be released)."""
    for name, engine in engines.items():
        _close(name, engine)


def _close(name: str, engine: Engine) -> None:
    try:
        engine.close()
    except Exception:
        logger.exception("model %r: its engine failed to close", name)


class InferenceThread:
    """The inference thread of one worker, started (engines built) by the constructor.

    Args:
        factories: model name → a factory that builds its engine (called here, once).
        name: the worker's name, for the thread's.
        warmup: run each engine once on made-up inputs first (:func:`warm_up`).
        clock, reader, rings: what a batch run needs (:func:`run_job`).
        start_timeout_s: how long building, warming up and checking the engines may take
            (a TensorRT plan built at start takes minutes).
        starting: called with the seconds waited so far every :data:`STARTING_EVERY_S`
            while they have not finished (the worker's entry point extends systemd's
            start timeout with it).

    Raises:
        ConfigError: the engines did not start within ``start_timeout_s``.
        Whatever building, warming up or checking an engine raised (every engine built
        so far is closed first).
    """

    def __init__(
        self,
        factories: Mapping[str, EngineFactory],
        *,
        name: str,
        warmup: bool,
        clock: Clock,
        reader: RegionReader,
        rings: LazyRing,
        start_timeout_s: float = START_TIMEOUT_S,
        starting: Callable[[float], None] | None = None,
    ) -> None:
        self._clock = clock
        self._reader = reader
        self._rings = rings
        self._jobs: queue.Queue[RunBatch | None] = queue.Queue()
        self._outcomes: queue.SimpleQueue[JobOutcome] = queue.SimpleQueue()
        self._ready = WakePipe()  # readable while outcomes may wait
        self._startup: queue.Queue[list[ModelSpec] | BaseException] = queue.Queue()
        self._lock = threading.Lock()
        self._done = False  # the thread has ended (under _lock)
        self._then: Callable[[], None] | None = None  # called when it ends (under _lock)
        self._stopped = False
        #: The engines by model, built on this thread (published by the startup queue).
        self.engines: dict[str, Engine] = {}
        self._thread = threading.Thread(
            target=self._loop,
            args=(dict(factories), warmup),
            name=f"carpool-inference-{name}",
            daemon=True,
        )
        self._thread.start()
        started = self._started(start_timeout_s, starting)
        if isinstance(started, BaseException):
            self._thread.join()
            self._ready.close()
            raise started
        #: What the engines serve, in the order of ``factories``.
        self.specs = started

    def _started(
        self, timeout_s: float, starting: Callable[[float], None] | None
    ) -> list[ModelSpec] | BaseException:
        """What the thread's start gave, waited for up to ``timeout_s``."""
        waited_s = 0.0
        while True:
            step_s = min(STARTING_EVERY_S, timeout_s - waited_s)
            try:
                return self._startup.get(timeout=step_s)
            except queue.Empty:
                waited_s += step_s
            if waited_s >= timeout_s:
                # The thread is inside a factory or a warm-up run, which cannot be cut
                # short: once it returns, the thread closes its engines and ends.
                self.stop(0.0)
                raise ConfigError(
                    f"the models did not start within start_timeout_s ({timeout_s:g} s): "
                    "a TensorRT plan built at start can take longer; build it ahead "
                    "with carpool build-engine, or raise start_timeout_s"
                ) from None
            if starting is not None:
                starting(waited_s)

    @property
    def wake_fd(self) -> int:
        """Readable when outcomes may wait: poll it, then call :meth:`finished`."""
        return self._ready.fd

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: RunBatch) -> None:
        """Queue a batch; its outcome comes back through :meth:`finished`."""
        self._jobs.put(job)

    def waiting(self) -> int:
        """Batches handed over and not started yet."""
        return self._jobs.qsize()

    def drop_queued(self) -> int:
        """Take back the batches not started yet; returns how many there were."""
        dropped = 0
        with contextlib.suppress(queue.Empty):
            while True:
                self._jobs.get_nowait()
                dropped += 1
        return dropped

    def finished(self) -> Iterator[JobOutcome]:
        """The outcomes waiting, oldest first. A caller that stops before the end calls
        :meth:`rewake`, so that the rest wake the poll again."""
        self._ready.clear()  # before reading: an outcome queued after this wakes anew
        outcomes = self._outcomes
        while True:
            try:
                outcome = outcomes.get_nowait()
            except queue.Empty:
                return
            yield outcome

    def rewake(self) -> None:
        """Outcomes left unread wake the next poll."""
        if not self._outcomes.empty():
            self._ready.wake()

    def stop(self, wait_s: float) -> None:
        """Drop the batches not started (their broker requeues them), let the thread end
        after the batch it runs, and wait up to ``wait_s`` for it."""
        self._stopped = True
        self.drop_queued()
        self._jobs.put(None)
        self._thread.join(timeout=wait_s)

    def release_after(self, release: Callable[[], None]) -> bool:
        """Call ``release`` (what the running batch may still use) once the thread has
        ended: now (returns True), or when its batch ends (returns False)."""
        with self._lock:
            if not self._done:
                self._then = release
                return False
        self._ready.close()
        release()
        return True

    def _serve(self, engines: dict[str, Engine]) -> None:
        """Run the batches handed over, in order, until :meth:`stop`. On an engine that
        queues batches (:func:`~carpool.worker.engines.base.queue_depth` above 1), the
        next batch is queued before the one before is collected, up to that many at once,
        so that one batch's copies overlap another's compute; outcomes still go back in
        the order the batches came, each once."""
        jobs, clock, reader = self._jobs, self._clock, self._reader
        queued: deque[StartedJob] = deque()  # started, oldest first
        last_end_s = -math.inf  # when the last collected batch ended

        def finish_oldest() -> None:
            nonlocal last_end_s
            outcome = finish_job(
                queued.popleft(), clock, reader, self._rings, not_before_s=last_end_s
            )
            last_end_s = outcome.end_s
            if not self._stopped:  # (stopped while it ran: nobody reads outcomes)
                self._outcomes.put(outcome)
                self._ready.wake()

        while True:
            if queued:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:  # nothing new to queue: collect the oldest
                    finish_oldest()
                    continue
            else:
                job = jobs.get()
            if job is None:
                break
            depth = queue_depth(engines.get(job.batch.model))
            while len(queued) >= depth:  # (depth 1: every batch before it has ended)
                finish_oldest()
            queued.append(start_job(engines, job, clock, reader, queue=depth > 1))
        while queued and not self._stopped:
            finish_oldest()

    def _loop(self, factories: dict[str, EngineFactory], warmup: bool) -> None:
        engines: dict[str, Engine] = {}
        try:
            for name, factory in factories.items():
                engines[name] = factory()
                if warmup:
                    warm_up(engines[name], name)
            specs = [engine.info.spec(name) for name, engine in engines.items()]
            check_specs(specs)
            self.engines = engines
        except BaseException as exc:
            close_all(engines)
            with self._lock:
                self._done = True
            self._startup.put(exc)
            return
        self._startup.put(specs)
        try:
            self._serve(engines)
        finally:
            close_all(engines)
            with self._lock:
                self._done = True
                then = self._then
            if then is not None:  # release_after() returned while this batch ran
                self._ready.close()
                then()
