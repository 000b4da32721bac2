"""A padded model's batch at the worker (protocol §8.1, §8.3, §8.4), against numpy: each
request padded into the bucket with the rule's value (bottom and right), the engine run
on the bucket-shaped batch, each output cropped back to the request's own extent (what
the request would get alone, padded to the same bucket), the padded share counted for
RESULT, and BATCH item shapes that do not fit the bucket refused, never a crash."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool.common.clock import MonotonicClock
from carpool.common.errors import ErrorCode, ProtocolError
from carpool.common.padding import CropAxis, PadRule, cropped_extent
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    Command,
    ReplyMeta,
    TensorMeta,
    decode_meta,
    parse_header,
)
from carpool.common.protocol import frames as codec
from carpool.worker.buckets import cropped_outputs, padding_of, stack_padded
from carpool.worker.core import RunBatch
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.run import run_job
from carpool.worker.shapes import CropConfig, InputConfig, ModelShapes, OutputConfig

RULE = PadRule(multiple_of=(4, 4), value=-1.0)
BUCKET = (8, 12)
INPUTS = (TensorMeta("x", "float32", (-1, *BUCKET)),)


def padded_engine() -> SyntheticEngine:
    """A synthetic model whose ``x`` has RULE, and ``y`` (of ``x``'s shape) is cropped
    back along both axes."""
    crops = tuple(CropConfig(a, "x", a) for a in (1, 2))
    shapes = ModelShapes(inputs={"x": InputConfig(pad=RULE)}, outputs={"y": OutputConfig(crops)})
    return SyntheticEngine(item_shape=(-1, -1), max_batch=8, shapes=shapes)


def image(rid: int, n: int, h: int, w: int) -> np.ndarray:
    return (np.arange(n * h * w, dtype=np.float32).reshape(n, h, w) + 1000 * rid).astype(np.float32)


def batch_of(*requests: tuple[int, np.ndarray]) -> tuple[BatchMeta, list[bytes]]:
    items = []
    for rid, arr in requests:
        own = arr.shape[1:]
        items.append(
            BatchItem(rid, arr.shape[0], False, 0.0, shapes=None if own == BUCKET else (own,))
        )
    return BatchMeta(3, "m", INPUTS, tuple(items)), [a.tobytes() for _, a in requests]


def alone_padded(arr: np.ndarray, value: float = -1.0) -> np.ndarray:
    """The oracle: one request padded to the bucket with numpy, bottom and right."""
    h, w = arr.shape[1:]
    return np.pad(arr, ((0, 0), (0, BUCKET[0] - h), (0, BUCKET[1] - w)), constant_values=value)


def decode(frames: list[Any]) -> tuple[ReplyMeta, np.ndarray]:
    assert parse_header(frames[0]) is Command.REPLY
    meta = ReplyMeta.from_wire(decode_meta(frames[1]))
    (t,) = meta.outputs
    data = np.frombuffer(bytes(memoryview(frames[2])), codec.numpy_dtype(t.dtype))
    return meta, data.reshape(t.shape)


def test_requests_are_padded_into_the_bucket_with_the_rule_value() -> None:
    a, b, c = image(1, 1, 5, 12), image(2, 2, 8, 9), image(3, 1, 8, 12)
    batch, frames = batch_of((1, a), (2, b), (3, c))
    (x,) = stack_padded(batch, frames, (RULE,)).values()
    assert x.shape == (4, *BUCKET)
    np.testing.assert_array_equal(x, np.concatenate([alone_padded(a), alone_padded(b), c]))
    assert padding_of(batch, (RULE,)) == ((8 - 5) * 12 + 2 * 8 * (12 - 9), 4 * 8 * 12)


def test_outputs_are_cropped_back_to_each_request_extent() -> None:
    a, b = image(1, 1, 5, 7), image(2, 1, 8, 12)
    batch, frames = batch_of((1, a), (2, b))
    x = stack_padded(batch, frames, (RULE,))["x"]
    # An output at half the input's resolution along W (rounded up), whole along H.
    out = {"y": x[:, :, ::2]}
    crops = ((CropAxis(2, "x", 2, 1, 2),),)
    first, second = cropped_outputs(batch, out, ["y"], crops)
    np.testing.assert_array_equal(first["y"], alone_padded(a)[:, :, ::2][:, :, :4])
    np.testing.assert_array_equal(second["y"], b[:, :, ::2])


def test_a_padded_batch_answers_each_request_as_if_alone_padded() -> None:
    engine = padded_engine()
    requests = [(1, image(1, 1, 5, 12)), (2, image(2, 2, 7, 3)), (3, image(3, 1, 8, 12))]
    batch, frames = batch_of(*requests)
    outcome = run_job({"m": engine}, RunBatch(0, batch, frames), MonotonicClock())
    assert outcome.error is None
    assert engine.batches[-1] == (4, BUCKET)  # one bucket-shaped run
    assert outcome.padding == padding_of(batch, (RULE,))
    pos = 0
    for (rid, arr), count in zip(requests, outcome.counts, strict=True):
        meta, got = decode(list(outcome.frames[pos : pos + count]))
        pos += count
        assert meta.request_id == rid
        assert meta.batch_size == 4
        h, w = arr.shape[1:]
        np.testing.assert_array_equal(got, synthetic_output(alone_padded(arr))[:, :h, :w])


def test_an_unpadded_model_reports_no_padding() -> None:
    engine = SyntheticEngine(item_shape=BUCKET)
    batch, frames = batch_of((1, image(1, 1, *BUCKET)))
    outcome = run_job({"m": engine}, RunBatch(0, batch, frames), MonotonicClock())
    assert outcome.error is None
    assert outcome.padding is None


@pytest.mark.parametrize(
    "shapes",
    [[[9, 12]], [[8]], [[8, 12, 1]], [[8, -1]], [[8, 12], [8, 12]], "no", [["8", 12]]],
    ids=["larger", "rank-low", "rank-high", "negative", "two", "not-a-list", "not-ints"],
)
def test_batch_item_shapes_that_do_not_fit_the_bucket_are_refused(shapes: Any) -> None:
    meta = {
        "batch": 1,
        "model": "m",
        "inputs": [t.to_wire() for t in INPUTS],
        "requests": [{"id": 1, "n": 1, "shapes": shapes}],
    }
    with pytest.raises(ProtocolError, match="shape"):
        BatchMeta.from_wire(meta)


def test_a_wrong_frame_size_for_its_own_shape_fails_the_batch_invalid_argument() -> None:
    engine = padded_engine()
    batch, _ = batch_of((1, image(1, 1, 5, 12)))
    outcome = run_job({"m": engine}, RunBatch(0, batch, [b"\0" * 16]), MonotonicClock())
    assert outcome.error is not None
    assert outcome.error[0] is ErrorCode.INVALID_ARGUMENT


def test_own_shapes_on_an_input_without_pad_rule_fail_the_batch() -> None:
    engine = SyntheticEngine(item_shape=(-1, -1), max_batch=8)
    a = image(1, 1, 5, 12)
    batch, frames = batch_of((1, a))
    # (the broker never sends these for a model without pad rules; a worker says so)
    with pytest.raises(ProtocolError, match="no pad rule"):
        stack_padded(batch, frames, (None,))
    outcome = run_job({"m": engine}, RunBatch(0, batch, frames), MonotonicClock())
    assert outcome.error is not None
    assert outcome.error[0] is ErrorCode.INVALID_ARGUMENT


def test_the_catalogue_pads_the_ocr_models() -> None:
    """A 720-row frame goes to the detector padded to 736 rows and is answered at 720;
    recognizer lines pad to width buckets, their CTC sequence cropped to W / 8."""
    from carpool.worker.repository import builtin

    models = builtin().models
    det = models["ppocr-det"].config
    det_pad = det.inputs["x"].pad
    assert det_pad is not None
    assert det_pad.bucket((3, 720, 1280)) == (3, 736, 1280)
    h, w = (c.crop_axis() for c in det.outputs["sigmoid_0.tmp_0"].crop)
    assert [h.axis, w.axis] == [2, 3]
    assert [cropped_extent(h, 720), cropped_extent(w, 1280)] == [720, 1280]
    rec = models["ppocr-rec"].config
    rec_pad = rec.inputs["x"].pad
    assert rec_pad is not None
    assert rec_pad.bucket((3, 48, 100)) == (3, 48, 160)
    assert rec_pad.bucket((3, 48, 1000)) == (3, 48, 1280)
    assert rec_pad.bucket((3, 48, 3000)) is None
    (seq,) = (c.crop_axis() for c in rec.outputs["softmax_11.tmp_0"].crop)
    assert cropped_extent(seq, 100) == 13


def test_a_batch_with_shapes_larger_than_its_bucket_is_answered_failed() -> None:
    """Through the worker's decoder and core: FAILED INVALID_ARGUMENT for the batch."""
    from carpool.common.protocol import decode_from_broker, encode
    from carpool.worker.core import Answer, WorkerCore

    meta = {
        "batch": 5,
        "model": "m",
        "inputs": [t.to_wire() for t in INPUTS],
        "requests": [{"id": 1, "n": 1, "simple": False, "queue_ms": 0.0, "shapes": [[9, 12]]}],
    }
    engine = padded_engine()
    core = WorkerCore("w", [engine.info.spec("m")])
    core.on_connect(0.0)
    action = core.on_broker(0.0, decode_from_broker(encode(Command.BATCH, meta, [b""])))
    assert isinstance(action, Answer)
    failed = action.message.failed
    assert (failed.batch_id, failed.code) == (5, ErrorCode.INVALID_ARGUMENT)
    assert "does not fit the batch's bucket [8, 12]" in failed.message
