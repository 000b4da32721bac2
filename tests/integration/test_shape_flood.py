"""A flood of requests each of its own shape, over real loopback sockets: a model with a
dynamic item dim queues each shape apart (OCR lines, crops, cameras of several
resolutions make many queue keys), and every request is answered with its own result."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import numpy as np
import pytest

from carpool.client import RequestError
from carpool.worker.engines.synthetic import SyntheticEngine, synthetic_output
from tests.conftest import Fleet, loopback_config

#: Requests, each of shape [1, k] for k = 1..SHAPES: a queue each. (Before a finished
#: batch pumped only while a worker had a slot free, each batch pumped every queue and
#: this many took the broker past the 20 s timeouts.)
SHAPES = 3000
TIMEOUT_S = 20.0


@pytest.mark.timeout(90)
def test_every_request_of_a_flood_of_distinct_shapes_gets_its_own_result() -> None:
    # Issue #27: alpha 1 ms, beta 0, two slots; the whole flood is 3 s of engine time.
    engine = SyntheticEngine(fixed_cost_s=0.001, per_sample_s=0.0, item_shape=(-1,))
    config = dataclasses.replace(loopback_config(), max_client_requests=SHAPES)
    with contextlib.ExitStack() as stack:
        fleet = Fleet(stack, config)
        fleet.add_worker({"synthetic": lambda: engine}, slots=2, warmup=False)
        client = fleet.ready()
        inputs = [np.full((1, k), k % 251, np.float32) for k in range(1, SHAPES + 1)]
        futures = [client.submit("synthetic", {"x": x}, timeout_s=TIMEOUT_S) for x in inputs]
        failed: Counter[str] = Counter()  # the answers that were errors, by message
        for x, future in zip(inputs, futures, strict=True):
            try:
                y = future.outputs(timeout_s=TIMEOUT_S + 10)["y"]
            except RequestError as exc:
                failed[f"{type(exc).__name__}: {exc}"[:90]] += 1
                continue
            np.testing.assert_array_equal(y, synthetic_output(x))
        assert failed == {}
        stats = client.stats()
        assert (stats["replies"], stats["shed"], stats["errors"]) == (SHAPES, 0, {})
