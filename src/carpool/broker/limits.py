"""limits.py: what each worker of a model takes — its batch limit and shape rules — pure.

The workers of one model share its inputs and outputs (names, dtypes, shapes, pad rules
and buckets, crops): what a client sends and what it gets back. Each has its own limits:
``max_batch`` and the shape rules of its inputs (a Jetson whose TensorRT profile stops at
batch 8, a GPU server's that reaches 64, an ONNX Runtime fallback with no rule at all).
The broker lets in a request that some live worker admits and sends each batch only to a
worker that admits it (docs/protocol.md §8.1). A rule is held against the item shape a
batch carries: the request's own, or for a padded input its bucket (what the engine runs).

:func:`violation` says why one worker cannot run a queue's batches, :func:`refusal` why no
live worker can (naming what each takes), and :func:`hull` the loosest single rule that
every admitted shape keeps (METADATA's summary of the union).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from carpool.broker.requests import RequestKey
from carpool.common.protocol import ModelSpec
from carpool.common.shape_rules import ShapeRule


def violation(spec: ModelSpec, key: RequestKey) -> str | None:
    """Why a worker that announced ``spec`` cannot run the batches of ``key`` (its inputs
    in spec order, with their item shapes), or None when it can."""
    if not spec.rules:
        return None
    for (name, _dtype, item), rule in zip(key[1], spec.rules, strict=False):
        if rule is None:
            continue
        broken = rule.violation((1, *item))
        if broken is not None:
            return f"input {name!r}: shape {list(item)} (without dim 0): {broken}"
    return None


def takes(spec: ModelSpec) -> str:
    """What a worker's limits let in, for a message: its batch limit and, per input with
    a rule, each limited dim's range and step."""
    parts = [f"max_batch {spec.max_batch}"]
    for t, rule in zip(spec.inputs, spec.rules, strict=False):
        if rule:
            dims = [_dim(rule, i) for i in range(1, len(t.shape))]
            parts.append(f"{t.name!r} " + ", ".join(d for d in dims if d))
    return "; ".join(parts) if len(parts) > 1 else parts[0] + "; any shape"


def _dim(rule: ShapeRule, i: int) -> str:
    low = rule.min_shape[i] if rule.min_shape else 1
    high = rule.max_shape[i] if rule.max_shape else -1
    step = rule.multiple_of[i] if rule.multiple_of else 1
    if low == 1 and high == -1 and step == 1:
        return ""
    text = f"dim {i} in {low}..{'' if high == -1 else high}"
    return text + (f" step {step}" if step > 1 else "")


def refusal(model: str, key: RequestKey, workers: Iterable[tuple[str, ModelSpec]]) -> str:
    """The INVALID_ARGUMENT message for a request of ``key`` that none of the live
    ``workers`` (name, spec) of ``model`` admits: the first reason, then what each takes."""
    why: str | None = None
    offers: dict[str, list[str]] = {}  # what a worker takes -> the names that take it
    for name, spec in workers:
        why = why or violation(spec, key)
        names = offers.setdefault(takes(spec), [])
        if name not in names:
            names.append(name)
    listed = "; ".join(f"{', '.join(sorted(n))}: {t}" for t, n in sorted(offers.items()))
    why = why or "its shapes"
    return f"{why}; no live worker of model {model!r} takes it ({listed})"


def hull(specs: Sequence[ModelSpec]) -> tuple[ShapeRule | None, ...]:
    """The loosest rule per input that every shape some spec admits keeps (the smallest
    minimum, the largest maximum, the greatest common step); none for an input that a
    spec leaves unruled. In input order; ``()`` when no input keeps a rule."""
    if not specs:
        return ()
    out: list[ShapeRule | None] = []
    for i, t in enumerate(specs[0].inputs):
        given = [s.rules[i] if s.rules else None for s in specs]
        rules = [r for r in given if r is not None]
        if len(rules) < len(given):
            out.append(None)
            continue
        rank = len(t.shape)
        lows = [min(r.min_shape[d] if r.min_shape else 1 for r in rules) for d in range(rank)]
        highs = [max(_high(r, d) for r in rules) for d in range(rank)]
        steps = [
            math.gcd(*(r.multiple_of[d] if r.multiple_of else 1 for r in rules))
            for d in range(rank)
        ]
        rule = ShapeRule(
            tuple(lows) if any(v > 1 for v in lows[1:]) else (),
            tuple(-1 if v == math.inf else int(v) for v in highs)
            if any(v != math.inf for v in highs[1:])
            else (),
            tuple(steps) if any(v > 1 for v in steps[1:]) else (),
        )
        out.append(rule or None)
    return tuple(out) if any(out) else ()


def _high(rule: ShapeRule, d: int) -> float:
    if not rule.max_shape or rule.max_shape[d] == -1:
        return math.inf
    return rule.max_shape[d]
