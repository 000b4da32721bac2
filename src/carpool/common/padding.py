"""padding.py: shape buckets — how requests of different shapes share a batch (§8.1).

A model whose inputs have dynamic dims (camera frames of several resolutions, text lines
of any width) may declare, per input, a :class:`PadRule`: each request's item shape (its
shape without dim 0) is rounded up to a **bucket**, either to multiples of a step per dim
(the PP-OCR detector: H and W to multiples of 32), or to the smallest of a fixed set of
shapes that contains it (width buckets for the recognizer; a camera model's resolutions),
or both (rounded up first, then the smallest bucket that holds the result). The broker
batches requests by bucket and refuses a shape that fits no bucket; the worker pads each
request's tensor into its bucket with the rule's ``value`` (at the end of each dim:
bottom and right of an image) and crops each output back to the request's own extent.

How an output is cropped is declared per output axis by a :class:`CropAxis`: output
axis ``axis`` has the extent of input ``input``'s axis ``input_axis`` times
``numerator / denominator``, rounded up (the detector's probability map: H and W × 1;
the recognizer's sequence axis: W / 8). Axes without one are kept whole.

The padded share of compute counts, over a batch, Σ (bucket elements − the request's own
elements) / Σ bucket elements (:func:`padded_elements`). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common.errors import ProtocolError

__all__ = ["CropAxis", "PadRule", "bucket_elements", "cropped_extent", "padded_elements"]

#: Buckets one input may declare (each is a shape the engine is warmed up and, with
#: TensorRT, profiled for).
MAX_BUCKETS = 64


def _ints(value: Any, what: str, low: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(type(v) is int and v >= low for v in value):
        raise ProtocolError(f"{what} must be a list of ints >= {low}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class PadRule:
    """How one input's requests are padded into buckets; shapes are item shapes (the
    input's shape without dim 0), each as long as the input's rank − 1.

    Attributes:
        multiple_of: round each item dim up to a multiple of this (empty: no rounding).
        buckets: the shapes a request may be padded to (empty: the rounded shape is the
            bucket). A request goes to the one with the fewest elements among those that
            hold it in every dim (ties: the first listed).
        value: what padded elements hold (cast to the input's dtype).
    """

    multiple_of: tuple[int, ...] = ()
    buckets: tuple[tuple[int, ...], ...] = ()
    value: float = 0.0

    def problems(self, item_rank: int) -> list[str]:
        """What is wrong with this rule for an input with ``item_rank`` item dims."""
        out = []
        if not self.multiple_of and not self.buckets:
            out.append("a pad rule needs multiple_of or buckets")
        if self.multiple_of and len(self.multiple_of) != item_rank:
            out.append(
                f"multiple_of has {len(self.multiple_of)} entries, the input has "
                f"{item_rank} dims after the batch dim"
            )
        if len(self.buckets) > MAX_BUCKETS:
            out.append(f"at most {MAX_BUCKETS} buckets, got {len(self.buckets)}")
        for b in self.buckets:
            if len(b) != item_rank:
                out.append(f"bucket {list(b)} has {len(b)} dims, the input has {item_rank}")
            elif self.multiple_of and any(d % m for d, m in zip(b, self.multiple_of, strict=True)):
                out.append(f"bucket {list(b)} is not a multiple of {list(self.multiple_of)}")
        if len(set(self.buckets)) != len(self.buckets):
            out.append("buckets are listed twice")
        if not math.isfinite(self.value):
            out.append("the pad value must be finite")
        return out

    def bucket(self, item_shape: Sequence[int]) -> tuple[int, ...] | None:
        """The bucket of a request whose item shape is ``item_shape``; None when no
        bucket holds it."""
        shape = tuple(item_shape)
        if self.multiple_of:
            shape = tuple(-(-d // m) * m for d, m in zip(shape, self.multiple_of, strict=True))
        if not self.buckets:
            return shape
        best: tuple[int, ...] | None = None
        best_elements = 0
        for b in self.buckets:
            if all(d <= c for d, c in zip(shape, b, strict=True)):
                elements = math.prod(b)
                if best is None or elements < best_elements:
                    best, best_elements = b, elements
        return best

    def allowed(self) -> str:
        """The shapes this rule takes, in words (for INVALID_ARGUMENT messages)."""
        if not self.buckets:
            return f"any item shape, padded up to multiples of {list(self.multiple_of)}"
        largest = [max(b[i] for b in self.buckets) for i in range(len(self.buckets[0]))]
        listed = ", ".join(str(list(b)) for b in self.buckets)
        return f"item shapes that fit one of the buckets {listed} (at most {largest})"

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"value": self.value}
        if self.multiple_of:
            wire["multiple_of"] = list(self.multiple_of)
        if self.buckets:
            wire["buckets"] = [list(b) for b in self.buckets]
        return wire

    @classmethod
    def from_wire(cls, obj: Any, item_rank: int, what: str) -> PadRule:
        """A rule from its wire map (the ``pad`` key of a model spec's input descriptor).

        Raises:
            ProtocolError: not a valid rule for an input of ``item_rank`` item dims.
        """
        if not isinstance(obj, dict):
            raise ProtocolError(f"{what}: pad must be a map")
        multiple = _ints(obj.get("multiple_of", []), f"{what}: pad multiple_of", 1)
        raw = obj.get("buckets", [])
        if not isinstance(raw, list):
            raise ProtocolError(f"{what}: pad buckets must be a list of shapes")
        buckets = tuple(_ints(b, f"{what}: pad bucket", 1) for b in raw)
        value = obj.get("value", 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{what}: pad value must be a number")
        rule = cls(multiple, buckets, float(value))
        problems = rule.problems(item_rank)
        if problems:
            raise ProtocolError(f"{what}: " + "; ".join(problems))
        return rule


@dataclass(frozen=True, slots=True)
class CropAxis:
    """Output axis ``axis`` has the extent of input ``input``'s axis ``input_axis`` times
    ``numerator / denominator``, rounded up (both axes count dim 0, the batch, as 0: so
    they are >= 1)."""

    axis: int
    input: str
    input_axis: int
    numerator: int = 1
    denominator: int = 1

    def problems(self, output_rank: int, input_ranks: dict[str, int]) -> list[str]:
        out = []
        if not 1 <= self.axis < output_rank:
            out.append(f"crop axis {self.axis} is not an output axis in 1..{output_rank - 1}")
        rank = input_ranks.get(self.input)
        if rank is None:
            out.append(f"crop names input {self.input!r}, not one of {sorted(input_ranks)}")
        elif not 1 <= self.input_axis < rank:
            out.append(f"crop input_axis {self.input_axis} is not an axis of {self.input!r}")
        if self.numerator < 1 or self.denominator < 1:
            out.append("crop scale numerator and denominator must be >= 1")
        return out

    def to_wire(self) -> dict[str, Any]:
        return {
            "axis": self.axis,
            "input": self.input,
            "input_axis": self.input_axis,
            "scale": [self.numerator, self.denominator],
        }

    @classmethod
    def from_wire(cls, obj: Any, what: str) -> CropAxis:
        """A crop axis from its wire map (an entry of an output descriptor's ``crop``);
        :meth:`problems` checks it against the model."""
        if not isinstance(obj, dict):
            raise ProtocolError(f"{what}: each crop entry must be a map")
        axis, input_axis = obj.get("axis"), obj.get("input_axis")
        name = obj.get("input")
        scale = _ints(obj.get("scale", [1, 1]), f"{what}: crop scale", 1)
        if type(axis) is not int or type(input_axis) is not int or not isinstance(name, str):
            raise ProtocolError(f"{what}: crop needs int axis, str input and int input_axis")
        if len(scale) != 2:
            raise ProtocolError(f"{what}: crop scale is [numerator, denominator]")
        return cls(axis, name, input_axis, scale[0], scale[1])


def cropped_extent(crop: CropAxis, input_extent: int) -> int:
    """The output extent that belongs to an input extent (rounded up)."""
    return -(-input_extent * crop.numerator // crop.denominator)


def bucket_elements(samples: int, bucket: Sequence[int]) -> int:
    """Elements of ``samples`` items padded to ``bucket``."""
    return samples * math.prod(bucket)


def padded_elements(samples: int, item_shape: Sequence[int], bucket: Sequence[int]) -> int:
    """Elements padding adds to a request of ``samples`` items of ``item_shape`` put in
    ``bucket`` (the numerator of the padded share of compute)."""
    return samples * (math.prod(bucket) - math.prod(item_shape))
