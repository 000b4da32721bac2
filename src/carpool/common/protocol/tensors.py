"""tensors.py: tensor descriptors (protocol §5.1) and their frames — pure.

A descriptor ``{name, dtype, shape}`` names one tensor of a message, whose bytes follow
in its own frame (or lie in shared memory, :mod:`.refs`). This module validates
descriptors, computes the signature under which a validated layout is remembered, and
checks that frames are as long as their descriptors say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.common import codec
from carpool.common.errors import ProtocolError
from carpool.common.protocol.frames import (
    MAX_EMPTY_SPAN_BYTES,
    MAX_RANK,
    MAX_TENSORS,
    Frame,
    require_map,
    require_name,
)
from carpool.common.protocol.refs import MAX_REF_BYTES


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name, wire dtype and shape of one tensor. ``-1`` marks a dynamic dim in a spec."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Payload size in bytes (only meaningful when no dim is dynamic)."""
        return math.prod(self.shape) * codec.ITEMSIZE[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        return tensor_wire(self.name, self.dtype, list(self.shape))

    @classmethod
    def from_wire(
        cls, obj: Any, *, allow_dynamic: bool = False, allow_empty: bool = False
    ) -> TensorMeta:
        """A descriptor checked (§5.1). ``allow_dynamic``: dims may be -1 (model specs);
        ``allow_empty``: dims after the batch dim may be 0 (replies: a detector that
        found nothing answers ``[n, 0, 6]``)."""
        m = require_map(obj, "tensor")
        name = require_name(m.get("name"), "tensor")
        dtype = m.get("dtype")
        if not isinstance(dtype, str) or dtype not in codec.DTYPES:
            raise ProtocolError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        shape = m.get("shape")
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RANK:
            # Rank >= 1: dim 0 is the batch (sample) dimension.
            raise ProtocolError(f"tensor {name!r}: shape must be a list of 1..{MAX_RANK} ints")
        low = -1 if allow_dynamic else 1
        empty = False
        for i, d in enumerate(shape):
            if isinstance(d, bool) or not isinstance(d, int) or d < low or d == 0:
                if d == 0 and allow_empty and i > 0 and type(d) is int:
                    empty = True
                    continue
                raise ProtocolError(f"tensor {name!r}: bad dimension {d!r} in shape {shape}")
        if empty:
            # An empty payload bounds nothing: the other dims could describe an array no
            # client can build (numpy refuses [1, 0, 2**61] float32). §14's limit.
            span = empty_span_bytes(shape, codec.ITEMSIZE[dtype])
            if span > MAX_EMPTY_SPAN_BYTES:
                raise ProtocolError(
                    f"tensor {name!r}: shape {shape} spans {span} bytes without its zero "
                    f"dims; at most {MAX_EMPTY_SPAN_BYTES}"
                )
        return cls(name, dtype, tuple(shape))


def tensor_wire(name: str, dtype: str, shape: list[int]) -> dict[str, Any]:
    """A tensor descriptor map: the one encoder of ``{name, dtype, shape}`` (callers that
    hold the fields build descriptors without a :class:`TensorMeta`).
    speed: docs/benchmarks.md "Why the hot path looks as it does"."""
    return {"name": name, "dtype": dtype, "shape": shape}


def empty_span_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes a shape spans with its zero dims read as 1 (§14 bounds it for empty tensors)."""
    return itemsize * math.prod(d or 1 for d in shape)


def tensor_list(
    obj: Any, what: str, *, allow_dynamic: bool = False, allow_empty: bool = False
) -> tuple[TensorMeta, ...]:
    if not isinstance(obj, list) or not obj or len(obj) > MAX_TENSORS:
        raise ProtocolError(f"{what}: expected a list of 1..{MAX_TENSORS} tensors")
    tensors = tuple(
        TensorMeta.from_wire(t, allow_dynamic=allow_dynamic, allow_empty=allow_empty) for t in obj
    )
    if len({t.name for t in tensors}) != len(tensors):
        raise ProtocolError(f"{what}: duplicate tensor names")
    return tensors


#: (name, dtype, shape) per tensor descriptor: the key under which a layout that passed
#: full validation is remembered.
Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


def tensor_signature(descriptors: Any) -> Signature | None:
    """The signature of wire tensor descriptors, for looking up a layout validated before;
    None if they are not maps with a str name and dtype and a list-of-ints shape. Says
    nothing of validity itself (a bool, float or bin shape would hash like the ints it
    resembles, so those are refused here rather than matched)."""
    if type(descriptors) is not list:
        return None
    sig = []
    for t in descriptors:
        if type(t) is not dict:
            return None
        name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
        if type(name) is not str or type(dtype) is not str or type(shape) is not list:
            return None
        for d in shape:
            if type(d) is not int:
                return None
        sig.append((name, dtype, tuple(shape)))
    return tuple(sig)


def check_frame_sizes(
    tensors: Sequence[TensorMeta],
    frames: Sequence[Frame],
    refs: Sequence[object | None] | None = None,
) -> None:
    """Check one frame per tensor, each exactly as long as its dtype and shape say (and
    empty for a tensor whose bytes are in shared memory, §5.4)."""
    if len(frames) != len(tensors):
        raise ProtocolError(f"expected {len(tensors)} tensor frames, got {len(frames)}")
    for i, (t, f) in enumerate(zip(tensors, frames, strict=True)):
        if refs is not None and refs[i] is not None:
            if len(f):
                raise ProtocolError(
                    f"tensor {t.name!r} is in shared memory: its frame must be empty, "
                    f"it has {len(f)} bytes"
                )
            if t.nbytes > MAX_REF_BYTES:
                raise ProtocolError(
                    f"tensor {t.name!r}: {t.nbytes} bytes in shared memory, at most "
                    f"{MAX_REF_BYTES} per tensor"
                )
            continue
        if len(f) != t.nbytes:
            raise ProtocolError(
                f"tensor {t.name!r}: {t.dtype}{list(t.shape)} needs {t.nbytes} bytes, "
                f"frame has {len(f)}"
            )
