"""buckets.py: a padded model's batch — each request padded into the bucket, each output
cropped back to the request's own extent, and the padded share counted (§8.1, §8.3).

Pure numpy; no sockets. A BATCH of a model with pad rules has its bucket's item shapes
in ``inputs``; a request whose own shape differs says so in ``requests[i].shapes``
(:attr:`BatchItem.shapes <carpool.common.protocol.BatchItem.shapes>`), and its frames
hold its own bytes. :func:`stack_padded` copies each request into a batch buffer filled
with the rule's pad value (at the end of each dim: bottom and right of an image), so the
engine runs one bucket-shaped batch; :func:`cropped_outputs` gives each request its rows
of every output, cut back along the output's crop axes to the extent of the request's
own input (:func:`~carpool.common.padding.cropped_extent`). A request so answered gets
what it would get alone, padded to the same bucket.

Inputs in shared memory (§5.4) are read as in any batch; the broker lets one in only
with its bucket's shape. Outputs of requests padded here go in frames, never the ring
(§5.5).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.padding import CropAxis, PadRule, cropped_extent
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    Frame,
    check_frame_sizes,
    numpy_dtype,
    view,
)
from carpool.common.shm import RegionReader, ShmError, ShmRing
from carpool.worker.engines.base import Array
from carpool.worker.tensors import ItemError, replies, stack


def item_shapes(batch: BatchMeta, item: BatchItem) -> Sequence[tuple[int, ...]]:
    """A request's own item shape per input (the bucket's where it names none)."""
    return item.shapes if item.shapes is not None else [t.shape[1:] for t in batch.inputs]


def stack_padded(
    batch: BatchMeta,
    frames: Sequence[Frame],
    pads: Sequence[PadRule | None],
    reader: RegionReader | None = None,
) -> dict[str, Array]:
    """One bucket-shaped array per input: each request's tensor (its frame, or its
    shared-memory region) at its rows, the rest of the bucket the input's pad value.

    Raises:
        ProtocolError: the frames do not match the batch, or a request's own shape
            differs from the bucket on an input without a pad rule (the whole batch).
        ItemError: one request's shared-memory input cannot be read, or it is in
            shared memory and needs padding.
    """
    items = batch.items
    if all(item.shapes is None for item in items):
        return stack(batch, frames, reader)  # all in the bucket's shape: nothing to pad
    n_inputs = len(batch.inputs)
    if len(frames) != n_inputs * len(items):
        raise ProtocolError(
            f"batch {batch.batch_id}: {len(frames)} frames for {len(items)} requests "
            f"of {n_inputs} inputs"
        )
    dtypes = [numpy_dtype(t.dtype) for t in batch.inputs]
    buckets = [t.shape[1:] for t in batch.inputs]
    for i, item in enumerate(items):
        shapes = item_shapes(batch, item)
        for j, (shape, bucket) in enumerate(zip(shapes, buckets, strict=True)):
            if shape != bucket and (j >= len(pads) or pads[j] is None):
                raise ProtocolError(
                    f"batch {batch.batch_id}: input {batch.inputs[j].name!r} has no pad "
                    f"rule, but a request's shape {list(shape)} is not the batch's "
                    f"{list(bucket)}"
                )
        refs = item.shm
        if refs is not None:
            if reader is None:
                raise ProtocolError("this worker does not read shared-memory inputs")
            if item.shapes is not None:
                raise ItemError(
                    i,
                    ErrorCode.INVALID_ARGUMENT,
                    "an input in shared memory must have its bucket's shape",
                )
        own = frames[i * n_inputs : (i + 1) * n_inputs]
        for j, shape in enumerate(shapes):
            want = (
                0 if refs is not None and refs[j] is not None else _nbytes(item, shape, dtypes[j])
            )
            if len(own[j]) != want:
                check_frame_sizes(batch.request_tensors(item), own, refs)  # raises
    total = batch.total_samples
    out: dict[str, Array] = {}
    for j, spec in enumerate(batch.inputs):
        rule = pads[j] if j < len(pads) else None
        value = 0.0 if rule is None else rule.value
        data = np.full((total, *buckets[j]), value, dtype=dtypes[j])
        pos = 0
        for i, item in enumerate(items):
            shape = item_shapes(batch, item)[j]
            n = item.samples
            refs = item.shm
            ref = None if refs is None else refs[j]
            if ref is None:
                arr: Any = np.frombuffer(view(frames[i * n_inputs + j]), dtypes[j])
            else:
                assert reader is not None
                buf = bytearray(_nbytes(item, shape, dtypes[j]))
                try:
                    reader.read_into(ref, memoryview(buf))
                except ShmError as exc:
                    code = ErrorCode.UNAVAILABLE if exc.unreachable else ErrorCode.INVALID_ARGUMENT
                    raise ItemError(i, code, f"input {spec.name!r}: {exc}") from None
                arr = np.frombuffer(buf, dtypes[j])
            data[(slice(pos, pos + n), *(slice(0, d) for d in shape))] = arr.reshape((n, *shape))
            pos += n
        out[spec.name] = data
    return out


def _nbytes(item: BatchItem, shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    return item.samples * math.prod(shape) * dtype.itemsize


def padding_of(batch: BatchMeta, pads: Sequence[PadRule | None]) -> tuple[int, int] | None:
    """RESULT ``padding`` (§8.4): (elements padding adds, elements of the bucket-shaped
    inputs), over the inputs with a pad rule; None for a model without pad rules."""
    if not pads:
        return None
    padded = 0
    elements = 0
    for j, t in enumerate(batch.inputs):
        if j >= len(pads) or pads[j] is None:
            continue
        bucket = math.prod(t.shape[1:])
        for item in batch.items:
            own = bucket if item.shapes is None else math.prod(item.shapes[j])
            padded += item.samples * (bucket - own)
            elements += item.samples * bucket
    return padded, elements


def cropped_outputs(
    batch: BatchMeta,
    outputs: Mapping[str, Array],
    names: Sequence[str],
    crops: Sequence[Sequence[CropAxis]],
) -> list[dict[str, Array]]:
    """Each request's rows of every output (``names``, in the engine's output order,
    ``crops`` alike; empty: none cropped), cut back along the crop axes to the extent of
    its own input's axis (a request without own shapes keeps its rows whole).

    Raises:
        ProtocolError: an output's dim 0 is not the batch's sample count.
    """
    total = batch.total_samples
    index = {t.name: j for j, t in enumerate(batch.inputs)}
    arrays = []
    for name in names:
        arr = np.asarray(outputs[name])
        if arr.ndim == 0 or arr.shape[0] != total:
            raise ProtocolError(f"output {name!r} has shape {arr.shape}, expected dim 0 = {total}")
        arrays.append(arr)
    out: list[dict[str, Array]] = []
    start = 0
    for item in batch.items:
        stop = start + item.samples
        mine: dict[str, Array] = {}
        for k, (name, arr) in enumerate(zip(names, arrays, strict=True)):
            rows = arr[start:stop]
            axes = crops[k] if k < len(crops) else ()
            if item.shapes is not None and axes:
                cut: list[slice] = [slice(None)] * arr.ndim
                for c in axes:
                    extent = item.shapes[index[c.input]][c.input_axis - 1]
                    cut[c.axis] = slice(0, cropped_extent(c, extent))
                rows = rows[tuple(cut)]
            mine[name] = np.ascontiguousarray(rows)
        out.append(mine)
        start = stop
    return out


def padded_replies(
    batch: BatchMeta,
    outputs: Mapping[str, Array],
    names: Sequence[str],
    crops: Sequence[Sequence[CropAxis]],
    compute_ms: float,
    ring: ShmRing | None = None,
) -> tuple[list[int], list[Any]]:
    """:func:`~carpool.worker.tensors.replies` for a padded model's batch: requests
    padded here get their outputs cropped back (:func:`cropped_outputs`), in frames;
    a batch whose requests all have the bucket's shape is answered as any other."""
    if all(item.shapes is None for item in batch.items):
        return replies(batch, outputs, names, compute_ms, ring)
    total = batch.total_samples
    counts: list[int] = []
    frames: list[Any] = []
    for item, mine in zip(batch.items, cropped_outputs(batch, outputs, names, crops), strict=True):
        one = BatchMeta(batch.batch_id, batch.model, batch.inputs, (item,))
        k, reply = replies(one, mine, names, compute_ms, batch_size=total)
        counts.extend(k)
        frames.extend(reply)
    return counts, frames
