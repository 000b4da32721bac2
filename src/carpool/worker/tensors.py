"""tensors.py: requests → one batch array per input, outputs → one reply per request.

Pure numpy; no sockets. Payload frames are wrapped with ``np.frombuffer`` (no copy); the
only copy is the concatenation into the batch, and none when a batch has one request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from carpool.common.codec import numpy_dtype, pack
from carpool.common.errors import ProtocolError
from carpool.common.protocol import (
    BatchMeta,
    Command,
    Frame,
    ReplyMeta,
    TensorMeta,
    check_frame_sizes,
    encode_reply,
    header,
    view,
)
from carpool.worker.engines.base import Array

_REPLY = header(Command.REPLY)


def stack(batch: BatchMeta, frames: Sequence[Frame]) -> dict[str, Array]:
    """Concatenate each input over the batch's requests (request-major frames)."""
    n_inputs = len(batch.inputs)
    if len(frames) != n_inputs * len(batch.items):
        raise ProtocolError(
            f"batch {batch.batch_id}: {len(frames)} frames for {len(batch.items)} requests "
            f"of {n_inputs} inputs"
        )
    # Per input, once per batch: dtype, item shape and bytes per sample.
    dtypes = [numpy_dtype(t.dtype) for t in batch.inputs]
    items = [t.shape[1:] for t in batch.inputs]
    sample_bytes = [math.prod(shape) * dt.itemsize for shape, dt in zip(items, dtypes, strict=True)]
    parts: list[list[Array]] = [[] for _ in range(n_inputs)]
    for i, item in enumerate(batch.items):
        n = item.samples
        own = frames[i * n_inputs : (i + 1) * n_inputs]
        for j, frame in enumerate(own):
            if len(frame) != n * sample_bytes[j]:
                check_frame_sizes(batch.request_tensors(item), own)  # raises, with details
            parts[j].append(np.frombuffer(view(frame), dtypes[j]).reshape((n, *items[j])))
    return {
        spec.name: arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        for spec, arrays in zip(batch.inputs, parts, strict=True)
    }


def replies(
    batch: BatchMeta,
    outputs: Mapping[str, Array],
    output_names: Sequence[str],
    compute_ms: float,
) -> tuple[list[int], list[Any]]:
    """Client reply frames for every request of a batch.

    Returns:
        (frame count per request, all frames in request order), ready for a RESULT.
    Raises:
        ProtocolError: an output's dim 0 does not equal the batch's sample count.
    """
    total = batch.total_samples
    arrays = []
    for name in output_names:
        arr = np.ascontiguousarray(outputs[name])
        if arr.ndim == 0 or arr.shape[0] != total:
            raise ProtocolError(f"output {name!r} has shape {arr.shape}, expected dim 0 = {total}")
        arrays.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
    # Names, dtypes and item shapes once per batch (dtype.name is slow in numpy).
    described = [
        (name, arr.dtype.name, list(arr.shape[1:]))
        for name, arr in zip(output_names, arrays, strict=True)
    ]
    compute = round(compute_ms, 3)
    counts: list[int] = []
    frames: list[Any] = []
    start = 0
    for item in batch.items:
        stop = start + item.samples
        pieces = [a[start:stop] for a in arrays]
        start = stop
        if item.simple:
            meta = ReplyMeta(
                item.request_id,
                tuple(TensorMeta(n, d, (item.samples, *shape)) for n, d, shape in described),
                batch_size=total,
                queue_ms=item.queue_ms,
                compute_ms=compute_ms,
            )
            encoded = encode_reply(meta, pieces, simple=True)
        else:
            # ReplyMeta(...).to_wire(), built directly: this runs for every request.
            wire = {
                "id": item.request_id,
                "outputs": [
                    {"name": n, "dtype": d, "shape": [item.samples, *shape]}
                    for n, d, shape in described
                ],
                "batch_size": total,
                "queue_ms": round(item.queue_ms, 3),
                "compute_ms": compute,
            }
            encoded = [_REPLY, pack(wire), *pieces]
        counts.append(len(encoded))
        frames.extend(encoded)
    return counts, frames
