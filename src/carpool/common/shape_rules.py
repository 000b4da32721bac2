"""shape_rules.py: limits on a model input's dynamic dims beyond its spec shape (§8.1).

A spec shape says which dims are dynamic (``-1``); some engines take only part of that
range. A TensorRT engine runs shapes inside its optimisation profile's min..max; the
PP-OCR text detector needs H and W that are multiples of 32 (else ONNX Runtime fails the
batch). A worker announces such limits in READY and the broker refuses a request outside
them with INVALID_ARGUMENT at the door, saying which dim and why, instead of the batch
failing INTERNAL on the worker. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ConfigError, ProtocolError

#: The wire keys of a model spec's input descriptor that carry a rule (§8.1).
KEYS = ("min_shape", "max_shape", "multiple_of")


@dataclass(frozen=True, slots=True)
class ShapeRule:
    """Per-dim limits for one input, each list as long as its shape (or empty: none).

    A request's dim ``i >= 1`` must satisfy ``min_shape[i] <= d``, ``d <= max_shape[i]``
    (``-1``: no upper limit) and ``d % multiple_of[i] == 0``. Dim 0's entries are not
    applied: the sample count is bounded by ``max_batch``.
    """

    min_shape: tuple[int, ...] = ()
    max_shape: tuple[int, ...] = ()
    multiple_of: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.min_shape or self.max_shape or self.multiple_of)

    def problems(self, rank: int) -> list[str]:
        """What is wrong with this rule for an input of ``rank`` dims (empty: nothing)."""
        out = []
        for key in KEYS:
            values = getattr(self, key)
            if not values:
                continue
            low = -1 if key == "max_shape" else 1
            if len(values) != rank:
                out.append(f"{key} has {len(values)} entries, the input has {rank} dims")
            elif any(
                type(v) is not int or v < low or (key == "max_shape" and v == 0) for v in values
            ):
                bound = "-1 (no limit) or >= 1" if key == "max_shape" else ">= 1"
                out.append(f"{key} entries must be ints {bound}, got {list(values)}")
        if not out and self.min_shape and self.max_shape:
            for i, (lo, hi) in enumerate(zip(self.min_shape, self.max_shape, strict=True)):
                if i and hi != -1 and lo > hi:
                    out.append(f"dim {i}: min_shape {lo} exceeds max_shape {hi}")
        return out

    def violation(self, shape: Sequence[int]) -> str | None:
        """Why a request shape breaks this rule, or None when it keeps it."""
        for i in range(1, len(shape)):
            d = shape[i]
            if self.min_shape and d < self.min_shape[i]:
                return f"dim {i} is {d}, the model takes at least {self.min_shape[i]}"
            if self.max_shape and self.max_shape[i] != -1 and d > self.max_shape[i]:
                return f"dim {i} is {d}, the model takes at most {self.max_shape[i]}"
            if self.multiple_of and d % self.multiple_of[i]:
                step = self.multiple_of[i]
                return (
                    f"dim {i} is {d}, the model takes multiples of {step} "
                    f"(pad to {-(-d // step) * step})"
                )
        return None

    def smallest(self, i: int) -> int | None:
        """The smallest size dim ``i`` may take (a warm-up's shape), or None when the rule
        puts no lower bound or step on it, or no size keeps it."""
        if not (self.min_shape or self.multiple_of):
            return None
        low = self.min_shape[i] if self.min_shape else 1
        step = self.multiple_of[i] if self.multiple_of else 1
        size = -(-low // step) * step
        if self.max_shape and self.max_shape[i] != -1 and size > self.max_shape[i]:
            return None
        return size

    def to_wire(self) -> dict[str, list[int]]:
        return {key: list(getattr(self, key)) for key in KEYS if getattr(self, key)}

    @classmethod
    def from_wire(cls, descriptor: dict[str, Any], rank: int, what: str) -> ShapeRule | None:
        """The rule in a model spec's input descriptor, or None when it has none."""
        if not any(key in descriptor for key in KEYS):
            return None
        lists = []
        for key in KEYS:
            value = descriptor.get(key, [])
            if not isinstance(value, list):
                raise ProtocolError(f"{what}: {key} must be a list of ints")
            lists.append(tuple(value))
        rule = cls(*lists)
        problems = rule.problems(rank)
        if problems:
            raise ProtocolError(f"{what}: " + "; ".join(problems))
        return rule or None


def align(
    names: Sequence[str], ranks: Sequence[int], rules: Mapping[str, ShapeRule], what: str
) -> tuple[ShapeRule | None, ...]:
    """``rules`` by input name as a tuple in input order (``()`` when there are none).

    Raises:
        ConfigError: a rule for an input the model lacks, or one that does not fit its rank.
    """
    unknown = sorted(set(rules) - set(names))
    if unknown:
        raise ConfigError(f"{what}: shape rules for {unknown}, but its inputs are {list(names)}")
    out: list[ShapeRule | None] = []
    for name, rank in zip(names, ranks, strict=True):
        rule = rules.get(name)
        if rule is not None:
            problems = rule.problems(rank)
            if problems:
                raise ConfigError(f"{what}: input {name!r}: " + "; ".join(problems))
        out.append(rule or None)
    return tuple(out) if any(out) else ()
