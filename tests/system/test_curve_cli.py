"""``carpool keygen``, and a broker and worker started with CURVE flags: served, then a
client key removed from its allow-list is refused after SIGHUP, without a restart."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from carpool.client import Client, PermissionDenied
from carpool.common.clock import MonotonicClock
from carpool.common.curve import ClientKeys, connect_keys, load_keypair, load_public
from carpool.common.protocol import Command, encode
from tests.system.test_cli import (  # noqa: F401  (spawn: the fixture)
    STOP_TIMEOUT_S,
    Spawn,
    _carpool,
    _logs,
    _until_registered,
    spawn,
)

pytestmark = pytest.mark.timeout(120)


def test_keygen_writes_a_private_secret_and_never_replaces_a_pair(tmp_path: Path) -> None:
    done = _carpool("keygen", str(tmp_path / "keys"), "robot-1")
    assert done.returncode == 0, done.stderr
    secret = tmp_path / "keys" / "robot-1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    pair = load_keypair(secret)
    assert load_public(tmp_path / "keys" / "robot-1.key") == pair.public
    again = _carpool("keygen", str(tmp_path / "keys"), "robot-1")
    assert again.returncode == 2
    assert "exists already" in again.stderr


def _handshake(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, keys: ClientKeys) -> int:
    """The outcome of one CURVE handshake with ``keys`` at ``endpoint``."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_keys(sock, keys)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    sock.connect(endpoint)
    sock.send_multipart(encode(Command.STATS, {"id": 1}))
    try:
        assert monitor.poll(10_000), "no handshake outcome"
        return int(recv_monitor_message(monitor)["event"])
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


def test_broker_and_worker_with_curve_flags_and_sighup_revocation(
    tmp_path: Path,
    spawn: Spawn,  # noqa: F811  (the fixture imported above)
) -> None:
    k = tmp_path / "keys"
    for sub, name in [
        ("broker", "broker"),
        ("clients", "app"),
        ("workers", "w0"),
        ("operators", "ops"),
    ]:
        assert _carpool("keygen", str(k / sub), name).returncode == 0
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    broker_key = str(k / "broker" / "broker.key")
    broker = spawn(
        "broker",
        "--frontend",
        frontend,
        "--backend",
        backend,
        "--curve",
        "--curve-server-key",
        str(k / "broker" / "broker.key_secret"),
        "--curve-clients",
        str(k / "clients"),
        "--curve-workers",
        str(k / "workers"),
        "--curve-operators",
        str(k / "operators"),
    )
    worker = spawn(
        "worker",
        "--broker",
        backend,
        "--synthetic",
        "1",
        "0.1",
        "--name",
        "w0",
        "--curve-broker-key",
        broker_key,
        "--curve-key",
        str(k / "workers" / "w0.key_secret"),
    )
    ops = {"curve_server_key": broker_key, "curve_key": str(k / "operators" / "ops.key_secret")}
    app = {"curve_server_key": broker_key, "curve_key": str(k / "clients" / "app.key_secret")}
    with Client(frontend, default_timeout_s=5.0, **ops) as operator:  # type: ignore[arg-type]
        assert [w["name"] for w in _until_registered(operator, broker, worker, tmp_path)] == ["w0"]
    with Client(frontend, default_timeout_s=5.0, **app) as client:  # type: ignore[arg-type]
        x = np.ones((2, 16), np.float32)
        assert client.submit("synthetic", {"x": x}, timeout_s=5.0).result().batch_size == 2
        with pytest.raises(PermissionDenied):
            client.stats(timeout_s=5.0)

    keys = ClientKeys(load_public(broker_key), load_keypair(k / "clients" / "app.key_secret"))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        assert _handshake(context, frontend, keys) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        os.remove(k / "clients" / "app.key")
        broker.send_signal(signal.SIGHUP)
        clock = MonotonicClock()
        until = clock.now() + 10.0
        while "allow-lists reloaded" not in _logs(tmp_path):
            assert clock.now() < until, "no reload\n" + _logs(tmp_path)
            assert broker.poll() is None, _logs(tmp_path)
            zmq.select([], [], [], 0.05)  # a short pause
        assert _handshake(context, frontend, keys) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert "refused on the client socket" in _logs(tmp_path)
    finally:
        context.destroy(linger=0)
    worker.terminate()
    assert worker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)
    broker.terminate()
    assert broker.wait(timeout=STOP_TIMEOUT_S) == 0, _logs(tmp_path)


def test_a_secret_key_given_on_the_command_line_is_refused_naming_the_flag(
    tmp_path: Path,
) -> None:
    k = tmp_path / "keys"
    for sub in ("broker", "clients", "workers"):
        assert _carpool("keygen", str(k / sub), sub).returncode == 0
    text = load_keypair(k / "broker" / "broker.key_secret").secret.decode()
    done = _carpool(
        "broker",
        "--frontend",
        f"ipc://{tmp_path}/frontend",
        "--backend",
        f"ipc://{tmp_path}/backend",
        "--curve",
        "--curve-server-key",
        text,
        "--curve-clients",
        str(k / "clients"),
        "--curve-workers",
        str(k / "workers"),
    )
    assert done.returncode == 2, done.stderr
    assert "--curve-server-key" in done.stderr
    assert text not in done.stderr
