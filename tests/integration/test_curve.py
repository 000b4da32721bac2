"""CURVE on both broker sockets, over real loopback sockets: who gets in, who gets what.

Keys are made with :func:`carpool.common.curve.create_keypair` in a temporary directory:
the broker's pair, a client and a worker on their allow-lists, an operator, and a
stranger on none. A refused peer's own socket monitor says when its handshake failed, so
the tests wait for that event, never for a while.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from carpool.broker.auth import BrokerAuth, Door
from carpool.broker.config import CurveConfig
from carpool.broker.server import BrokerServer
from carpool.client import Client, ClientOptions, PermissionDenied
from carpool.client.core import ClientCore
from carpool.common.clock import MonotonicClock
from carpool.common.curve import ClientKeys, connect_keys, create_keypair, load_keypair
from carpool.common.errors import ConfigError
from carpool.common.protocol import (
    Command,
    ModelSpec,
    Ready,
    TensorMeta,
    WorkerReady,
    encode,
)
from carpool.common.sockets import recv_frames
from carpool.common.testing import ServerThread
from carpool.worker.config import WorkerConfig
from carpool.worker.engines.synthetic import SyntheticEngine
from carpool.worker.factory import worker_server
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config, wait_for_workers

pytestmark = pytest.mark.timeout(60)

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclasses.dataclass
class Keys:
    root: Path
    curve: CurveConfig
    broker_public: bytes

    def pair(self, name: str) -> ClientKeys:
        for sub in ("clients", "workers", "operators", "strangers"):
            path = self.root / sub / f"{name}.key_secret"
            if path.exists():
                return ClientKeys(self.broker_public, load_keypair(path))
        raise KeyError(name)

    def secret_file(self, name: str) -> str:
        return next(str(p) for p in self.root.glob(f"*/{name}.key_secret"))


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    made = {}
    for sub, names in {
        "broker": ["broker"],
        "clients": ["client", "other-client"],
        "workers": ["worker", "other-worker"],
        "operators": ["operator"],
        "strangers": ["stranger"],
    }.items():
        for name in names:
            made[name] = create_keypair(tmp_path / sub, name)
    curve = CurveConfig(
        enabled=True,
        server_key=str(made["broker"][1]),
        clients=str(tmp_path / "clients"),
        workers=str(tmp_path / "workers"),
        operators=str(tmp_path / "operators"),
    )
    return Keys(tmp_path, curve, load_keypair(made["broker"][1]).public)


@pytest.fixture
def broker(keys: Keys) -> Iterator[BrokerServer]:
    config = dataclasses.replace(loopback_config(), curve=keys.curve)
    with ServerThread(BrokerServer(config)) as server:
        yield server


def _dealer(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    keys: ClientKeys | None,
    routing_id: bytes = b"",
    *,
    watch: bool = True,
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
    """A DEALER (CURVE with ``keys``) and a monitor of its handshake's outcome (with
    ``watch``; close both with :func:`_close`, which stops the monitor first)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if keys is not None:
        connect_keys(sock, keys)
    monitor = sock.get_monitor_socket(_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED) if watch else None
    sock.connect(endpoint)
    return sock, monitor


def _close(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes] | None) -> None:
    if monitor is not None:
        sock.disable_monitor()
        monitor.close()
    sock.close()


def _send_now(sock: zmq.Socket[bytes], frames: list[Any]) -> None:
    """Send without waiting: once a handshake has failed the DEALER has no pipe left, and a
    blocking send would wait for ever (where the test expects nothing to be heard)."""
    with contextlib.suppress(zmq.Again):
        sock.send_multipart(frames, zmq.NOBLOCK)


def _handshake(monitor: zmq.Socket[bytes] | None, timeout_s: float = 10.0) -> int:
    """The first handshake outcome its monitor reports."""
    assert monitor is not None
    assert monitor.poll(int(timeout_s * 1000)), "no handshake outcome"
    return int(recv_monitor_message(monitor)["event"])


def _operator_stats(keys: Keys, broker: BrokerServer, **kwargs: Any) -> dict[str, Any]:
    with Client(
        broker.frontend_endpoint,
        curve_server_key=broker.auth.pair.public.decode() if broker.auth else "",
        curve_key=keys.secret_file("operator"),
        **kwargs,
    ) as client:
        return client.stats()


def _curve_client(keys: Keys, broker: BrokerServer, name: str) -> Client:
    return Client(
        broker.frontend_endpoint,
        curve_server_key=keys.broker_public.decode(),
        curve_key=keys.secret_file(name),
    )


def test_a_client_on_the_list_is_served_and_stats_answer_operator_keys_only(
    keys: Keys, broker: BrokerServer
) -> None:
    with (
        WorkerServer(
            broker.backend_endpoint,
            {"m": lambda: SyntheticEngine(item_shape=(3,), max_batch=4)},
            curve=keys.pair("worker"),
        ) as worker,
        ServerThread(worker),
    ):
        with _curve_client(keys, broker, "operator") as operator:
            wait_for_workers(operator, 1)
            assert operator.stats()["workers"]
        with _curve_client(keys, broker, "client") as client:
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            out = client.infer("m", {"x": x}, timeout_s=5)
            assert next(iter(out.values())).shape[0] == 2
            with pytest.raises(PermissionDenied):
                client.stats(timeout_s=5)


@pytest.mark.parametrize("who", ["stranger", "plain"])
def test_an_unknown_key_or_a_plain_text_peer_gets_nothing_through(
    keys: Keys, broker: BrokerServer, context: zmq.Context[zmq.Socket[bytes]], who: str
) -> None:
    before = _operator_stats(keys, broker)["requests"]
    pair = keys.pair("stranger") if who == "stranger" else None
    for endpoint in (broker.frontend_endpoint, broker.backend_endpoint):
        sock, monitor = _dealer(context, endpoint, pair)
        _send_now(sock, encode(Command.STATS, {"id": 1}))
        assert _handshake(monitor) & _FAILED
        assert not sock.poll(100)
        _close(sock, monitor)
    # The operator's STATS is the one request counted since (none of theirs arrived).
    assert _operator_stats(keys, broker)["requests"] == before + 1
    assert broker.auth is not None
    if who == "stranger":
        assert broker.auth.failures.total >= 2  # logged (rate-limited), both sockets


def _ready(name: str) -> list[Any]:
    """READY of a worker on a raw socket, which sends no heartbeats: with a minute between
    them it stays registered however slowly a loaded machine runs the test."""
    spec = ModelSpec(
        "m", (TensorMeta("x", "float32", (-1, 3)),), (TensorMeta("y", "float32", (-1, 3)),), 4
    )
    return WorkerReady(Ready(name, 1, (spec,), 60_000)).to_frames()


def test_a_client_key_cannot_register_as_a_worker(
    keys: Keys, broker: BrokerServer, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    sock, monitor = _dealer(context, broker.backend_endpoint, keys.pair("client"))
    sock.send_multipart(_ready("impostor"))
    assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    real, real_monitor = _dealer(context, broker.backend_endpoint, keys.pair("worker"))
    real.send_multipart(_ready("real"))
    assert _handshake(real_monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    with _curve_client(keys, broker, "operator") as operator:
        wait_for_workers(operator, 1)
        names = [w["name"] for w in operator.stats()["workers"]]
    assert names == ["real"]
    _close(sock, monitor)
    _close(real, real_monitor)


def test_a_worker_id_taken_over_by_another_worker_key_is_not_heard(
    keys: Keys, broker: BrokerServer, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    first, monitor = _dealer(context, broker.backend_endpoint, keys.pair("worker"), b"w-1")
    first.send_multipart(_ready("first"))
    with _curve_client(keys, broker, "operator") as operator:
        wait_for_workers(operator, 1)
        _close(first, monitor)
        assert broker.auth is not None
        refused = broker._zmq.keys
        assert refused is not None
        clock = MonotonicClock()
        until = clock.now() + 10
        second: zmq.Socket[bytes] | None = None
        while refused.refused == 0 and clock.now() < until:
            # Another worker key under the same routing id, while "first" is registered.
            # A connection made before the broker's ROUTER has let go of the first one is
            # never heard (libzmq ignores a routing id in use); the next one is.
            if second is not None:
                _close(second, monitor)
            second, monitor = _dealer(
                context, broker.backend_endpoint, keys.pair("other-worker"), b"w-1"
            )
            assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            attempt_until = clock.now() + 1
            while refused.refused == 0 and clock.now() < attempt_until:
                second.send_multipart(_ready("second"))
                operator.poll(0.05)
        assert refused.refused >= 1
        names = [w["name"] for w in operator.stats()["workers"]]
    assert "second" not in names
    assert second is not None
    _close(second, monitor)


def test_a_key_removed_from_the_list_is_refused_after_sighup_reload(
    keys: Keys, broker: BrokerServer, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pair = keys.pair("other-client")
    sock, monitor = _dealer(context, broker.frontend_endpoint, pair)
    sock.send_multipart(encode(Command.STATS, {"id": 1}))
    assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert sock.poll(10_000)  # answered (PERMISSION_DENIED: not an operator)
    _close(sock, monitor)
    os.remove(keys.root / "clients" / "other-client.key")
    assert broker.reload_keys()
    sock, monitor = _dealer(context, broker.frontend_endpoint, pair)
    _send_now(sock, encode(Command.STATS, {"id": 2}))
    assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert not sock.poll(100)
    _close(sock, monitor)


def test_a_reload_that_cannot_read_a_list_keeps_the_current_ones(
    keys: Keys, broker: BrokerServer, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pair = keys.pair("client")
    (keys.root / "clients").rename(keys.root / "gone")
    assert not broker.reload_keys()
    sock, monitor = _dealer(context, broker.frontend_endpoint, pair)
    sock.send_multipart(encode(Command.STATS, {"id": 1}))
    assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert sock.poll(10_000)
    _close(sock, monitor)


def test_a_reply_never_reaches_another_key_under_the_same_routing_id(
    keys: Keys, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    config = dataclasses.replace(loopback_config(), curve=keys.curve)
    with (
        ServerThread(BrokerServer(config)) as broker,
        WorkerServer(
            broker.backend_endpoint,
            {"slow": lambda: SyntheticEngine(item_shape=(3,), max_batch=1, fixed_cost_s=0.5)},
            curve=keys.pair("worker"),
        ) as worker,
        ServerThread(worker),
        _curve_client(keys, broker, "operator") as operator,
    ):
        wait_for_workers(operator, 1)
        before = operator.stats()["requests"]
        victim, monitor = _dealer(
            context, broker.frontend_endpoint, keys.pair("client"), b"same-id"
        )
        core = ClientCore.from_options(ClientOptions())
        frames = core.request(0.0, "slow", {"x": np.zeros((1, 3), np.float32)}, 5.0)[1]
        victim.send_multipart(frames, copy=False)
        assert _handshake(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        # The broker has the request (the operator's STATS counts it), then it goes.
        _until(lambda: operator.stats()["requests"] >= before + 2, operator)
        _close(victim, monitor)
        # A client with another key takes the routing id: it is heard under it (its
        # first message answered) before the slow batch ends.
        thief = _take_routing_id(context, broker, keys.pair("other-client"), b"same-id")
        _until(lambda: _batch_done(operator.stats()), operator)
        got = []
        while thief.poll(300):
            got.append(recv_frames(thief))
        assert got == []  # the victim's REPLY never comes here
        thief.close()


def _batch_done(stats: dict[str, Any]) -> bool:
    return bool(stats["batch_sizes"].get("slow")) and stats["inflight_batches"] == 0


def _until(cond: Callable[[], bool], client: Client, timeout_s: float = 10.0) -> None:
    clock = MonotonicClock()
    until = clock.now() + timeout_s
    while not cond():
        assert clock.now() < until, "condition not met in time"
        client.poll(0.02)


def _take_routing_id(
    context: zmq.Context[zmq.Socket[bytes]],
    broker: BrokerServer,
    keys: ClientKeys,
    routing_id: bytes,
) -> zmq.Socket[bytes]:
    """A DEALER the broker hears under ``routing_id``: while the id's last holder is
    still known to the ROUTER, a newcomer's first message is taken for its id instead,
    and its STATS goes unanswered; then it tries again with a new socket."""
    clock = MonotonicClock()
    until = clock.now() + 10
    while clock.now() < until:
        sock = _dealer(context, broker.frontend_endpoint, keys, routing_id, watch=False)[0]
        sock.send_multipart(encode(Command.STATS, {"id": 99}))
        if sock.poll(300):
            recv_frames(sock)  # PERMISSION_DENIED: the broker heard it under routing_id
            return sock
        sock.close()
    raise AssertionError(f"no socket got routing id {routing_id!r}")


def test_secret_key_files_others_may_read_are_refused(keys: Keys) -> None:
    secret = Path(keys.curve.server_key)
    os.chmod(secret, 0o640)
    with pytest.raises(ConfigError, match=r"broker\.key_secret has mode 0640"):
        BrokerServer(dataclasses.replace(loopback_config(), curve=keys.curve))
    with pytest.raises(ConfigError, match="mode 0640"):
        Client(
            "tcp://127.0.0.1:1",
            curve_server_key=keys.broker_public.decode(),
            curve_key=str(secret),
        )


def test_a_secret_key_given_as_text_is_refused_by_broker_worker_and_client(keys: Keys) -> None:
    text = load_keypair(keys.curve.server_key).secret.decode()
    curve = dataclasses.replace(keys.curve, server_key=text)
    with pytest.raises(ConfigError, match=r"curve\.server_key \(--curve-server-key\)") as raised:
        BrokerServer(dataclasses.replace(loopback_config(), curve=curve))
    assert text not in str(raised.value)
    worker = WorkerConfig(curve_broker_key=keys.broker_public.decode(), curve_key=text)
    with pytest.raises(ConfigError, match=r"curve_key \(--curve-key\) must be the path"):
        worker_server(worker)
    with pytest.raises(ConfigError, match=r"ClientOptions\.curve_key must be the path"):
        Client("tcp://127.0.0.1:1", curve_server_key=keys.broker_public.decode(), curve_key=text)


def test_a_reload_refuses_an_allow_list_others_may_write_and_keeps_the_current_ones(
    keys: Keys,
    broker: BrokerServer,
    context: zmq.Context[zmq.Socket[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A directory others may write: anyone could have added a key to it.
    os.chmod(keys.root / "clients", 0o777)
    shutil.copy(keys.root / "strangers" / "stranger.key", keys.root / "clients")
    with caplog.at_level(logging.ERROR, "carpool.broker.auth"):
        assert not broker.reload_keys()
    assert f"{keys.root / 'clients'} has mode 0777" in caplog.text
    for name, outcome in [
        ("stranger", zmq.EVENT_HANDSHAKE_FAILED_AUTH),
        ("client", zmq.EVENT_HANDSHAKE_SUCCEEDED),
    ]:
        sock, monitor = _dealer(context, broker.frontend_endpoint, keys.pair(name))
        _send_now(sock, encode(Command.STATS, {"id": 1}))
        assert _handshake(monitor) == outcome
        _close(sock, monitor)


def test_both_curve_sockets_enforce_their_zap_domain(broker: BrokerServer) -> None:
    for sock in (broker.frontend, broker.backend):
        assert sock.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1


@pytest.mark.parametrize("authenticator", ["running", "stopped"])
def test_a_curve_socket_whose_authenticator_stopped_refuses_every_handshake(
    keys: Keys, authenticator: str
) -> None:
    """The ROUTER's own monitor reports the outcome: a refusal for want of an
    authenticator sends the peer nothing, it only sees its connection close. (The door
    answers in the broker's loop; here a thread plays that loop.)"""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    door = Door(context)
    auth = BrokerAuth(door, keys.curve)
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    auth.secure_frontend(router)
    watch = router.get_monitor_socket(_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            if door.socket.poll(10):
                door.on_poll()

    loop = threading.Thread(target=answer, daemon=True)
    sock = None
    try:
        if authenticator == "stopped":
            door.close()
        else:
            loop.start()
        sock = _dealer(context, f"tcp://127.0.0.1:{port}", keys.pair("client"), watch=False)[0]
        _send_now(sock, encode(Command.STATS, {"id": 1}))
        outcome = _handshake(watch)
        heard = router.poll(10_000 if authenticator == "running" else 200)
    finally:
        if sock is not None:
            sock.close()
        if authenticator == "running":
            done.set()
            loop.join(5)
            door.close()
        router.disable_monitor()
        watch.close()
        router.close()
        context.term()
    if authenticator == "running":
        assert outcome == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert heard
    else:
        assert outcome & _FAILED
        assert not heard
