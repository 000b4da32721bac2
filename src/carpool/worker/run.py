"""run.py: one batch on an engine — its inputs stacked, the engine run, its replies made.

No sockets: the worker's inference thread (or, for short batches, its loop thread) calls
:func:`run_job` and sends what it returns. Every failure becomes a typed error in the
result header (a request's own, or the whole batch's), never an exception out of here: an
exception would take the inference thread down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from carpool.common.clock import Clock
from carpool.common.codec import numpy_dtype
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import BatchMeta, ErrorReply, encode_error
from carpool.common.shm import RegionReader, ShmRing
from carpool.worker.core import RunBatch
from carpool.worker.engines.base import Engine
from carpool.worker.tensors import ItemError, replies, stack, unreadable

logger = logging.getLogger(__name__)


def warm_up(engine: Engine) -> None:
    """One batch-1 run so the first real request does not pay for lazy initialisation.
    A dynamic dim takes the smallest size its shape rule allows (ppocr-det: 32 x 32);
    a model with a dynamic dim no rule bounds is skipped (no shape to guess)."""
    info = engine.info
    feeds = {}
    for i, spec in enumerate(info.inputs):
        rule = info.rules[i] if info.rules else None
        shape = [1]
        for d, dim in enumerate(spec.shape[1:], 1):
            if dim != -1:
                shape.append(dim)
                continue
            size = None if rule is None else rule.smallest(d)
            if size is None:
                return  # no shape to guess, or none the rule allows
            shape.append(size)
        feeds[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.dtype))
    engine.run(feeds)


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


def run_job(
    engines: Mapping[str, Engine],
    job: RunBatch,
    clock: Clock,
    reader: RegionReader | None = None,
    rings: LazyRing | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """Run one batch; returns the internal header and the reply frames."""
    batch = job.batch
    start = clock.now()
    header: dict[str, Any] = {
        "epoch": job.epoch,
        "batch": batch.batch_id,
        "model": batch.model,
        "start": start,
    }  # + "samples" once the engine has run them: what the inline decision learns from
    engine = engines.get(batch.model)
    try:
        if engine is None:
            raise JobError(ErrorCode.NOT_FOUND, f"this worker does not serve {batch.model!r}")
        if batch.total_samples > engine.info.max_batch:
            raise JobError(
                ErrorCode.INVALID_ARGUMENT,
                f"batch of {batch.total_samples} exceeds max_batch {engine.info.max_batch}",
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
                end = clock.now()
                counts, out = _merge(failed, alive, [], [])
                header.update(end=end, counts=counts)
                return header, out
            try:
                inputs = stack(batch, frames, reader)
                break
            except ItemError as bad:
                skip = [bad]
            except ProtocolError as exc:
                raise JobError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
            except Exception as exc:  # a bug of ours must fail the batch, not the thread
                logger.exception("stacking batch %d of %s failed", batch.batch_id, batch.model)
                raise JobError(ErrorCode.INTERNAL, f"stacking inputs failed: {exc}") from None
        try:
            outputs = engine.run(inputs)
        except Exception as exc:
            logger.exception("engine failed on batch %d of %s", batch.batch_id, batch.model)
            raise JobError(ErrorCode.INTERNAL, f"engine error: {exc}") from None
        end = clock.now()
        # Only a batch the engine ran times it: batches answered without it (unreadable
        # inputs, a bad batch) are fast, and would make a slow model look short enough to
        # run on the loop thread, which then sends no heartbeat for the whole batch.
        header["samples"] = batch.total_samples
        names = [t.name for t in engine.info.outputs]
        try:
            ring = None
            if rings is not None and any(i.shm_outputs for i in batch.items):
                ring = rings.get()
            counts, frames = replies(batch, outputs, names, 1000.0 * (end - start), ring)
            if failed:
                counts, frames = _merge(failed, alive, counts, frames)
        except ProtocolError as exc:
            raise JobError(ErrorCode.INTERNAL, str(exc)) from None
        except Exception as exc:  # a bug of ours must fail the batch, not the thread
            logger.exception("encoding batch %d of %s failed", batch.batch_id, batch.model)
            raise JobError(ErrorCode.INTERNAL, f"encoding outputs failed: {exc}") from None
    except JobError as exc:
        header.update(end=clock.now(), error=[int(exc.code), exc.message])
        return header, []
    header.update(end=end, counts=counts)
    return header, frames


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


class JobError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
