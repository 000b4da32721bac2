"""tensors.py: requests → one batch array per input, outputs → one reply per request.

Pure numpy; no sockets. Payload frames are wrapped with ``np.frombuffer`` (no copy); the
only copy is the concatenation into the batch, and none when a batch has one request.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.protocol import (
    MAX_EMPTY_SPAN_BYTES,
    MAX_RANK,
    BatchMeta,
    Frame,
    TensorMeta,
    check_frame_sizes,
    empty_span_bytes,
    numpy_dtype,
    output_ref_wire,
    reply_frames,
    reply_wire,
    tensor_wire,
    view,
    wire_dtype,
)
from carpool.common.shm import MAX_REF_BYTES, RegionReader, ShmError, ShmRing
from carpool.worker.engines.base import Array

_Plan = tuple[list[np.dtype[Any]], list[tuple[int, ...]], list[int]]
_BIG_ENDIAN_HOST = sys.byteorder == "big"


class ItemError(Exception):
    """One request of a batch cannot be served (its shared-memory input, §5.4); the
    rest of the batch can."""

    def __init__(self, index: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.index = index  # position in the batch's items
        self.code = code
        self.message = message


def unreadable(batch: BatchMeta, reader: RegionReader) -> list[ItemError]:
    """The requests whose shared-memory inputs cannot be read (region missing, another
    key, too short), all found in one pass before any batch buffer is allocated for
    the sizes they claim."""
    failed: list[ItemError] = []
    sample_bytes = None
    for i, item in enumerate(batch.items):
        if item.shm is None:
            continue
        if sample_bytes is None:
            sample_bytes = [
                math.prod(t.shape[1:]) * numpy_dtype(t.dtype).itemsize for t in batch.inputs
            ]
        for j, ref in enumerate(item.shm):
            if ref is None:
                continue
            try:
                reader.check(ref, item.samples * sample_bytes[j])
            except ShmError as exc:
                code = ErrorCode.UNAVAILABLE if exc.unreachable else ErrorCode.INVALID_ARGUMENT
                failed.append(ItemError(i, code, f"input {batch.inputs[j].name!r}: {exc}"))
                break
    return failed


def _input_plan(inputs: tuple[TensorMeta, ...]) -> _Plan:
    """Per batch input: its numpy dtype, item shape and bytes per sample, computed per
    batch."""
    dtypes = [numpy_dtype(t.dtype) for t in inputs]
    item_shapes = [t.shape[1:] for t in inputs]
    sample_bytes = [
        math.prod(shape) * dt.itemsize for shape, dt in zip(item_shapes, dtypes, strict=True)
    ]
    return dtypes, item_shapes, sample_bytes


def stack(
    batch: BatchMeta, frames: Sequence[Frame], reader: RegionReader | None = None
) -> dict[str, Array]:
    """Concatenate each input over the batch's requests (request-major frames); inputs
    in shared memory are read from their regions straight into the batch buffer.

    Raises:
        ProtocolError: the frames do not match the batch (the whole batch is bad).
        ItemError: one request's shared-memory input cannot be read.
    """
    n_inputs = len(batch.inputs)
    requests = batch.items
    if len(frames) != n_inputs * len(requests):
        raise ProtocolError(
            f"batch {batch.batch_id}: {len(frames)} frames for {len(requests)} requests "
            f"of {n_inputs} inputs"
        )
    dtypes, item_shapes, sample_bytes = _input_plan(batch.inputs)
    if len(requests) == 1 and requests[0].shm is None:
        # One request in its frames (low load): a view of each frame, no copy.
        n = requests[0].samples
        one: dict[str, Array] = {}
        for j, spec in enumerate(batch.inputs):
            frame = frames[j]
            if len(frame) != n * sample_bytes[j]:
                check_frame_sizes(batch.request_tensors(requests[0]), frames, None)  # raises
                raise _unpadded(batch)  # (its own shapes fit its frames: not this batch's)
            one[spec.name] = np.frombuffer(view(frame), dtypes[j]).reshape((n, *item_shapes[j]))
        return one
    shared = False
    for i, item in enumerate(requests):
        n = item.samples
        refs = item.shm
        if refs is not None:
            shared = True
        for j in range(n_inputs):
            want = 0 if refs is not None and refs[j] is not None else n * sample_bytes[j]
            if len(frames[i * n_inputs + j]) != want:
                own = frames[i * n_inputs : (i + 1) * n_inputs]
                # raises, with details
                check_frame_sizes(batch.request_tensors(item), own, refs)
                raise _unpadded(batch)
    if shared and reader is None:
        raise ProtocolError("this worker does not read shared-memory inputs")
    total = batch.total_samples
    out: dict[str, Array] = {}
    for j, spec in enumerate(batch.inputs):
        # One copy of this input's frames into one writable buffer, then one array over
        # it: no per-request numpy objects (and engines may work in place).
        data: Any = bytearray(total * sample_bytes[j])
        pos = 0
        for i, frame in enumerate(frames[j::n_inputs]):
            refs = requests[i].shm
            ref = None if refs is None else refs[j]
            if ref is None:
                size = len(frame)
                data[pos : pos + size] = frame
            else:
                assert reader is not None
                size = requests[i].samples * sample_bytes[j]
                try:
                    reader.read_into(ref, memoryview(data)[pos : pos + size])
                except ShmError as exc:
                    code = ErrorCode.INVALID_ARGUMENT
                    if exc.unreachable:
                        code = ErrorCode.UNAVAILABLE
                    raise ItemError(i, code, f"input {spec.name!r}: {exc}") from None
            pos += size
        out[spec.name] = np.frombuffer(data, dtypes[j]).reshape((total, *item_shapes[j]))
    return out


def _unpadded(batch: BatchMeta) -> ProtocolError:
    return ProtocolError(
        f"batch {batch.batch_id}: a request's own shapes differ from the batch's, and "
        f"model {batch.model!r} has no pad rule here"
    )


#: Outputs at least this large go through the worker's ring when the client asked (§5.5).
SHM_OUTPUT_MIN_BYTES = 64 * 1024


def replies(
    batch: BatchMeta,
    outputs: Mapping[str, Array],
    output_names: Sequence[str],
    compute_ms: float,
    ring: ShmRing | None = None,
    batch_size: int | None = None,
) -> tuple[list[int], list[Any]]:
    """Client reply frames for every request of a batch; the large outputs of requests
    that asked for shared-memory outputs go into ``ring`` (when it is free) instead.
    ``batch_size``: what the replies say the batch was (default: this batch's samples).

    Returns:
        (frame count per request, all frames in request order), ready for a RESULT.
    Raises:
        ProtocolError: an output's dim 0 does not equal the batch's sample count.
    """
    total = batch.total_samples
    arrays = []
    described = []  # (name, wire dtype, item shape) per output, once per batch
    for name in output_names:
        arr = np.ascontiguousarray(outputs[name])
        if arr.ndim == 0 or arr.shape[0] != total:
            raise ProtocolError(f"output {name!r} has shape {arr.shape}, expected dim 0 = {total}")
        if arr.ndim > MAX_RANK or (
            arr.size == 0 and empty_span_bytes(arr.shape, arr.itemsize) > MAX_EMPTY_SPAN_BYTES
        ):
            # A reply the client could not read would leave it waiting until its timeout:
            # the batch fails now, with the reason. (Zero-size dims after dim 0 are fine:
            # a detector that found nothing answers [n, 0, 6], §5.1.)
            raise ProtocolError(
                f"output {name!r} has shape {arr.shape}: protocol v1 carries tensors of rank "
                f"1..{MAX_RANK}, and empty ones whose other dims span at most "
                f"{MAX_EMPTY_SPAN_BYTES} bytes (docs/protocol.md §5.1, §14)"
            )
        order = arr.dtype.byteorder
        if order == ">" or (order == "=" and _BIG_ENDIAN_HOST):
            arr = arr.astype(arr.dtype.newbyteorder("<"))  # little-endian on the wire
        arrays.append(arr)
        # wire_dtype, not dtype.name: speed: docs/benchmarks.md "Why the hot path looks as it does"
        described.append((name, wire_dtype(arr.dtype), list(arr.shape[1:])))
    single = len(batch.items) == 1
    if single:
        # One request: its rows are the whole outputs, sent as they are.
        rows: list[Any] = arrays
        row_bytes: list[int] = []
    else:
        # A request's rows as a slice of a flat byte view (flat uint8 because
        # memoryview.cast refuses arrays with a zero-size dim).
        # speed: docs/benchmarks.md "Why the hot path looks as it does"
        rows = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]  # type: ignore[arg-type]
        row_bytes = [a.itemsize * math.prod(a.shape[1:]) for a in arrays]
    descs: dict[int, list[dict[str, Any]]] = {}  # reply "outputs" by sample count
    counts: list[int] = []
    frames: list[Any] = []
    start = 0
    since: int | None = None  # where this batch's first output went in the ring
    one = rows[0] if len(rows) == 1 and not single else None  # (the common case)
    for item in batch.items:
        n = item.samples
        stop = start + n
        if single:
            pieces = rows
        elif one is not None:
            pieces = [one[start * row_bytes[0] : stop * row_bytes[0]]]
        else:
            pieces = [mv[start * rb : stop * rb] for mv, rb in zip(rows, row_bytes, strict=True)]
        start = stop
        described_n = descs.get(n)
        if described_n is None:
            described_n = descs[n] = [
                tensor_wire(name, d, [n, *shape]) for name, d, shape in described
            ]
        if ring is not None and item.shm_outputs and not item.simple:
            described_n, pieces, since = _into_ring(ring, described_n, pieces, since)
        meta = reply_wire(
            item.request_id, described_n, batch_size or total, item.queue_ms, compute_ms
        )
        encoded = reply_frames(meta, pieces, simple=item.simple)
        counts.append(len(encoded))
        frames.extend(encoded)
    return counts, frames


def _into_ring(
    ring: ShmRing, described: list[dict[str, Any]], pieces: Sequence[Any], since: int | None
) -> tuple[list[dict[str, Any]], list[Any], int | None]:
    """One reply's large outputs written into the ring: their descriptors get a
    reference and their frames go empty. The rest stay in their frames: what the ring
    cannot take now (a reader holds the bytes, or it would come round over this batch's
    own outputs since ``since``). Returns the batch's ``since`` too."""
    datas = [
        p if isinstance(p, memoryview) else memoryview(p.reshape(-1).view(np.uint8)) for p in pieces
    ]
    big = [i for i, d in enumerate(datas) if SHM_OUTPUT_MIN_BYTES <= len(d) <= MAX_REF_BYTES]
    placed = ring.place([len(datas[i]) for i in big], since) if big else None
    if placed is None:
        return described, list(pieces), since
    out_desc = list(described)
    out_pieces = list(pieces)
    for i, spot in zip(big, placed, strict=True):
        if spot is None:
            continue
        if since is None:
            since = spot[1]
        if ring.write(spot[0], datas[i]):
            ref = output_ref_wire((ring.name, spot[0], ring.key, spot[1]))
            out_desc[i] = {**described[i], "shm": ref}
            out_pieces[i] = b""
    return out_desc, out_pieces, since
