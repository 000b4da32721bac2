"""worker/core.py: the policy the worker's shell asks its core for, with ``now`` passed in
and no sockets: when to connect again, the epochs, which batches run on the loop thread,
and the message for a finished batch."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.common.errors import ErrorCode
from carpool.common.protocol import (
    BatchItem,
    BatchMeta,
    Command,
    ModelSpec,
    TensorMeta,
    parse_header,
    unpack,
)
from carpool.worker.core import (
    EMBEDDED_BACKOFF,
    INLINE_MAX_S,
    Backoff,
    JobOutcome,
    RunBatch,
    WorkerCore,
)

T0 = 100.0
SPEC = ModelSpec(
    "m", (TensorMeta("x", "float32", (-1, 4)),), (TensorMeta("y", "float32", (-1, 2)),), 64
)
BOUND = ModelSpec(
    "t", (TensorMeta("x", "float32", (-1, 4)),), (TensorMeta("y", "float32", (-1, 2)),), 64
)


def core(**kwargs: Any) -> WorkerCore:
    kwargs.setdefault("thread_free", ["m"])
    w = WorkerCore("edge-1", [SPEC, BOUND], **kwargs)
    w.on_connect(T0)
    return w


def job(w: WorkerCore, model: str = "m", samples: int = 1) -> RunBatch:
    items = (BatchItem(1, samples, False, 0.0),)
    return RunBatch(w.epoch, BatchMeta(1, model, SPEC.inputs, items), [b""])


def outcome(w: WorkerCore, model: str = "m", **kwargs: Any) -> JobOutcome:
    kwargs.setdefault("epoch", w.epoch)
    kwargs.setdefault("counts", [3])
    kwargs.setdefault("frames", [b"h", b"m", b"y"])
    return JobOutcome(batch_id=1, model=model, start_s=T0, **kwargs)


# --------------------------------------------------------------------------- back-off


def test_a_worker_lost_long_after_joining_connects_again_at_once() -> None:
    w = core()
    assert w.on_lost(T0 + 5.0) is True
    assert not w.rejoining
    assert w.backoff_s == 0.0


def test_refusals_right_after_joining_back_off_doubling_up_to_the_most() -> None:
    w = core()
    waits = []
    joined = T0
    for _ in range(6):
        assert w.on_lost(joined + 0.01) is False  # refused at once
        assert w.rejoining
        assert w.rejoin_at_s is not None
        waits.append(w.rejoin_at_s - joined)
        assert not w.rejoin_due(w.rejoin_at_s - 0.001)
        assert w.rejoin_due(w.rejoin_at_s)
        joined = w.rejoin_at_s
        w.on_connect(joined)
        assert not w.rejoining
    assert waits == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert w.on_lost(joined + 1.0) is True  # a connection that lasted: the wait starts over
    assert w.backoff_s == 0.0


def test_an_embedded_worker_registers_again_a_second_after_it_last_did() -> None:
    w = core(backoff=EMBEDDED_BACKOFF)
    for lost_after_s in (0.01, 0.5, 0.01, 5.0):
        assert w.on_lost(w.last_join_s + lost_after_s) is False  # never inside this turn
        assert w.rejoin_at_s == w.last_join_s + 1.0
        w.on_connect(w.last_join_s + max(1.0, lost_after_s))


def test_a_custom_backoff_is_followed() -> None:
    w = core(backoff=Backoff(min_s=0.5, max_s=1.5))
    assert w.on_lost(T0 + 0.1) is False
    assert w.rejoin_at_s == T0 + 0.5
    w.on_connect(T0 + 0.5)
    w.on_lost(T0 + 0.6)
    w.on_connect(T0 + 1.5)
    w.on_lost(T0 + 1.6)
    assert w.rejoin_at_s == T0 + 3.0  # 1 s doubled, at most 1.5 s


def test_while_waiting_to_connect_only_connecting_is_due() -> None:
    w = core(heartbeat_s=1.0, liveness=2)
    w.on_lost(T0 + 0.1)
    assert w.next_wakeup(T0 + 0.2) == T0 + 1.0
    assert w.on_tick(T0 + 5.0) == ([], None)  # no heartbeat, no silence counted
    w.on_connect(T0 + 5.0)
    assert w.next_wakeup(T0 + 5.0) == T0 + 6.0  # the next heartbeat


# --------------------------------------------------------------------------- epochs


def test_each_loss_is_an_epoch_and_its_results_answer_nobody() -> None:
    w = core()
    before = job(w)
    w.on_batch_queued(T0)
    assert w.on_lost(T0 + 5.0) is True
    assert w.epoch == 2
    w.on_connect(T0 + 5.0)
    assert w.epoch == 3
    assert w.on_job_done(T0 + 6.0, outcome(w, epoch=before.epoch, end_s=T0 + 6.0)) is None
    assert w.batches_done == 1
    assert w.idle_thread


# --------------------------------------------------------------------------- inline runs


def test_a_model_is_first_timed_on_the_inference_thread() -> None:
    assert not core().runs_inline(job(core()))


def test_short_batches_of_thread_free_engines_run_inline() -> None:
    w = core()
    w.on_job_done(T0, outcome(w, end_s=T0 + INLINE_MAX_S / 10, samples=1))
    assert w.runs_inline(job(w, samples=1))
    assert w.runs_inline(job(w, samples=9))
    assert not w.runs_inline(job(w, samples=10))  # a large batch of a fast model: long
    w.on_batch_queued(T0)
    assert not w.runs_inline(job(w))  # the inference thread is busy: wait behind it


def test_a_thread_bound_engine_never_runs_inline() -> None:
    w = core()
    w.on_job_done(T0, outcome(w, "t", end_s=T0 + 1e-6, samples=1))
    assert not w.runs_inline(job(w, "t"))


def test_the_time_per_sample_is_smoothed() -> None:
    w = core()
    w.on_job_done(T0, outcome(w, end_s=T0 + 0.0001, samples=1))
    w.on_job_done(T0, outcome(w, end_s=T0 + 0.0101, samples=1))  # once slow: 2.1 ms smoothed
    assert not w.runs_inline(job(w))
    for _ in range(20):
        w.on_job_done(T0, outcome(w, end_s=T0 + 0.0001, samples=1))
    assert w.runs_inline(job(w))


def test_batches_the_engine_did_not_run_whole_teach_nothing() -> None:
    w = core()
    w.on_job_done(T0, outcome(w, end_s=T0 + 1.0, samples=1))  # 1 s a sample
    for _ in range(50):
        w.on_job_done(T0, outcome(w, end_s=T0 + 1e-6, samples=0, timed=False))
        w.on_job_done(T0, outcome(w, end_s=T0 + 1e-6, error=(ErrorCode.INTERNAL, "x")))
    assert not w.runs_inline(job(w))


# --------------------------------------------------------------------------- outcomes


def test_an_outcome_becomes_a_result() -> None:
    w = core()
    done = w.on_job_done(T0 + 1.0, outcome(w, end_s=T0 + 0.5, samples=1))
    assert done is not None
    msg = done.to_frames()
    assert parse_header(msg[0]) is Command.RESULT
    meta = unpack(msg[1])
    assert (meta["batch"], meta["frames"], meta["compute_ms"]) == (1, [3], 500.0)
    assert msg[2:] == [b"h", b"m", b"y"]


def test_an_untimed_outcome_reports_no_engine_time() -> None:
    w = core()
    done = w.on_job_done(T0 + 1.0, outcome(w, end_s=T0 + 0.5, timed=False))
    assert done is not None
    assert unpack(done.to_frames()[1])["compute_ms"] == 0.0


@pytest.mark.parametrize("code", [ErrorCode.INTERNAL, ErrorCode.NOT_FOUND])
def test_a_failed_outcome_becomes_failed(code: ErrorCode) -> None:
    w = core()
    done = w.on_job_done(
        T0 + 1.0, outcome(w, end_s=T0 + 0.5, counts=(), frames=(), error=(code, "no"))
    )
    assert done is not None
    msg = done.to_frames()
    assert parse_header(msg[0]) is Command.FAILED
    meta = unpack(msg[1])
    assert (meta["batch"], meta["code"], meta["message"]) == (1, int(code), "no")
    assert w.batches_failed == 1
