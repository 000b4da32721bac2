"""A broker process told to stop (SIGTERM) while a client sends at a steady rate answers
every request sent on the client's connection; the client leaves that connection at the
first UNAVAILABLE with retry, and each request refused so is its to send again on its
next connection (protocol.md §11), with either client. No broker comes back here, so
such a request fails with the broker's answer ("stopping") as soon as its budget no
longer allows sending it again; none waits for the SDK's own expiry (timeout plus
grace), and nothing is sent again. (tests/integration/test_client_resend.py and
test_client_leaves_a_stopping_broker.py have the rules on a scripted socket: too little
budget left, failed at once; the broker coming back; the old connection read to the
end.)"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest

from carpool.client import AsyncClient, Client, Unavailable

pytestmark = pytest.mark.timeout(60)

RATE_RPS = 500
TIMEOUT_S = 2.0


def test_a_stopping_broker_leaves_no_request_to_its_timeout(tmp_path: Path) -> None:
    frontend = f"ipc://{tmp_path}/fe"
    with (tmp_path / "broker.log").open("wb") as log:
        _run(tmp_path, frontend, log)


def _start_broker(tmp_path: Path, frontend: str, log: BinaryIO) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "carpool",
            "broker",
            "--frontend",
            frontend,
            "--backend",
            f"ipc://{tmp_path}/be",
            "--embed-synthetic",
            "2",
            "0.1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _kind(exc: Unavailable) -> str:
    text = str(exc)
    if "no reply from the broker" in text:
        return "timed out"
    if "stopping" in text or "stopped" in text:
        return "stopping"
    if "connection to the broker closed" in text:
        return "connection closed"
    return text


def _run(tmp_path: Path, frontend: str, log: BinaryIO) -> None:
    broker = _start_broker(tmp_path, frontend, log)
    x = np.ones((1, 16), np.float32)
    try:
        with Client(frontend, default_timeout_s=TIMEOUT_S, grace_s=0.5) as client:
            client.infer("synthetic", {"x": x}, timeout_s=30)  # up and serving
            futures = []
            start = time.monotonic()
            stopped_at = None
            n = 0
            # Send until the client leaves the connection (bounded: 10 s).
            while client.core.switches == 0 and (now := time.monotonic()) - start < 10:
                if stopped_at is None and now - start > 0.5:
                    broker.send_signal(signal.SIGTERM)
                    stopped_at = now
                due = start + n / RATE_RPS
                if now < due:
                    client.poll(min(due - now, 0.002))
                    continue
                futures.append(client.submit("synthetic", {"x": x}))
                n += 1
            assert client.core.switches == 1, "the client never left the stopping broker"
            done_at_switch = [future.done() for future in futures]
            kinds = []
            for future in futures:
                try:
                    future.result(TIMEOUT_S + 2)
                    kinds.append("answered")
                except Unavailable as exc:
                    kinds.append(_kind(exc))
            on_the_connection = _before_the_switch(kinds, done_at_switch)
            _assert_nothing_lost(Counter(on_the_connection), len(on_the_connection), client)
        assert broker.wait(10) == 0
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()


def _before_the_switch(kinds: list[str], done_at_switch: list[bool]) -> list[str]:
    """The outcomes, in the order of the calls, of the requests the client's I/O thread
    took before it left the stopping broker. This loop reads ``switches`` from another
    thread, so a call handed just before the switch may be taken just after it: it goes
    to the next connection, which no broker takes here, and fails there when its send
    window passes ("not taking requests"), as the client promises. Calls are taken in
    order, so such requests are the last ones, after every request of the left
    connection; and their windows (the timeout) had not passed when the loop saw the
    switch. Only a request never sent fails "not taking requests": one sent on the left
    connection and left to its timeout fails otherwise ("no reply"), and is counted; one
    left unsent there until its window passed would have failed before the switch."""
    after = [k == "the broker is not taking requests" for k in kinds]
    first = after.index(True) if True in after else len(kinds)
    assert all(after[first:]), kinds  # (none of them before a request of the connection)
    assert not any(done_at_switch[first:]), "a request failed unsent before the switch"
    return kinds[:first]


def _assert_nothing_lost(outcomes: Counter[str], sent: int, client: Client | AsyncClient) -> None:
    """Every request sent was answered, refused "stopping", or failed because the
    connection closed (at once, or when its budget to be sent again ran out); none waited
    out its timeout, none was sent again (no broker came back), and no reply came after
    the SDK gave up. The connection the client left was read until the broker had
    answered every request sent on it: not lost."""
    assert sum(outcomes.values()) == sent
    assert outcomes["answered"] > 0
    assert outcomes["timed out"] == 0, outcomes
    assert set(outcomes) <= {"answered", "stopping", "connection closed"}, outcomes
    assert client.core.resends == 0
    assert client.core.late_replies == 0
    assert (client.core.switches, client.core.lost_connections) == (1, 0)


def test_a_stopping_broker_leaves_no_async_request_to_its_timeout(tmp_path: Path) -> None:
    frontend = f"ipc://{tmp_path}/fe"
    with (tmp_path / "broker.log").open("wb") as log:
        broker = _start_broker(tmp_path, frontend, log)
        try:
            asyncio.run(_run_async(frontend, broker))
            assert broker.wait(10) == 0
        finally:
            if broker.poll() is None:
                broker.kill()
                broker.wait()


async def _run_async(frontend: str, broker: subprocess.Popen[bytes]) -> None:
    x = np.ones((1, 16), np.float32)
    async with AsyncClient(frontend, default_timeout_s=TIMEOUT_S, grace_s=0.5) as client:
        await client.infer("synthetic", {"x": x}, timeout_s=30)  # up and serving
        futures = []
        loop = asyncio.get_running_loop()
        start = loop.time()
        stopped = False
        n = 0
        # Send until the client leaves the connection (bounded: 10 s).
        while client.core.switches == 0 and (now := loop.time()) - start < 10:
            if not stopped and now - start > 0.5:
                broker.send_signal(signal.SIGTERM)
                stopped = True
            due = start + n / RATE_RPS
            if now < due:
                await asyncio.sleep(min(due - now, 0.002))
                continue
            futures.append(await client.submit("synthetic", {"x": x}))
            n += 1
        assert client.core.switches == 1, "the client never left the stopping broker"
        outcomes: Counter[str] = Counter()
        for future in futures:
            try:
                await asyncio.wait_for(future, TIMEOUT_S + 2)
                outcomes["answered"] += 1
            except Unavailable as exc:
                outcomes[_kind(exc)] += 1
        _assert_nothing_lost(outcomes, len(futures), client)


def test_a_request_the_client_failed_while_the_broker_was_away_never_runs(
    tmp_path: Path,
) -> None:
    """Sent between a broker's stop and its restart, a request waits for room in the
    client (no connection is up to queue it on) and fails there at its timeout; the
    broker started next never receives it, so no reply comes for a failed request."""
    frontend = f"ipc://{tmp_path}/fe"
    x = np.ones((1, 16), np.float32)
    with (tmp_path / "broker.log").open("wb") as log:
        brokers = [_start_broker(tmp_path, frontend, log)]
        try:
            with Client(frontend, default_timeout_s=0.5, grace_s=0.2) as client:
                client.infer("synthetic", {"x": x}, timeout_s=30)  # up and serving
                brokers[0].send_signal(signal.SIGTERM)
                assert brokers[0].wait(10) == 0
                until = time.monotonic() + 10
                while client.core.lost_connections == 0 and time.monotonic() < until:
                    client.poll(0.05)
                assert client.core.lost_connections == 1, "the client never saw the broker go"
                futures = [client.submit("synthetic", {"x": x}) for _ in range(3)]
                for future in futures:
                    with pytest.raises(Unavailable):
                        future.result(5.0)
                brokers.append(_start_broker(tmp_path, frontend, log))
                _until_served(client, x)
                client.poll(0.2)  # (a reply to an earlier request would have come first)
                assert client.core.late_replies == 0
        finally:
            for broker in brokers:
                if broker.poll() is None:
                    broker.terminate()
                    broker.wait(10)


def _until_served(client: Client, x: np.ndarray) -> None:
    """Send until a request is answered (the broker starting, its worker registering)."""
    until = time.monotonic() + 30
    while True:
        try:
            client.infer("synthetic", {"x": x}, timeout_s=5)
            return
        except Unavailable:
            assert time.monotonic() < until, "the broker never served"
            client.poll(0.1)
