"""A peer on the worker socket that announces new model names from fresh sockets, round
after round, over real loopback sockets: a READY with more models than
``max_models_per_worker`` is refused with DISCONNECT, the names of workers that fell
silent are forgotten after ``forget_unserved_s`` (they answer NOT_FOUND again, and what
the broker tracks returns to what live workers serve), and ordinary requests are served
throughout."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import zmq

from carpool.client import NotFound
from carpool.common.clock import MonotonicClock
from carpool.common.protocol import Command, ModelSpec, Ready, TensorMeta, encode, parse_header
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from tests.conftest import Fleet, loopback_config, wait_for_workers

pytestmark = pytest.mark.timeout(60)

ROUNDS = 30
#: Names a round announces in one READY (over the limit), and in another (within it).
MANY, FEW = 200, 50
GOOD = np.ones((2, 4), np.float32)


def _ready(names: list[str], heartbeat_ms: int) -> list[bytes]:
    x, y = TensorMeta("x", "float32", (-1, 4)), TensorMeta("y", "float32", (-1, 4))
    specs = tuple(ModelSpec(name, (x,), (y,), 4) for name in names)
    return encode(Command.READY, Ready("flood", 1, specs, heartbeat_ms).to_wire())


def _first_command(sock: zmq.Socket[bytes]) -> Command:
    assert sock.poll(5000), "the broker sent nothing to a peer that said READY"
    return parse_header(sock.recv_multipart()[0])


def test_names_announced_from_fresh_sockets_stay_bounded_and_requests_are_served(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    config = dataclasses.replace(loopback_config(max_wait_s=0.001), forget_unserved_s=0.2)
    with contextlib.ExitStack() as stack:
        fleet = Fleet(stack, config)
        fleet.add_worker({"syn": lambda: SyntheticEngine(item_shape=(4,), max_batch=4)})
        client = fleet.client()
        wait_for_workers(client, 1)
        answers: list[Command] = []
        silent: list[zmq.Socket[bytes]] = []
        try:
            for r in range(ROUNDS):
                refused = context.socket(zmq.DEALER)
                try:
                    refused.connect(fleet.broker.backend_endpoint)
                    refused.send_multipart(_ready([f"many-{r}-{i}" for i in range(MANY)], 10))
                    answers.append(_first_command(refused))
                finally:
                    refused.close(linger=0)
                # Registered, then never heard from again.
                silent.append(context.socket(zmq.DEALER))
                silent[-1].connect(fleet.broker.backend_endpoint)
                silent[-1].send_multipart(_ready([f"few-{r}-{i}" for i in range(FEW)], 1000))
            assert answers == [Command.DISCONNECT] * ROUNDS
            # (Counted in the core: a STATS reply listing 31 workers' 50 lanes each would
            # pass the 64 KiB a meta frame may have.)
            registry = fleet.broker.core.registry
            clock = MonotonicClock()
            until = clock.now() + 10.0
            while len(registry) < 1 + ROUNDS and clock.now() < until:
                client.poll(0.02)
            assert (len(registry), len(registry.specs)) == (1 + ROUNDS, 1 + ROUNDS * FEW)
        finally:
            for sock in silent:
                sock.close(linger=0)
        # The silent workers are found gone (their next HEARTBEAT cannot be delivered, or
        # 3 x 1 s of silence), then their names are forgotten.
        until = clock.now() + 10.0
        while len(registry.specs) > 1 and clock.now() < until:
            client.poll(0.05)
        assert client.stats()["known_models"] == 1  # "syn", whose worker lives
        with pytest.raises(NotFound):
            client.infer("few-0-0", {"x": GOOD}, timeout_s=5)
        np.testing.assert_array_equal(
            client.infer("syn", {"x": GOOD}, timeout_s=5)["y"], synthetic_output(GOOD)
        )
        assert [w["models"] for w in client.stats()["workers"]] == [["syn"]]
