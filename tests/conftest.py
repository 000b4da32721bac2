"""Shared fixtures: real zmq contexts with bounded teardown, a loopback fleet, and the
suite-wide record of the request state transitions the tests make."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq

from carpool.broker.config import BatchingConfig, BrokerConfig
from carpool.broker.requests import IllegalTransition, PendingRequest, RequestBook, RequestState
from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.testing import ServerThread
from carpool.worker.server import EngineFactory, WorkerServer

# --------------------------------------------------------------------------- transitions

_RECORD = pytest.StashKey["TransitionRecord"]()
_MOVE = pytest.StashKey[Callable[[RequestBook, PendingRequest, RequestState], None]]()
_deselected = [0]  # tests deselected in this run (-k, -m, --deselect, --lf, ...)


@dataclass
class TransitionRecord:
    """Every (from, to) request state move the tests' brokers asked their book for,
    counted: the moves it made (``seen``, as an observer of every RequestBook) and the
    moves it refused (``refused``, raising IllegalTransition, which the caller may have
    caught). It listens while it is among ``RequestBook.observers``."""

    seen: Counter[tuple[RequestState, RequestState]] = field(default_factory=Counter)
    refused: Counter[tuple[RequestState, RequestState]] = field(default_factory=Counter)

    def __call__(self, frm: RequestState, to: RequestState) -> None:
        self.seen[(frm, to)] += 1

    def listening(self) -> bool:
        return self in RequestBook.observers


def _recording_refusals(
    move: Callable[[RequestBook, PendingRequest, RequestState], None], record: TransitionRecord
) -> Callable[[RequestBook, PendingRequest, RequestState], None]:
    """``RequestBook.move`` that also counts in ``record`` each move the book refuses."""

    def recorded(book: RequestBook, req: PendingRequest, to: RequestState) -> None:
        frm = req.state
        try:
            move(book, req, to)
        except IllegalTransition:
            if record.listening():
                record.refused[(frm, to)] += 1
            raise

    return recorded


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "suite_last: runs after every other collected test (suite-wide checks)"
    )
    # Every request state move any RequestBook makes or refuses while the tests run.
    record = config.stash[_RECORD] = TransitionRecord()
    RequestBook.observers.append(record)
    config.stash[_MOVE] = RequestBook.move
    RequestBook.move = _recording_refusals(RequestBook.move, record)  # type: ignore[method-assign,assignment]


def pytest_unconfigure(config: pytest.Config) -> None:
    record = config.stash.get(_RECORD, None)
    if record is not None and record in RequestBook.observers:
        RequestBook.observers.remove(record)
    move = config.stash.get(_MOVE, None)
    if move is not None:
        RequestBook.move = move  # type: ignore[method-assign,assignment]


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected[0] += len(items)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = [item for item in items if item.get_closest_marker("suite_last")]
    items[:] = [item for item in items if not item.get_closest_marker("suite_last")] + last


def transition_record(config: pytest.Config) -> TransitionRecord:
    """The moves recorded so far in this run."""
    return config.stash[_RECORD]


def whole_suite_collected(config: pytest.Config) -> bool:
    """The run collected the whole suite: every path asked for holds the tests/
    directory (no file, subdirectory or test id) and no test was deselected."""
    root = Path(__file__).resolve().parent
    here = config.invocation_params.dir
    asked = [Path(here, str(arg).split("::")[0]).resolve() for arg in config.args]
    whole = bool(asked) and all(
        "::" not in str(arg) and root.is_relative_to(path)
        for arg, path in zip(config.args, asked, strict=True)
    )
    return whole and _deselected[0] == 0


# --------------------------------------------------------------------------- sockets


@pytest.fixture
def nobody() -> str:
    """A loopback TCP endpoint nobody listens on (yet): a broker that is away."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A zmq context whose term() must finish within 5 s (pyzmq's conftest idea)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    assert done.wait(5), "zmq context term() hung: a socket was left open"


def loopback_config(**batching: float) -> BrokerConfig:
    """A broker on free loopback ports; unknown models are NOT_FOUND from its start (no
    ``register_grace_s``: its workers are the test's, registered before it asks)."""
    return BrokerConfig(
        frontend="tcp://127.0.0.1:*",
        backend="tcp://127.0.0.1:*",
        register_grace_s=0.0,
        batching=BatchingConfig(**batching),  # type: ignore[arg-type]
    )


def wait_for_workers(client: Client, count: int, timeout_s: float = 30.0) -> None:
    """Block until the broker has ``count`` live workers (checked over STATS)."""
    clock = MonotonicClock()
    until = clock.now() + timeout_s
    while clock.now() < until:
        if len(client.stats()["workers"]) >= count:
            return
        client.poll(0.02)
    raise AssertionError(f"fewer than {count} workers registered within {timeout_s} s")


class Fleet:
    """A broker and workers on threads, over real loopback sockets; clients on demand."""

    def __init__(self, stack: contextlib.ExitStack, config: BrokerConfig) -> None:
        self._stack = stack
        self.broker: BrokerServer = stack.enter_context(ServerThread(BrokerServer(config)))
        self.workers: list[WorkerServer] = []

    def add_worker(self, models: Mapping[str, EngineFactory], **kwargs: object) -> WorkerServer:
        worker = WorkerServer(self.broker.backend_endpoint, models, **kwargs)  # type: ignore[arg-type]
        self.workers.append(self._stack.enter_context(ServerThread(worker)))
        return worker

    def client(self, **kwargs: object) -> Client:
        return self._stack.enter_context(Client(self.broker.frontend_endpoint, **kwargs))  # type: ignore[arg-type]

    def ready(self, count: int | None = None) -> Client:
        client = self.client()
        wait_for_workers(client, len(self.workers) if count is None else count)
        return client


@pytest.fixture
def fleet_factory() -> Iterator[Callable[..., Fleet]]:
    """Build fleets; everything started is stopped and closed at teardown."""
    with contextlib.ExitStack() as stack:

        def make(**batching: float) -> Fleet:
            return Fleet(stack, loopback_config(**batching))

        yield make
