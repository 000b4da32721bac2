"""warmup.py: an engine's runs before READY — its warm-up shapes, and the check that its
outputs are per sample (what batching along dim 0 needs).

Made-up inputs only (zeros, ones): a run that fails on them is logged and the model served
anyway (real requests decide), except where two samples fail together that each ran
alone, or an output is not per sample: those stop the model at start (ConfigError).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from carpool.common.errors import ConfigError
from carpool.common.protocol import numpy_dtype
from carpool.worker.engines.base import Array, Engine
from carpool.worker.run import first_line

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
        zeros = zip(info.io.inputs, shapes, strict=True)
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
            first_line(exc),
        )
        return None


def _sample(engine: Engine) -> dict[str, Array] | None:
    """One sample of zeros for every input, or None when a dynamic dim has no size to
    guess."""
    info = engine.info
    if info.warmup:  # the first declared run, one sample of it
        first = zip(info.io.inputs, info.warmup[0], strict=True)
        return {t.name: np.zeros((1, *s[1:]), numpy_dtype(t.dtype)) for t, s in first}
    feeds = {}
    for i, spec in enumerate(info.io.inputs):
        rule = info.io.rules[i] if info.io.rules else None
        pad = info.io.pads[i] if info.io.pads else None
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
    if engine.info.io.max_batch < 2:
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
            f"({first_line(exc)}); carpool runs requests together along dim 0, so the "
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
