"""run.py: one batch on an engine — its inputs stacked, the engine run, its replies made.

No sockets: the worker's inference thread (or, for short batches, its loop thread) calls
:func:`run_job` and hands the :class:`~carpool.worker.core.JobOutcome` it returns to the
loop. Every failure becomes a typed error in the
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
from carpool.common.errors import ConfigError, ErrorCode, ProtocolError
from carpool.common.protocol import BatchMeta, ErrorReply, encode_error
from carpool.common.shm import RegionReader, ShmRing
from carpool.worker.buckets import batch_inputs, batch_replies, padding_of
from carpool.worker.core import JobOutcome, RunBatch
from carpool.worker.engines.base import Array, BadInput, Engine
from carpool.worker.tensors import ItemError, unreadable

logger = logging.getLogger(__name__)


def warm_up(engine: Engine, name: str = "model") -> None:
    """One batch-1 run so the first real request does not pay for lazy initialisation,
    then a check that the engine's outputs are per sample (:func:`check_per_sample`).

    The shapes are the model's declared warm-up shapes (``EngineInfo.warmup``: each run
    on zeros of its shapes, and the per-sample check on the first run's first sample)
    where it has them. Else a dynamic dim takes the smallest size its shape rule allows,
    or its pad rule's smallest bucket (ppocr-det: 32 x 32); a model with a dynamic dim
    neither bounds is skipped (no shape to guess). A model whose run fails on these
    made-up inputs (zeros may be out of range for an index input) is served anyway, with
    a warning: real requests decide.

    Raises:
        ConfigError: the model's outputs are not per sample.
    """
    info = engine.info
    for shapes in info.warmup:
        zeros = zip(info.inputs, shapes, strict=True)
        runs = {t.name: np.zeros(s, numpy_dtype(t.dtype)) for t, s in zeros}
        _try_run(engine, runs, name, f"its warm-up shapes {[list(s) for s in shapes]}")
    feeds = _sample(engine)
    if feeds is None:
        return
    alone = _try_run(engine, feeds, name, "zeros")
    if alone is not None:
        check_per_sample(engine, name, feeds, alone)


def _try_run(
    engine: Engine, feeds: Mapping[str, Array], name: str, what: str
) -> Mapping[str, Array] | None:
    """A warm-up run on made-up inputs; None (logged) where the model refuses them."""
    try:
        return engine.run(feeds)
    except Exception as exc:
        logger.warning(
            "model %s: the warm-up run on %s failed, its outputs are not checked per sample: %s",
            name,
            what,
            _first_line(exc),
        )
        return None


def _sample(engine: Engine) -> dict[str, Array] | None:
    """One sample of zeros for every input, or None when a dynamic dim has no size to
    guess."""
    info = engine.info
    if info.warmup:  # the first declared run, one sample of it
        first = zip(info.inputs, info.warmup[0], strict=True)
        return {t.name: np.zeros((1, *s[1:]), numpy_dtype(t.dtype)) for t, s in first}
    feeds = {}
    for i, spec in enumerate(info.inputs):
        rule = info.rules[i] if info.rules else None
        pad = info.pads[i] if info.pads else None
        # A padded input's smallest bucket holds its smallest request (§8.1).
        smallest = None if pad is None else pad.bucket([1] * (len(spec.shape) - 1))
        shape = [1]
        for d, dim in enumerate(spec.shape[1:], 1):
            if dim != -1:
                shape.append(dim)
                continue
            size = None if rule is None else rule.smallest(d)
            if smallest is not None:
                size = max(size or 1, smallest[d - 1])
            if size is None:
                return None  # no shape to guess, or none the rule allows
            shape.append(size)
        feeds[spec.name] = np.zeros(shape, dtype=numpy_dtype(spec.dtype))
    return feeds


def check_per_sample(
    engine: Engine, name: str, zeros: Mapping[str, Array], alone: Mapping[str, Array]
) -> None:
    """Check that every output has one row per sample, and that a sample's rows do not
    change when another sample runs in the same batch: the worker stacks requests along
    dim 0 and hands each its rows of every output, so an output that is not per sample
    (a summary of the whole batch, a transposed [D, N], the indices of a NonZero) would
    give requests each other's results whenever its dim 0 happened to equal the batch.

    ``alone`` is the engine's output for ``zeros`` (one sample). When ``max_batch`` allows
    two samples: zeros again (a model whose runs differ, sampling at random, is not
    compared), a sample of ones, and both in one batch. A run on one sample that fails is
    logged and ends the check (made-up inputs may be out of range); the batch of both
    failing where each sample ran alone is a model that cannot be batched.

    Raises:
        ConfigError: an output is not per sample, or two samples fail together.
    """
    for out, arr in alone.items():
        if np.ndim(arr) == 0 or np.shape(arr)[0] != 1:
            raise ConfigError(
                f"model {name}: output {out!r} has shape {list(np.shape(arr))} for one "
                "sample; carpool runs requests together along dim 0 and gives each its "
                "rows of every output, so each output needs one row per sample (dim 0 = "
                "the batch)"
            )
    if engine.info.max_batch < 2:
        return
    again = _try_run(engine, zeros, name, "zeros, again")
    if again is None:
        return
    if not all(_close(np.asarray(again[k]), np.asarray(v)) for k, v in alone.items()):
        # (random sampling in the graph: no two runs agree, so rows cannot be compared)
        logger.warning(
            "model %s: two runs on the same inputs differ; its outputs are not checked per sample",
            name,
        )
        return
    ones = {k: np.ones_like(v) for k, v in zeros.items()}
    other = _try_run(engine, ones, name, "ones")
    if other is None:
        return
    try:
        both = engine.run({k: np.concatenate([v, ones[k]]) for k, v in zeros.items()})
    except Exception as exc:
        # Each sample ran alone: only running them together fails (batch 1 baked in).
        raise ConfigError(
            f"model {name}: fails on a batch of two samples that each run alone "
            f"({_first_line(exc)}); carpool runs requests together along dim 0, so the "
            "model must take any batch up to its max_batch"
        ) from None
    for out, first in alone.items():
        second, pair = np.asarray(other[out]), np.asarray(both[out])
        expected = (2, *np.shape(first)[1:])
        if pair.shape != expected or second.shape != np.shape(first):
            detail = f"shape {list(pair.shape)} for two samples, {list(np.shape(first))} for one"
        elif not (_close(pair[:1], np.asarray(first)) and _close(pair[1:], second)):
            detail = "a sample's rows differ when it runs alone"
        else:
            continue
        raise ConfigError(
            f"model {name}: output {out!r} is not per sample ({detail}); carpool runs "
            "requests together along dim 0 and gives each its rows of every output, so a "
            "sample's outputs must depend on that sample alone"
        )


def _close(a: Array, b: Array) -> bool:
    """Equal, within what batched kernels may change in floating point."""
    if a.shape != b.shape:
        return False
    if not np.issubdtype(a.dtype, np.floating):
        return bool(np.array_equal(a, b))
    rtol = 1e-2 if a.dtype == np.float16 else 1e-3
    finite = np.abs(b[np.isfinite(b)])
    scale = float(finite.max()) if finite.size else 0.0  # (an inf would allow anything)
    return bool(np.allclose(a, b, rtol=rtol, atol=rtol * max(1.0, scale), equal_nan=True))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


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
) -> JobOutcome:
    """Run one batch; returns its outcome: the reply frames, or the whole batch's error."""
    batch = job.batch
    start = clock.now()
    samples = 0  # set once the engine has run them: what the inline decision learns from
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
                # The engine did not run: nothing to learn.
                return _outcome(job, start, end, counts, out, timed=False)
            try:
                inputs = batch_inputs(engine.info, batch, frames, reader)
                break
            except ItemError as bad:
                skip = [bad]
            except ProtocolError as exc:
                raise JobError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
            except Exception as exc:  # a bug of ours must fail the batch, not the thread
                logger.exception("stacking batch %d of %s failed", batch.batch_id, batch.model)
                raise JobError(ErrorCode.INTERNAL, f"stacking inputs failed: {exc}") from None
        names = [t.name for t in engine.info.outputs]
        try:
            outputs = engine.run(inputs)
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
                _first_line(exc),
            )
            outputs = None
        end = clock.now()
        # Only a batch the engine ran whole times it: batches answered without it
        # (unreadable inputs, a bad batch) are fast, and would make a slow model look short
        # enough to run on the loop thread, which then sends no heartbeat for the whole
        # batch; a batch run again request by request would teach the broker's cost model
        # and that choice a cost per sample many times too high.
        if outputs is not None:
            samples = batch.total_samples
        try:
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
        except ProtocolError as exc:
            raise JobError(ErrorCode.INTERNAL, str(exc)) from None
        except Exception as exc:  # a bug of ours must fail the batch, not the thread
            logger.exception("encoding batch %d of %s failed", batch.batch_id, batch.model)
            raise JobError(ErrorCode.INTERNAL, f"encoding outputs failed: {exc}") from None
    except JobError as exc:
        return _outcome(job, start, clock.now(), samples=samples, error=(exc.code, exc.message))
    padding = padding_of(batch, engine.info.pads)
    return _outcome(
        job, start, end, counts, frames, samples=samples, timed=outputs is not None, padding=padding
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
    names = [t.name for t in engine.info.outputs]
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


class JobError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
