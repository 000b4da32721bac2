"""docs/protocol.md §7.1: the raw pyzmq REQ client with CURVE, run as the document shows it
against a broker with CURVE on (only its key paths and endpoint replaced), and the same
client with a key not on the allow-list, which gets no answer."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.broker.config import CurveConfig
from carpool.broker.server import BrokerServer
from carpool.common.curve import client_keys, create_keypair
from carpool.common.testing import ServerThread
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config

pytestmark = pytest.mark.timeout(60)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _example() -> str:
    (code,) = re.findall(r"```python curve-client\n(.*?)```", DOC.read_text("utf-8"), re.S)
    return str(code)


@pytest.mark.parametrize("client", ["robot-1", "stranger"])
def test_the_documented_curve_client_is_answered_and_a_stranger_is_not(
    tmp_path: Path, client: str
) -> None:
    keys = tmp_path / "keys"
    create_keypair(keys, "broker")
    create_keypair(tmp_path / "clients", "robot-1")
    create_keypair(tmp_path / "workers", "w")
    if client == "stranger":  # a pair of the same name, on no list
        create_keypair(keys, "robot-1")
    else:
        for name in ("robot-1.key", "robot-1.key_secret"):
            (keys / name).hardlink_to(tmp_path / "clients" / name)
    curve = CurveConfig(
        enabled=True,
        server_key=str(keys / "broker.key_secret"),
        clients=str(tmp_path / "clients"),
        workers=str(tmp_path / "workers"),
    )
    config = dataclasses.replace(loopback_config(), curve=curve)
    with ServerThread(BrokerServer(config)) as broker:
        worker_keys = client_keys(str(keys / "broker.key"), str(tmp_path / "workers/w.key_secret"))
        with (
            WorkerServer(
                broker.backend_endpoint,
                {"affine": lambda: SyntheticEngine(item_shape=(3,), max_batch=4)},
                curve=worker_keys,
            ) as worker,
            ServerThread(worker),
        ):
            code = _example().replace('"keys/', f'"{keys}/')
            code = code.replace("tcp://broker.local:5555", broker.frontend_endpoint)
            scope: dict[str, Any] = {}
            try:
                if client == "stranger":
                    # No answer at all: 1 s is ample for one over loopback (the document's
                    # 5 s deadline is for a real network). A handshake refused before the
                    # send leaves the REQ socket no peer to send to: its send times out.
                    deadline = "req.rcvtimeo = req.sndtimeo = 5000"
                    assert deadline in code
                    bounded = "req.rcvtimeo = req.sndtimeo = 1000"
                    with pytest.raises(zmq.Again):
                        exec(code.replace(deadline, bounded), scope)
                    return
                # The worker may still be joining: UNAVAILABLE or NOT_FOUND until it has.
                for _ in range(50):
                    if "req" in scope:  # (each run of the example opens a socket)
                        scope["req"].close(linger=0)
                    try:
                        exec(code, scope)
                    except KeyError:  # (its last line reads the outputs an error lacks)
                        assert "outputs" not in scope["reply"], scope["reply"]
                    if "outputs" in scope["reply"]:
                        break
                    zmq.select([], [], [], 0.05)
                x = np.array([[1.5, -2, 0.25]], np.float32)
                np.testing.assert_array_equal(scope["y"], synthetic_output(x))
            finally:
                if "req" in scope:
                    scope["req"].close(linger=0)
