"""tensors.py: requests → one batch array per input, outputs → one reply per request.

Pure numpy; no sockets. Payload frames are wrapped with ``np.frombuffer`` (no copy); the
only copy is the concatenation into the batch, and none when a batch has one request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from carpool.common.codec import numpy_dtype
from carpool.common.errors import ProtocolError
from carpool.common.protocol import (
    BatchMeta,
    Frame,
    ReplyMeta,
    TensorMeta,
    check_frame_sizes,
    encode_reply,
    view,
)
from carpool.worker.engines.base import Array


def stack(batch: BatchMeta, frames: Sequence[Frame]) -> dict[str, Array]:
    """Concatenate each input over the batch's requests (request-major frames)."""
    n_inputs = len(batch.inputs)
    if len(frames) != n_inputs * len(batch.items):
        raise ProtocolError(
            f"batch {batch.batch_id}: {len(frames)} frames for {len(batch.items)} requests "
            f"of {n_inputs} inputs"
        )
    parts: list[list[Array]] = [[] for _ in range(n_inputs)]
    for i, item in enumerate(batch.items):
        metas = batch.request_tensors(item)
        own = frames[i * n_inputs : (i + 1) * n_inputs]
        check_frame_sizes(metas, own)
        for j, (meta, frame) in enumerate(zip(metas, own, strict=True)):
            parts[j].append(np.frombuffer(view(frame), numpy_dtype(meta.dtype)).reshape(meta.shape))
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
    counts: list[int] = []
    frames: list[Any] = []
    start = 0
    for item in batch.items:
        stop = start + item.samples
        pieces = [a[start:stop] for a in arrays]
        start = stop
        meta = ReplyMeta(
            item.request_id,
            tuple(
                TensorMeta(n, p.dtype.name, p.shape)
                for n, p in zip(output_names, pieces, strict=True)
            ),
            batch_size=total,
            queue_ms=item.queue_ms,
            compute_ms=compute_ms,
        )
        encoded = encode_reply(meta, pieces, simple=item.simple)
        counts.append(len(encoded))
        frames.extend(encoded)
    return counts, frames
