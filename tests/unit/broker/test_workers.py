"""workers.py: WorkerEvents built on its own from the state it reads (no other part):
a READY registers a worker and returns the specs it replaced (the core routes what
follows), a RESULT answers its batch's requests with the worker's frames as they
arrived, a lost worker's requests go back to their queues; each leaves the models to
pump as its follow-ups (freed_models, changed_models)."""

from __future__ import annotations

from carpool.broker.backlog import Backlog
from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.fleet import FleetModel
from carpool.broker.inflight import InflightBatch
from carpool.broker.registry import WorkerRegistry
from carpool.broker.replies import Outgoing, ToClient, ToWorker
from carpool.broker.requests import RequestBook, RequestState, WorkerId
from carpool.broker.workers import WorkerEvents
from carpool.common.protocol import (
    BrokerDisconnect,
    ModelSpec,
    Ready,
    ResultMeta,
    TensorMeta,
    WorkerDisconnect,
    WorkerResult,
)
from tests.unit.broker.pending import pending_request

T0 = 100.0
W = WorkerId(b"w1")
X, Y = TensorMeta("x", "float32", (-1, 4)), TensorMeta("y", "float32", (-1, 2))
SPEC = ModelSpec("m", (X,), (Y,), 8)


def events(**config: int) -> WorkerEvents:
    cfg = BrokerConfig(batching=BatchingConfig(policy="fixed", max_batch=8), **config)  # type: ignore[arg-type]
    registry, book = WorkerRegistry(liveness=cfg.liveness), RequestBook()
    fleet = FleetModel(cfg, registry)
    backlog = Backlog(book, fleet.batch_unit)
    return WorkerEvents(cfg, registry, backlog, fleet)


def dispatched(w: WorkerEvents, *seqs: int) -> InflightBatch:
    """A batch of requests ``seqs`` at worker W (as the dispatcher leaves one)."""
    reqs = [pending_request(seq, deadline_s=T0 + 10) for seq in seqs]
    for req in reqs:
        w.backlog.add(req)
    assert w.backlog.take(w.backlog.queues[reqs[0].key], len(reqs), T0, 0.0, False) == reqs
    assert all(req.state is RequestState.DISPATCHED for req in reqs)
    worker = w.registry.get(W)
    assert worker is not None
    batch = w.registry.dispatched(T0, worker, reqs, reqs[0].key, len(reqs), 0.01)
    assert worker.outstanding == {batch.batch_id}
    return batch


def test_a_ready_registers_its_worker_and_names_no_replaced_spec() -> None:
    w = events()
    out: list[Outgoing] = []
    assert w.on_ready(T0, W, Ready("w", 2, (SPEC,)), out) == []
    assert out == []
    worker = w.registry.get(W)
    assert worker is not None
    assert (worker.name, worker.slots) == ("w", 2)


def test_a_ready_over_the_limit_is_refused_with_disconnect() -> None:
    w = events(max_workers=1)
    w.on_ready(T0, W, Ready("w", 1, (SPEC,)), [])
    out: list[Outgoing] = []
    assert w.on_ready(T0, WorkerId(b"w2"), Ready("w2", 1, (SPEC,)), out) is None
    (refusal,) = out
    assert isinstance(refusal, ToWorker)
    assert isinstance(refusal.message, BrokerDisconnect)
    assert w.registry.get(WorkerId(b"w2")) is None


def test_a_result_answers_its_requests_with_the_frames_as_they_arrived() -> None:
    w = events()
    w.on_ready(T0, W, Ready("w", 1, (SPEC,)), [])
    batch = dispatched(w, 1, 2)
    replies = [b"r1", b"r2"]
    meta = ResultMeta(batch.batch_id, 0.5, 3.0, (1, 1))
    out = w.on_worker(T0 + 0.01, W, WorkerResult(meta, replies))
    answers = [o for o in out if isinstance(o, ToClient)]
    assert len(answers) == len(out) == 2
    assert all(o.frames[0] is r for o, r in zip(answers, replies, strict=True))  # not copied
    assert [r.state for r in batch.requests] == [RequestState.DONE, RequestState.DONE]
    assert (w.freed_models, w.changed_models) == ({"m"}, set())


def test_a_lost_workers_requests_go_back_to_their_queue() -> None:
    w = events()
    w.on_ready(T0, W, Ready("w", 1, (SPEC,)), [])
    batch = dispatched(w, 1, 2)
    out = w.on_worker(T0 + 0.01, W, WorkerDisconnect("bye"))
    assert out == []
    assert w.registry.get(W) is None
    assert [r.state for r in batch.requests] == [RequestState.QUEUED, RequestState.QUEUED]
    assert (w.backlog.queued, w.notes.requeued) == (2, 2)
    assert w.changed_models == {"m"}


def test_a_stranger_is_told_to_register_and_its_result_counted_late() -> None:
    w = events()
    meta = ResultMeta(7, 0.5, 3.0, (1,))
    (out,) = w.on_worker(T0, W, WorkerResult(meta, [b"r"]))
    assert isinstance(out, ToWorker)
    assert isinstance(out.message, BrokerDisconnect)
    assert w.notes.late_results == 1


def test_the_fleets_cached_rate_follows_every_refit_of_the_cost() -> None:
    """A RESULT teaches the lane its cost; the fleet's rate for the key, cached for
    admission, is dropped whenever the fit will change and kept otherwise: after every
    result it equals one computed afresh, and it outlives the results that only wait
    for a later refit."""
    w = events()
    w.on_ready(T0, W, Ready("w", 1, (SPEC,)), [])
    kept = 0
    for i in range(120):
        batch = dispatched(w, *range(10 * i, 10 * i + 1 + i % 2))  # sizes 1 and 2
        key = batch.key
        w.fleet.drain_time_s("m", key, 16)  # (cached now)
        compute_ms = 2.0 + 0.5 * batch.samples + 0.01 * (i % 7)
        meta = ResultMeta(batch.batch_id, 0.5, compute_ms, (1,) * batch.samples)
        w.on_worker(T0 + 0.01, W, WorkerResult(meta, [b"r"] * batch.samples))
        kept += key in w.fleet.rates
        cached = w.fleet.drain_time_s("m", key, 16)
        w.fleet.rates.clear()
        assert w.fleet.drain_time_s("m", key, 16) == cached
    assert kept >= 40  # (past the first 64 observations, 7 of each 8 keep it)
