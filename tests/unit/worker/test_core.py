"""worker/core.py: WorkerCore and BusyMeter with an injected clock."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    Command,
    FailedMeta,
    ModelSpec,
    Ready,
    ResultMeta,
    TensorMeta,
    ToBroker,
    decode_from_broker,
    decode_meta,
    encode,
    header,
    parse_header,
)
from carpool.common.protocol import frames as codec
from carpool.worker.core import (
    Action,
    Answer,
    BusyMeter,
    JobOutcome,
    Reconnect,
    RunBatch,
    WorkerCore,
    WorkerState,
)

T0 = 100.0
SPEC = ModelSpec(
    "m", (TensorMeta("x", "float32", (-1, 4)),), (TensorMeta("y", "float32", (-1, 2)),), 8, (4, 8)
)
OTHER = ModelSpec("n", (TensorMeta("a", "uint8", (-1, 3)),), (TensorMeta("b", "int64", (-1,)),), 2)
BATCH = BatchMeta(
    7,
    "m",
    (TensorMeta("x", "float32", (-1, 4)),),
    (BatchItem(1, 1, False, 0.5), BatchItem(2, 2, True, 1.0)),
)


def finish(
    w: WorkerCore,
    now: float,
    epoch: int,
    batch_id: int,
    start: float,
    end: float,
    counts: list[int],
    frames: list[Any],
) -> Any:
    """The core's answer to a batch the engine ran from ``start`` to ``end``."""
    return w.on_job_done(now, JobOutcome(epoch, batch_id, "m", start, end, counts, frames))


def fail(
    w: WorkerCore,
    now: float,
    epoch: int,
    batch_id: int,
    start: float,
    end: float,
    code: ErrorCode,
    message: str,
) -> Any:
    """The core's answer to a batch the engine failed after running from ``start``."""
    return w.on_job_done(now, JobOutcome(epoch, batch_id, "m", start, end, error=(code, message)))


def core(**kwargs: Any) -> WorkerCore:
    kwargs.setdefault("heartbeat_s", 1.0)
    return WorkerCore("edge-1", [SPEC, OTHER], **kwargs)


def connected(**kwargs: Any) -> WorkerCore:
    w = core(**kwargs)
    w.on_connect(T0)
    return w


def decoded(msg: ToBroker) -> tuple[Command, dict[str, Any], list[Any]]:
    """A message's command, meta and payloads, through its wire form."""
    frames = msg.to_frames()
    return parse_header(frames[0]), decode_meta(frames[1]), frames[2:]


def on_broker(w: WorkerCore, now: float, frames: list[Any]) -> Action | None:
    """The broker's frames, decoded as the worker's loop does, to the core."""
    return w.on_broker(now, decode_from_broker(frames, w.batch_inputs))


# --------------------------------------------------------------------------- connection


def test_starts_connecting_and_quiet() -> None:
    w = core()
    assert w.state is WorkerState.CONNECTING
    assert w.on_tick(T0) == ([], None)
    assert w.next_wakeup(T0) is None


@pytest.mark.parametrize(("slots", "heartbeat_s", "heartbeat_ms"), [(2, 1.0, 1000), (5, 0.25, 250)])
def test_ready_content(slots: int, heartbeat_s: float, heartbeat_ms: int) -> None:
    w = core(slots=slots, heartbeat_s=heartbeat_s)
    command, meta, payloads = decoded(w.on_connect(T0))
    assert command is Command.READY
    assert payloads == []
    assert Ready.from_wire(meta) == Ready("edge-1", slots, (SPEC, OTHER), heartbeat_ms)
    assert w.state is WorkerState.READY
    assert w.epoch == 1


def test_each_connection_is_a_new_epoch() -> None:
    w = core()
    w.on_connect(T0)
    w.on_connect(T0 + 5)
    assert w.epoch == 2


# --------------------------------------------------------------------------- broker messages


def test_batch_becomes_run_batch() -> None:
    w = connected()
    payloads = [bytes(16), bytearray(32)]
    action = on_broker(w, T0 + 0.1, encode(Command.BATCH, BATCH.to_wire(), payloads))
    assert isinstance(action, RunBatch)
    assert action.epoch == 1
    assert action.batch == BATCH
    assert len(action.frames) == 2
    assert all(a is b for a, b in zip(action.frames, payloads, strict=True))


def test_unreadable_batch_is_answered_failed() -> None:
    w = connected()
    bad = {**BATCH.to_wire(), "requests": []}
    action = on_broker(w, T0, encode(Command.BATCH, bad))
    assert isinstance(action, Answer)
    command, meta, _ = decoded(action.message)
    assert command is Command.FAILED
    failed = FailedMeta.from_wire(meta)
    assert (failed.batch_id, failed.code) == (7, ErrorCode.INVALID_ARGUMENT)
    assert "requests" in failed.message


def test_batch_without_a_readable_id_is_dropped() -> None:
    w = connected()
    assert on_broker(w, T0, encode(Command.BATCH, {"batch": "7", "model": "m"})) is None


def test_disconnect_becomes_reconnect() -> None:
    w = connected()
    action = on_broker(w, T0, encode(Command.DISCONNECT, {"reason": "unknown worker"}))
    assert isinstance(action, Reconnect)
    assert "unknown worker" in action.reason


@pytest.mark.parametrize(
    "frames",
    [
        encode(Command.HEARTBEAT, {}),
        [b"junk"],
        [b"junk", b"more"],
        [b"CP\x02\x11", codec.pack({})],
        [header(Command.HEARTBEAT), b"\xc1"],
        encode(Command.REQUEST, {"id": 1}),
        encode(Command.READY, {}),
    ],
    ids=["heartbeat", "one-frame", "garbage", "version", "bad-meta", "request", "ready"],
)
def test_other_broker_messages_need_no_action(frames: list[Any]) -> None:
    assert on_broker(connected(), T0, frames) is None


# --------------------------------------------------------------------------- time


def test_heartbeats_at_the_interval() -> None:
    w = connected(heartbeat_s=0.25, liveness=100)
    sent = []
    now = T0
    while now < T0 + 1.0:
        now = w.next_wakeup(now)  # type: ignore[assignment]
        msgs, lost = w.on_tick(now)
        assert lost is None
        sent += [(now, decoded(m)) for m in msgs]
    assert [t - T0 for t, _ in sent] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for _, (command, meta, payloads) in sent:
        assert command is Command.HEARTBEAT
        assert set(meta) == {"rho", "busy_ms"}
        assert meta["busy_ms"] == 0  # the inference thread is idle
        assert payloads == []


def test_no_heartbeat_before_it_is_due() -> None:
    w = connected(heartbeat_s=1.0)
    assert w.on_tick(T0 + 0.999) == ([], None)
    msgs, _ = w.on_tick(T0 + 1.0)
    assert len(msgs) == 1
    assert w.on_tick(T0 + 1.5) == ([], None)
    assert len(w.on_tick(T0 + 2.0)[0]) == 1


@pytest.mark.parametrize(("liveness", "heartbeat_s"), [(3, 1.0), (1, 0.5), (5, 0.25)])
def test_broker_silence_means_reconnect(liveness: int, heartbeat_s: float) -> None:
    w = connected(liveness=liveness, heartbeat_s=heartbeat_s)
    limit = liveness * heartbeat_s
    assert w.next_wakeup(T0 + limit / 2) <= T0 + limit  # type: ignore[operator]
    _, lost = w.on_tick(math.nextafter(T0 + limit, 0))
    assert lost is None
    _, lost = w.on_tick(T0 + limit)
    assert isinstance(lost, Reconnect)
    assert "silent" in lost.reason
    assert w.on_tick(T0 + limit)[0] == []  # no heartbeat to a lost broker


def test_a_broker_message_keeps_the_connection() -> None:
    w = connected(liveness=3, heartbeat_s=1.0)
    on_broker(w, T0 + 2.0, encode(Command.HEARTBEAT, {}))
    assert w.on_tick(T0 + 4.9)[1] is None
    assert w.next_wakeup(T0 + 4.9) <= T0 + 5.0  # type: ignore[operator]
    assert isinstance(w.on_tick(T0 + 5.0)[1], Reconnect)


@pytest.mark.parametrize("frames", [[b"junk"], [b"CP\x01\x11"], [b"\x00", b"\x01"]])
def test_garbage_is_no_broker_word_it_keeps_nothing_alive(frames: list[Any]) -> None:
    """What a peer posing as the broker sends (a raw TCP peer's bytes read as ZMTP 1.0
    messages, say): dropped and counted; it neither keeps the connection alive nor says
    that a broker registered this worker."""
    w = connected(liveness=3, heartbeat_s=1.0)
    assert on_broker(w, T0 + 2.0, frames) is None
    assert not w.registered
    assert w.unreadable["malformed"] == 1
    assert isinstance(w.on_tick(T0 + 3.0)[1], Reconnect)  # silent since the READY


def test_next_wakeup_is_never_in_the_past() -> None:
    w = connected(heartbeat_s=1.0, liveness=3)
    assert w.next_wakeup(T0) == T0 + 1.0
    assert w.next_wakeup(T0 + 10.0) == T0 + 10.0


def test_heartbeats_carry_rho() -> None:
    w = connected(heartbeat_s=1.0, rho_window_s=1.0, liveness=100)
    w.on_batch_queued(T0 + 0.25)  # busy for the last 0.75 s of the window
    (msg,), _ = w.on_tick(T0 + 1.0)
    assert decoded(msg)[1]["rho"] == pytest.approx(0.75)
    finish(w, T0 + 1.5, 1, 1, T0 + 0.25, T0 + 1.5, [3], [b"h", b"m", b"p"])
    (msg,), _ = w.on_tick(T0 + 2.0)
    assert decoded(msg)[1]["rho"] == pytest.approx(0.5)  # [1.0, 1.5] of [1.0, 2.0]
    (msg,), _ = w.on_tick(T0 + 3.0)
    assert decoded(msg)[1]["rho"] == 0.0


def test_heartbeats_say_how_long_the_inference_thread_has_run_its_batch() -> None:
    """busy_ms counts from when the thread took up its current batch (the broker's sign of
    a wedged engine behind a live loop); 0 while the thread is idle."""
    w = connected(heartbeat_s=1.0, liveness=100)
    w.on_batch_queued(T0 + 0.25)
    w.on_batch_queued(T0 + 0.5)  # queued behind the first
    (msg,), _ = w.on_tick(T0 + 1.0)
    assert decoded(msg)[1]["busy_ms"] == 750
    (msg,), _ = w.on_tick(T0 + 2.0)
    assert decoded(msg)[1]["busy_ms"] == 1750  # still on the first: it grows
    finish(w, T0 + 2.5, w.epoch, 1, T0 + 0.25, T0 + 2.5, [1], [b"x"])
    (msg,), _ = w.on_tick(T0 + 3.0)
    assert decoded(msg)[1]["busy_ms"] == 500  # the second, since the first ended
    finish(w, T0 + 3.2, w.epoch, 2, T0 + 2.5, T0 + 3.2, [1], [b"x"])
    (msg,), _ = w.on_tick(T0 + 4.0)
    assert decoded(msg)[1]["busy_ms"] == 0
    w.on_batch_queued(T0 + 4.1)
    w.on_batches_dropped(1)  # taken back before it started (a reconnect)
    assert w.busy_ms(T0 + 4.5) == 0


def test_stop_sends_disconnect_and_goes_quiet() -> None:
    w = connected()
    command, meta, _ = decoded(w.on_stop())
    assert command is Command.DISCONNECT
    assert meta["reason"]
    assert w.state is WorkerState.STOPPED
    assert w.on_tick(T0 + 100.0) == ([], None)
    assert w.next_wakeup(T0) is None


# --------------------------------------------------------------------------- results


def test_result_message() -> None:
    w = connected()
    w.on_batch_queued(T0 + 0.1)
    frames = [b"hdr", b"meta", b"payload", b"simple"]
    msg = finish(w, T0 + 0.5, 1, 7, T0 + 0.1, T0 + 0.4, [3, 1], frames)
    assert msg is not None
    command, meta, payloads = decoded(msg)
    assert command is Command.RESULT
    result = ResultMeta.from_wire(meta)
    assert result.batch_id == 7
    assert result.frames == (3, 1)
    assert result.compute_ms == pytest.approx(300.0)
    assert result.rho == pytest.approx(0.3)  # [0.1, 0.4] in the window [-0.5, 0.5]
    assert all(a is b for a, b in zip(payloads, frames, strict=True))
    assert w.batches_done == 1
    # On the wire, byte for byte what ResultMeta.to_wire gives (times with more digits
    # than the wire keeps, so that each rounding shows).
    w.on_batch_queued(T0 + 0.6)
    end = T0 + 0.9001234
    msg = finish(w, end, 1, 8, T0 + 0.6, end, [3], frames[:3])
    assert msg is not None
    expected = ResultMeta(8, w.meter.rho(end), 1000.0 * (end - (T0 + 0.6)), (3,))
    assert round(expected.rho, 3) != round(expected.rho, 4)
    assert round(expected.compute_ms, 2) != round(expected.compute_ms, 3)
    assert bytes(msg.to_frames()[1]) == codec.pack(expected.to_wire())


def test_failed_message() -> None:
    w = connected()
    w.on_batch_queued(T0)
    msg = fail(w, T0 + 0.2, 1, 9, T0, T0 + 0.2, ErrorCode.INTERNAL, "engine died")
    assert msg is not None
    command, meta, payloads = decoded(msg)
    assert command is Command.FAILED
    assert payloads == []
    failed = FailedMeta.from_wire(meta)
    assert (failed.batch_id, failed.code, failed.message) == (9, ErrorCode.INTERNAL, "engine died")
    assert failed.rho == pytest.approx(0.2)
    assert w.batches_failed == 1


def test_results_from_an_older_epoch_are_dropped() -> None:
    w = connected()
    action = on_broker(w, T0, encode(Command.BATCH, BATCH.to_wire(), [bytes(16), bytes(32)]))
    assert isinstance(action, RunBatch)
    w.on_batch_queued(T0)
    w.on_batch_queued(T0)
    w.on_connect(T0 + 1.0)  # reconnected while both batches ran
    assert finish(w, T0 + 1.5, action.epoch, 7, T0, T0 + 1.5, [1], [b"x"]) is None
    assert fail(w, T0 + 1.6, action.epoch, 8, T0 + 1.5, T0 + 1.6, ErrorCode.INTERNAL, "") is None
    # Still accounted: both finished, the meter has their time and nothing is running.
    assert (w.batches_done, w.batches_failed) == (1, 1)
    assert w.meter.running_since is None
    assert w.meter.rho(T0 + 1.6) == pytest.approx(1.0)
    assert finish(w, T0 + 2.0, w.epoch, 9, T0 + 1.9, T0 + 2.0, [1], [b"x"]) is not None


def test_running_since_follows_the_inference_thread() -> None:
    w = connected()
    w.on_batch_queued(T0)
    w.on_batch_queued(T0 + 0.1)  # queued behind the first
    assert w.meter.running_since == T0
    finish(w, T0 + 0.3, 1, 1, T0, T0 + 0.3, [1], [b"x"])
    assert w.meter.running_since == T0 + 0.3  # the thread went straight on to the second
    finish(w, T0 + 0.5, 1, 2, T0 + 0.3, T0 + 0.5, [1], [b"x"])
    assert w.meter.running_since is None
    assert w.meter.rho(T0 + 0.5) == pytest.approx(0.5)


# --------------------------------------------------------------------------- BusyMeter


def test_meter_idle_is_zero() -> None:
    assert BusyMeter().rho(T0) == 0.0


@pytest.mark.parametrize(
    ("window", "spans", "running_since", "now", "rho"),
    [
        (1.0, [(0.2, 0.4)], None, 1.0, 0.2),
        (1.0, [(0.2, 0.4), (0.6, 0.7)], None, 1.0, 0.3),
        (1.0, [(-0.5, 0.5)], None, 1.0, 0.5),  # clipped at the window start
        (1.0, [(-2.0, -1.0)], None, 1.0, 0.0),  # entirely before the window
        (1.0, [(0.5, 2.0)], None, 1.0, 0.5),  # clipped at now
        (1.0, [], 0.7, 1.0, 0.3),  # a batch still running
        (1.0, [(0.2, 0.4)], 0.7, 1.0, 0.5),
        (1.0, [], -3.0, 1.0, 1.0),  # running since before the window
        (1.0, [(0.0, 1.0), (0.0, 1.0)], None, 1.0, 1.0),  # never above 1
        (0.5, [(0.6, 0.8)], None, 1.0, 0.4),
        (2.0, [(0.0, 1.0)], None, 1.0, 0.5),
    ],
)
def test_meter_rho(
    window: float,
    spans: list[tuple[float, float]],
    running_since: float | None,
    now: float,
    rho: float,
) -> None:
    meter = BusyMeter(window)
    for start, end in spans:
        meter.add(T0 + start, T0 + end)
    meter.running_since = None if running_since is None else T0 + running_since
    assert meter.rho(T0 + now) == pytest.approx(rho)


def test_meter_forgets_old_spans() -> None:
    meter = BusyMeter(1.0)
    meter.add(T0, T0 + 0.5)
    assert meter.rho(T0 + 1.0) == pytest.approx(0.5)
    assert meter.rho(T0 + 1.25) == pytest.approx(0.25)
    assert meter.rho(T0 + 1.5) == 0.0
    assert meter.rho(T0 + 1.0) == 0.0  # pruned, not recomputed


def test_batches_taken_back_on_reconnect_leave_the_meter_idle() -> None:
    core = WorkerCore("w", [], heartbeat_s=1.0)
    core.on_batch_queued(10.0)
    core.on_batch_queued(10.0)
    core.on_batches_dropped(1)
    assert core.meter.running_since == 10.0  # one is still running
    core.on_batches_dropped(5)
    assert core.meter.running_since is None
    assert core.meter.rho(10.5) == 0.0


def test_an_unexpected_error_fails_the_batch_not_the_inference_thread() -> None:
    """An engine whose outputs break our encoder (here: a declared output is missing)
    yields a failed batch with INTERNAL, which the worker reports as FAILED."""
    from carpool.common.clock import MonotonicClock
    from carpool.common.protocol import BatchItem, BatchMeta, TensorMeta
    from carpool.worker.core import RunBatch
    from carpool.worker.engines.synthetic import SyntheticEngine
    from carpool.worker.run import run_job

    class Forgetful(SyntheticEngine):
        def run(self, inputs: Any) -> dict[str, Any]:
            return {}  # "y" is declared but missing

    engine = Forgetful(item_shape=(2,))
    meta = BatchMeta(7, "m", (TensorMeta("x", "float32", (-1, 2)),), (BatchItem(1, 1, False, 0.0),))
    job = RunBatch(1, meta, [np.zeros((1, 2), np.float32).tobytes()])
    outcome = run_job({"m": engine}, job, MonotonicClock())
    frames = list(outcome.frames)
    assert frames == []
    assert outcome.error is not None
    assert outcome.error[0] is ErrorCode.INTERNAL
    assert "encoding outputs failed" in outcome.error[1]
