"""Bounded broker state: the models one READY may announce, what one client may hold at
the broker, and the models no live worker serves, forgotten after ``forget_unserved_s``.

BrokerCore driven with wire frames and an injected clock, with harness.py.
"""

from __future__ import annotations

import logging
import threading

import pytest

from carpool.broker.config import BatchingOverride, BrokerConfig
from carpool.broker.requests import ClientId
from carpool.common.errors import ConfigError, ErrorCode
from carpool.common.protocol import Command
from carpool.common.ratelog import PEER_LINES_PER_MIN
from tests.unit.broker.harness import (
    C1,
    C2,
    SPEC,
    T0,
    W1,
    W2,
    Broker,
    batches,
    model_spec,
    only,
    to_clients,
)

CID1, CID2 = ClientId(C1), ClientId(C2)


@pytest.mark.parametrize(
    "setting",
    [
        {"max_models_per_worker": 0},
        {"max_models_per_worker": 257},
        {"max_workers": 0},
        {"max_client_requests": 0},
        {"max_client_mib": 0},
        {"forget_unserved_s": 0.0},
    ],
)
def test_limits_out_of_range_are_config_errors(setting: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(setting))):
        BrokerConfig(**setting)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- READY limits


def test_a_ready_with_more_models_than_the_limit_is_refused_with_a_reason() -> None:
    b = Broker.make(max_models_per_worker=3)
    specs = [model_spec(f"m{i}") for i in range(4)]
    out = b.ready(T0, W1, *specs)
    (msg,) = only(out, Command.DISCONNECT)
    assert msg.to == W1
    assert "4 models" in msg.meta["reason"]
    assert "max_models_per_worker" in msg.meta["reason"]
    assert len(b.core.registry) == 0
    assert b.core.registry.specs == {}
    (err,) = to_clients(b.request(T0 + 0.001, 1, model="m0"))
    assert err.code is ErrorCode.NOT_FOUND


def test_a_ready_at_the_limit_registers_every_model() -> None:
    b = Broker.make(max_models_per_worker=3)
    assert b.ready(T0, W1, *[model_spec(f"m{i}") for i in range(3)]) == []
    assert sorted(b.core.registry.specs) == ["m0", "m1", "m2"]


def test_a_ready_past_max_workers_is_refused_until_one_leaves() -> None:
    b = Broker.make(max_workers=2)
    assert b.ready(T0, W1) == []
    assert b.ready(T0, W2) == []
    w3 = b"\x01third"
    (msg,) = only(b.ready(T0, w3), Command.DISCONNECT)
    assert msg.to == w3
    assert "max_workers" in msg.meta["reason"]
    assert len(b.core.registry) == 2
    b.disconnect(T0 + 0.01, W1)
    assert b.ready(T0 + 0.02, w3) == []
    assert len(b.core.registry) == 2


# --------------------------------------------------------------------------- client limits


def test_a_client_over_its_request_limit_is_overloaded_and_others_are_not() -> None:
    b = Broker.make(max_batch=1, max_client_requests=2)
    b.ready(T0, W1, slots=1)
    (batch,) = batches(b.request(T0, 1))  # at the worker: still held for C1
    assert b.request(T0, 2) == []  # queued
    (err,) = to_clients(b.request(T0, 3))
    assert (err.rid, err.code) == (3, ErrorCode.OVERLOADED)
    assert err.meta["retry_after_ms"] >= 1
    assert "max_client_requests 2" in err.meta["message"]
    assert b.request(T0, 4, cid=C2) == []  # another client is let in
    assert b.core.backlog.held(CID1) == (2, 2 * 16)
    out, _ = b.result(T0 + 0.01, batch)
    assert [m.rid for m in to_clients(out)] == [1]
    assert b.core.backlog.held(CID1)[0] == 1
    assert not [m for m in to_clients(b.request(T0 + 0.01, 5)) if m.command is Command.ERROR]


def test_a_client_over_its_byte_limit_is_overloaded_and_a_larger_request_is_invalid() -> None:
    big = model_spec("big", 8, (("x", "float32", (-1, -1)),))
    b = Broker.make(max_client_mib=1)
    b.ready(T0, W1, big, slots=1)
    item = (160_000,)  # 640 kB of float32 a sample
    assert b.request(T0, 1, model="big", item=item) == []
    (err,) = to_clients(b.request(T0, 2, model="big", item=item))
    assert (err.rid, err.code) == (2, ErrorCode.OVERLOADED)
    assert "max_client_mib 1" in err.meta["message"]
    (err,) = to_clients(b.request(T0, 3, model="big", item=(300_000,)))
    assert (err.rid, err.code) == (3, ErrorCode.INVALID_ARGUMENT)
    assert b.request(T0, 4, cid=C2, model="big", item=item) == []


def test_what_a_client_holds_is_released_by_every_final_state() -> None:
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, slots=1)
    assert batches(b.request(T0, 1, timeout_ms=50))  # expires at the worker
    b.request(T0, 2, timeout_ms=50)  # expires queued
    b.request(T0, 3, cid=C2, timeout_ms=5000)  # answered UNAVAILABLE: its worker left
    assert (b.core.backlog.held(CID1), b.core.backlog.held(CID2)) == ((2, 32), (1, 16))
    b.tick(T0 + 0.06)
    assert b.core.backlog.held(CID1) == (0, 0)
    b.disconnect(T0 + 0.07, W1)
    (err,) = to_clients(b.tick(T0 + 6))
    assert (err.rid, err.code) == (3, ErrorCode.UNAVAILABLE)
    assert b.core.book.held == {}


# --------------------------------------------------------------------------- unserved models


def test_a_model_no_worker_serves_is_forgotten_after_the_window() -> None:
    b = Broker.make(max_batch=1, forget_unserved_s=10.0)
    b.ready(T0, W1, SPEC, model_spec("other"), slots=1)
    (batch,) = batches(b.request(T0, 1))
    b.result(T0 + 0.01, batch)
    b.disconnect(T0 + 1, W1)
    b.tick(T0 + 1)  # the sweep sees them unserved
    (err,) = to_clients(b.request(T0 + 5, 3))
    assert err.code is ErrorCode.UNAVAILABLE  # known: its workers may come back
    b.tick(T0 + 10.9)
    assert "m" in b.core.registry.specs
    b.tick(T0 + 11.5)
    core = b.core
    assert core.registry.specs == {}
    assert core.registry.max_batch("m") == 0
    assert core.stats.batch_sizes == {}
    assert core.backlog.queues == {}
    assert core.backlog.queued_samples == {}
    assert core.fleet.rates == {}
    assert core.layouts.layouts == {}
    (err,) = to_clients(b.request(T0 + 12, 4))
    assert err.code is ErrorCode.NOT_FOUND
    assert core.registry.specs == {}


def test_a_model_served_again_within_the_window_is_kept_and_its_window_restarts() -> None:
    b = Broker.make(forget_unserved_s=10.0)
    b.ready(T0, W1, slots=1)
    b.disconnect(T0 + 1, W1)
    b.tick(T0 + 1)
    b.ready(T0 + 8, W2, slots=1, heartbeat_ms=60_000)
    b.tick(T0 + 12)
    assert "m" in b.core.registry.specs
    b.disconnect(T0 + 13, W2)
    b.tick(T0 + 13)
    b.tick(T0 + 22.5)
    assert "m" in b.core.registry.specs
    b.tick(T0 + 23.5)
    assert "m" not in b.core.registry.specs


def test_a_configured_model_is_kept_after_its_workers_left() -> None:
    b = Broker.make(forget_unserved_s=10.0, models={"m": BatchingOverride(max_batch=2)})
    b.ready(T0, W1, SPEC, model_spec("other"), slots=1)
    b.disconnect(T0 + 1, W1)
    b.tick(T0 + 1)
    b.tick(T0 + 20)
    assert list(b.core.registry.specs) == ["m"]
    (err,) = to_clients(b.request(T0 + 21, 1))
    assert err.code is ErrorCode.UNAVAILABLE


def test_a_model_with_queued_requests_is_forgotten_only_after_they_are_answered() -> None:
    b = Broker.make(max_batch=1, forget_unserved_s=1.0)
    b.ready(T0 + 0.5, W2, slots=1)
    assert batches(b.request(T0 + 0.5, 1, timeout_ms=5000))
    b.disconnect(T0 + 0.6, W2)  # its request goes back to its queue, to wait for a worker
    assert b.core.queued == 1
    b.tick(T0 + 0.6)
    b.tick(T0 + 3)
    assert "m" in b.core.registry.specs
    (err,) = to_clients(b.tick(T0 + 5.6))
    assert (err.rid, err.code) == (1, ErrorCode.UNAVAILABLE)
    b.tick(T0 + 6.2)
    assert b.core.registry.specs == {}


def test_names_announced_by_short_lived_workers_stay_bounded() -> None:
    """Fresh workers, each announcing new names then falling silent: what the broker
    tracks is what the last window announced, not everything ever announced."""
    b = Broker.make(forget_unserved_s=1.0, max_models_per_worker=50)
    most = 0
    for round_ in range(100):
        now = T0 + 0.1 * round_
        wid = b"w%d" % round_
        specs = [model_spec(f"r{round_}-{i}") for i in range(50)]
        assert b.ready(now, wid, *specs, heartbeat_ms=10) == []
        b.tick(now + 0.05)  # silent for liveness x heartbeat: gone
        most = max(most, len(b.core.registry.specs))
    # At most about (window + sweep period) / round period rounds of names at once.
    assert most <= 50 * 17
    b.tick(T0 + 20)
    b.tick(T0 + 21)
    assert b.core.registry.specs == {}
    assert len(b.core.registry) == 0
    assert b.core.fleet.rates == {}


def test_a_flood_of_bad_worker_messages_writes_a_bounded_number_of_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each kind of line a peer on the worker socket can cause (protocol errors here) is
    written at most PEER_LINES_PER_MIN times a minute, then once with the count left out;
    every bad message is still answered DISCONNECT."""
    b = Broker.make()
    with caplog.at_level(logging.INFO, "carpool.broker.workers"):
        for k in range(200):
            out = b.worker(T0 + k * 0.01, b"\x01bad%d" % k, [b"CP\x01\x7f", b"\x80"])
            assert [m.command for m in out] == [Command.DISCONNECT]
        lines = [r.getMessage() for r in caplog.records if "protocol error" in r.getMessage()]
        assert len(lines) == PEER_LINES_PER_MIN
        b.worker(T0 + 61.0, b"\x01late", [b"CP\x01\x7f", b"\x80"])
    last = caplog.records[-1].getMessage()
    assert f"({200 - PEER_LINES_PER_MIN} more like it not logged)" in last


# --------------------------------------------------------------------------- parts' notes


@pytest.mark.parametrize("read_first", [False, True])
def test_the_parts_notes_are_counted_when_the_stats_are_read_and_at_each_sweep(
    read_first: bool,
) -> None:
    """The dispatcher and the worker events note what the stats count; the core takes
    their notes whenever the stats are read, and at each sweep (half a second), so they
    never hold more than a sweep's."""
    b = Broker.make(max_batch=2)
    b.ready(T0, W1, SPEC)
    b.request(T0, 1)
    (batch,) = batches(b.request(T0, 2))
    b.request(T0 + 0.001, 3, timeout_ms=1)  # expires queued: a noted failure
    dispatcher, workers = b.core.dispatcher.notes, b.core.workers.notes
    b.result(T0 + 0.002, batch)
    b.tick(T0 + 0.01)
    if read_first:
        b.core.stats  # noqa: B018 (reading them takes the notes)
    else:
        b.tick(T0 + 1.0)  # a sweep
    for notes in (dispatcher, workers):
        assert (notes.failed, notes.batches, notes.answered, notes.padded) == ([], [], [], [])
    stats = b.core.stats
    assert stats.batch_sizes == {"m": {2: 1}}
    assert (stats.replies, stats.answers["m"]) == (2, 2)
    assert stats.model_errors == {"m": {"DEADLINE_EXCEEDED": 1}}
    assert stats.errors["DEADLINE_EXCEEDED"] == 1


def test_another_thread_reads_the_stats_as_the_loop_last_took_them() -> None:
    """Only the loop's thread takes the parts' notes (they are written there, unlocked):
    another thread's read leaves them, and sees the counts of the last take."""
    b = Broker.make(max_batch=1)
    b.ready(T0, W1, SPEC)
    (batch,) = batches(b.request(T0, 1))
    b.result(T0 + 0.002, batch)
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.append(len(b.core.stats.batch_sizes)))
    reader.start()
    reader.join(10)
    assert seen == [0]
    assert b.core.workers.notes.answered  # still noted
    assert b.core.stats.batch_sizes == {"m": {1: 1}}  # taken on the loop's thread
    assert not b.core.workers.notes.answered
