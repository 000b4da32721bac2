"""run.py: one batch on an engine — its inputs stacked, the engine run, its replies made
(an engine's warm-up before READY: :mod:`carpool.worker.warmup`).

:func:`run_job` does it in one go; :func:`start_job` and :func:`finish_job` are its two
halves, for an engine that queues batches (``enqueue``, TensorRT's): the inference thread
queues the next batch before it collects the one before.

No sockets: the worker's inference thread (or, for short batches, its loop thread) calls
:func:`run_job` and hands the :class:`~carpool.worker.core.JobOutcome` it returns to the
loop. Every failure becomes a typed error in the
result header (a request's own, or the whole batch's), never an exception out of here: an
exception would take the inference thread down.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from carpool.common.clock import Clock
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import BatchMeta, ErrorReply, Frame, encode_error
from carpool.common.shm import RegionReader, ShmRing
from carpool.worker.buckets import padded_replies, padding_of, stack_padded
from carpool.worker.core import JobOutcome, RunBatch
from carpool.worker.engines.base import Array, BadInput, Engine, EngineInfo, Pending, queue_depth
from carpool.worker.tensors import ItemError, replies, stack, unreadable

logger = logging.getLogger(__name__)


def first_line(exc: BaseException) -> str:
    """An exception's first line, for a log line or an error message."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def batch_inputs(
    info: EngineInfo, batch: BatchMeta, frames: Sequence[Frame], reader: RegionReader | None
) -> dict[str, Array]:
    """The batch's input arrays for an engine of ``info``: stacked, or padded into the
    bucket where the model has pad rules (:func:`~carpool.worker.buckets.stack_padded`)."""
    if not info.io.pads:
        return stack(batch, frames, reader)
    return stack_padded(batch, frames, info.io.pads, reader)


def batch_replies(
    info: EngineInfo,
    batch: BatchMeta,
    outputs: Mapping[str, Array],
    names: Sequence[str],
    compute_ms: float,
    ring: ShmRing | None = None,
) -> tuple[list[int], list[Any]]:
    """The batch's replies: :func:`~carpool.worker.tensors.replies`, or, where the model
    has pad rules, :func:`~carpool.worker.buckets.padded_replies`."""
    if not info.io.pads:
        return replies(batch, outputs, names, compute_ms, ring)
    return padded_replies(batch, outputs, names, info.io.crops, compute_ms, ring)


class LazyRing:
    """The worker's output ring (§5.5), made on first use; None where it cannot be made
    (no /dev/shm: outputs then go in their frames, and this is logged once)."""

    def __init__(self, size: int, mode: int, group: str | None = None) -> None:
        self.size = size
        self.mode = mode
        self.group = group
        self._ring: ShmRing | None = None
        self._failed = size <= 0
        self._lock = threading.Lock()

    def get(self) -> ShmRing | None:
        if self._ring is not None or self._failed:
            return self._ring
        with self._lock:  # another thread may have made it meanwhile
            ring = self._current()
            if ring is not None or self._failed:
                return ring
            try:
                ring = ShmRing(self.size, mode=self.mode, group=self.group)
            except (OSError, ValueError, KeyError) as exc:  # KeyError: no such group
                self._failed = True
                logger.warning("no shared-memory output ring (%s): outputs go in frames", exc)
                return None
            logger.info("shared-memory output ring %s (%d bytes)", ring.name, self.size)
            self._ring = ring
            return ring

    def _current(self) -> ShmRing | None:
        return self._ring

    def close(self) -> None:
        with self._lock:
            self._failed = True
            if self._ring is not None:
                self._ring.close()
                self._ring = None


@dataclass(eq=False, slots=True)
class StartedJob:
    """A batch whose inputs are stacked and, on an engine that queues batches
    (:func:`~carpool.worker.engines.base.queue_depth` above 1), queued: what
    :func:`finish_job` needs to collect it and make its replies. ``outcome`` is set where
    nothing is left to run (a whole-batch error, or every request answered already)."""

    job: RunBatch
    start_s: float
    engine: Engine | None = None
    batch: BatchMeta | None = None  # less the requests answered on their own
    frames: Sequence[Any] = ()
    inputs: Mapping[str, Array] | None = None
    failed: dict[int, list[bytes]] = field(default_factory=dict)  # position -> its ERROR
    alive: list[int] = field(default_factory=list)  # positions in the original batch
    pending: Pending | None = None  # what engine.enqueue returned
    queue_error: Exception | None = None  # what engine.enqueue raised
    outcome: JobOutcome | None = None
    cpu_s: float = 0.0  # CPU spent on it so far: its receipt and its staging


def run_job(
    engines: Mapping[str, Engine],
    job: RunBatch,
    clock: Clock,
    reader: RegionReader | None = None,
    rings: LazyRing | None = None,
) -> JobOutcome:
    """Run one batch; returns its outcome: the reply frames, or the whole batch's error."""
    return finish_job(start_job(engines, job, clock, reader), clock, reader, rings)


def start_job(
    engines: Mapping[str, Engine],
    job: RunBatch,
    clock: Clock,
    reader: RegionReader | None = None,
    *,
    queue: bool = False,
) -> StartedJob:
    """The first half of :func:`run_job`: the batch checked and its inputs stacked, and,
    with ``queue`` on an engine that has ``enqueue``, queued on it (its errors are the
    batch's, in :func:`finish_job`)."""
    batch = job.batch
    cpu0 = clock.cpu()
    started = StartedJob(job, clock.now())
    engine = engines.get(batch.model)
    try:
        if engine is None:
            raise JobError(ErrorCode.NOT_FOUND, f"this worker does not serve {batch.model!r}")
        if batch.total_samples > engine.info.io.max_batch:
            raise JobError(
                ErrorCode.INVALID_ARGUMENT,
                f"batch of {batch.total_samples} exceeds max_batch {engine.info.io.max_batch}",
            )
        frames: Sequence[Any] = job.frames
        alive = list(range(len(batch.items)))  # positions in the original batch
        failed: dict[int, list[bytes]] = {}  # position -> its ERROR reply
        # Requests whose shared-memory inputs cannot be read are answered on their own
        # and the rest of the batch runs: found up front, or (a region that changed
        # since) while stacking.
        skip: list[ItemError] = []
        if reader is not None and len(frames) == len(batch.inputs) * len(batch.items):
            try:
                skip = unreadable(batch, reader)
            except Exception as exc:  # a bug of ours must fail the batch, not the thread
                logger.exception("checking batch %d's shared memory failed", batch.batch_id)
                raise JobError(ErrorCode.INTERNAL, f"stacking inputs failed: {exc}") from None
        while True:
            for bad in sorted(skip, key=lambda e: -e.index):  # last first: indexes hold
                item = batch.items[bad.index]
                error = ErrorReply(item.request_id, bad.code, bad.message)
                failed[alive.pop(bad.index)] = encode_error(error, simple=item.simple)
                batch, frames = _without(batch, frames, bad.index)
            if not batch.items:
                counts, out = _merge(failed, alive, [], [])
                # The engine did not run: nothing to learn.
                end = clock.now()
                started.outcome = _outcome(job, started.start_s, end, counts, out, timed=False)
                return started
            try:
                with _stage(batch, "stacking", "inputs", ErrorCode.INVALID_ARGUMENT, ItemError):
                    inputs = batch_inputs(engine.info, batch, frames, reader)
                break
            except ItemError as bad:
                skip = [bad]
    except JobError as exc:
        started.outcome = _outcome(job, started.start_s, clock.now(), error=(exc.code, exc.message))
        return started
    started.engine, started.batch, started.frames = engine, batch, frames
    started.inputs, started.failed, started.alive = inputs, failed, alive
    if queue and queue_depth(engine) > 1:
        try:
            started.pending = engine.enqueue(inputs)  # type: ignore[attr-defined]
        except Exception as exc:  # (answered as the engine's run failing, when finished)
            started.queue_error = exc
    started.cpu_s = job.cpu_s + clock.cpu() - cpu0
    return started


def finish_job(
    started: StartedJob,
    clock: Clock,
    reader: RegionReader | None = None,
    rings: LazyRing | None = None,
    *,
    not_before_s: float = -math.inf,
) -> JobOutcome:
    """The second half of :func:`run_job`: the batch run (or its queued run collected) and
    its replies made. ``not_before_s``: when the batch queued before it ended (a queued
    batch's time counts from then: the device was busy with that one before)."""
    if started.outcome is not None:
        return started.outcome
    job, engine, batch, frames = started.job, started.engine, started.batch, started.frames
    assert engine is not None  # (set with the batch and its inputs by start_job)
    assert batch is not None
    assert started.inputs is not None
    # The batch's time (compute_ms) runs from ``start`` to ``end``; its CPU outside that
    # window (cpu_ms) is its receipt, its staging where that came before the window (a
    # batch queued behind another), and its replies.
    start = max(started.start_s, not_before_s)
    outside_s = started.cpu_s if start > started.start_s else started.job.cpu_s
    samples = 0  # set once the engine has run them: what the inline decision learns from
    failed, alive = started.failed, started.alive
    try:
        names = [t.name for t in engine.info.io.outputs]
        try:
            if started.queue_error is not None:
                raise started.queue_error
            if started.pending is not None:
                outputs = started.pending.result()
            else:
                outputs = engine.run(started.inputs)
        except Exception as exc:
            if len(batch.items) == 1 and not failed:
                logger.exception("engine failed on batch %d of %s", batch.batch_id, batch.model)
                raise JobError(_engine_code(exc), f"engine error: {exc}") from None
            # One request's inputs can fail the whole batch (an index out of range): the
            # others must not fail with it. Each runs alone, and gets its own answer.
            logger.warning(
                "engine failed on batch %d of %s (%d requests), running each alone: %s",
                batch.batch_id,
                batch.model,
                len(batch.items),
                first_line(exc),
            )
            outputs = None
        end, cpu_end = clock.now(), clock.cpu()
        # Only a batch the engine ran whole times it: batches answered without it
        # (unreadable inputs, a bad batch) are fast, and would make a slow model look short
        # enough to run on the loop thread, which then sends no heartbeat for the whole
        # batch; a batch run again request by request would teach the broker's cost model
        # and that choice a cost per sample many times too high.
        if outputs is not None:
            samples = batch.total_samples
        with _stage(batch, "encoding", "outputs", ErrorCode.INTERNAL):
            ring = None
            if rings is not None and any(i.shm_outputs for i in batch.items):
                ring = rings.get()
            if outputs is None:
                counts, frames = _one_by_one(engine, batch, frames, reader, clock)
                end = clock.now()
            else:
                compute_ms = 1000.0 * (end - start)
                counts, frames = batch_replies(engine.info, batch, outputs, names, compute_ms, ring)
            if failed:
                counts, frames = _merge(failed, alive, counts, frames)
    except JobError as exc:
        return _outcome(job, start, clock.now(), samples=samples, error=(exc.code, exc.message))
    pads = engine.info.io.pads
    padding = padding_of(batch, pads) if pads else None  # (a plain model: no padding)
    cpu_s = outside_s + clock.cpu() - cpu_end
    return _outcome(
        job,
        start,
        end,
        counts,
        frames,
        samples=samples,
        timed=outputs is not None,
        padding=padding,
        cpu_s=cpu_s,
    )


def _outcome(
    job: RunBatch,
    start_s: float,
    end_s: float,
    counts: Sequence[int] = (),
    frames: Sequence[Any] = (),
    *,
    samples: int = 0,
    timed: bool = True,
    error: tuple[ErrorCode, str] | None = None,
    padding: tuple[int, int] | None = None,
    cpu_s: float = 0.0,
) -> JobOutcome:
    return JobOutcome(
        job.epoch,
        job.batch.batch_id,
        job.batch.model,
        start_s,
        end_s,
        counts,
        frames,
        samples,
        timed,
        error,
        padding,
        cpu_s,
    )


def _one_by_one(
    engine: Engine,
    batch: BatchMeta,
    frames: Sequence[Any],
    reader: RegionReader | None,
    clock: Clock,
) -> tuple[list[int], list[Any]]:
    """RESULT counts and frames for a batch the engine failed as a whole: each request
    run alone, answered with its outputs or its own error. Outputs go in frames, never
    the ring: each run's outputs would be written without regard to the earlier ones of
    the same RESULT, still unsent, and could be written over."""
    names = [t.name for t in engine.info.io.outputs]
    n = len(batch.inputs)
    counts: list[int] = []
    out: list[Any] = []
    for i, item in enumerate(batch.items):
        one = BatchMeta(batch.batch_id, batch.model, batch.inputs, (item,))
        start = clock.now()
        try:
            inputs = batch_inputs(engine.info, one, frames[i * n : (i + 1) * n], reader)
            outputs = engine.run(inputs)
        except ItemError as bad:  # its shared memory changed since the batch was stacked
            error = ErrorReply(item.request_id, bad.code, bad.message)
        except Exception as exc:
            logger.info("engine failed on request %d of %s: %s", item.request_id, one.model, exc)
            error = ErrorReply(item.request_id, _engine_code(exc), f"engine error: {exc}")
        else:
            compute_ms = 1000.0 * (clock.now() - start)
            k, reply = batch_replies(engine.info, one, outputs, names, compute_ms)
            counts.extend(k)
            out.extend(reply)
            continue
        reply = encode_error(error, simple=item.simple)
        counts.append(len(reply))
        out.extend(reply)
    return counts, out


def _engine_code(exc: BaseException) -> ErrorCode:
    """The error code of an engine's exception: INVALID_ARGUMENT where the engine says
    the inputs were at fault (:class:`~carpool.worker.engines.base.BadInput`), else
    INTERNAL."""
    return ErrorCode.INVALID_ARGUMENT if isinstance(exc, BadInput) else ErrorCode.INTERNAL


def _without(batch: BatchMeta, frames: Sequence[Any], index: int) -> tuple[BatchMeta, list[Any]]:
    """The batch and its frames less one request."""
    n = len(batch.inputs)
    items = batch.items[:index] + batch.items[index + 1 :]
    rest = [*frames[: index * n], *frames[(index + 1) * n :]]
    return BatchMeta(batch.batch_id, batch.model, batch.inputs, items), rest


def _merge(
    failed: Mapping[int, list[bytes]], alive: list[int], counts: list[int], frames: list[Any]
) -> tuple[list[int], list[Any]]:
    """RESULT counts and frames in the original batch order: the replies of the requests
    that ran (at positions ``alive``) and the errors of those that could not."""
    replies_of = {}
    pos = 0
    for where, k in zip(alive, counts, strict=True):
        replies_of[where] = frames[pos : pos + k]
        pos += k
    out_counts: list[int] = []
    out_frames: list[Any] = []
    for where in range(len(alive) + len(failed)):
        reply = failed.get(where)
        if reply is None:
            reply = replies_of[where]
        out_counts.append(len(reply))
        out_frames.extend(reply)
    return out_counts, out_frames


@contextmanager
def _stage(
    batch: BatchMeta,
    doing: str,
    what: str,
    protocol_code: ErrorCode,
    passes: type[Exception] | tuple[type[Exception], ...] = (),
) -> Iterator[None]:
    """Fails ``batch`` with a :class:`JobError` on an error while ``doing`` its ``what``
    (stacking its inputs, encoding its outputs): a :class:`ProtocolError` as
    ``protocol_code``, anything else (``passes`` apart) as INTERNAL, logged: a bug of
    ours must fail the batch, not the thread."""
    try:
        yield
    except passes:
        raise
    except ProtocolError as exc:
        raise JobError(protocol_code, str(exc)) from None
    except Exception as exc:
        logger.exception("%s batch %d of %s failed", doing, batch.batch_id, batch.model)
        raise JobError(ErrorCode.INTERNAL, f"{doing} {what} failed: {exc}") from None


class JobError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
