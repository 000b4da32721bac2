"""A broker, two workers and several clients over real loopback sockets, on real ONNX models."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from carpool.worker.engines.base import Array, Engine, EngineInfo
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.models import locate

MAX_BATCH = 8


class RecordingEngine:
    """Wraps a real engine and records the shape of every batch it runs (a seam fake)."""

    def __init__(self, inner: Engine, log: list[tuple[str, tuple[int, ...]]], name: str) -> None:
        self.inner = inner
        self.log = log
        self.name = name
        self._lock = threading.Lock()

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        with self._lock:
            self.log.append((self.name, tuple(inputs["x"].shape)))
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def references() -> dict[str, OnnxRuntimeEngine]:
    return {
        "orientation": OnnxRuntimeEngine(locate("orientation"), max_batch=MAX_BATCH),
        "ppocr-cls": OnnxRuntimeEngine(locate("ppocr-cls"), max_batch=MAX_BATCH),
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_thousand_pipelined_requests_two_models(fleet_factory: Any, references: Any) -> None:
    rng = np.random.default_rng(7)
    # Distinct inputs, each with its reference output from a direct onnxruntime call.
    cases: list[tuple[str, np.ndarray, np.ndarray]] = []
    for shape, model in [
        ((1, 3, 224, 224), "orientation"),
        ((1, 3, 48, 192), "ppocr-cls"),
        ((1, 3, 48, 320), "ppocr-cls"),  # a second item shape of the same model
        ((2, 3, 48, 192), "ppocr-cls"),  # a request with two samples
    ]:
        for _ in range(6):
            x = rng.standard_normal(shape).astype(np.float32)
            engine = references[model]
            out_name = engine.info.io.outputs[0].name
            cases.append((model, x, engine.run({"x": x})[out_name]))

    log: list[tuple[str, tuple[int, ...]]] = []

    def recording(model: str) -> Any:
        return lambda: RecordingEngine(
            OnnxRuntimeEngine(locate(model), max_batch=MAX_BATCH), log, model
        )

    fleet = fleet_factory(max_batch=MAX_BATCH, max_wait_s=0.005)
    for i in range(2):
        fleet.add_worker(
            {"orientation": recording("orientation"), "ppocr-cls": recording("ppocr-cls")},
            name=f"w{i}",
        )
    fleet.ready()
    clients = [fleet.client() for _ in range(4)]

    n_requests = 1000
    pending = []
    for i in range(n_requests):
        model, x, expected = cases[(i * 7) % len(cases)]
        client = clients[i % len(clients)]
        pending.append((client.submit(model, {"x": x}, timeout_s=60), expected))

    for future, expected in pending:
        outputs = future.outputs(timeout_s=120)
        (got,) = outputs.values()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)

    stats = clients[0].stats()
    assert stats["replies"] == n_requests
    assert stats["errors"] == {}
    sizes = {int(s) for per_model in stats["batch_sizes"].values() for s in per_model}
    assert max(sizes) <= MAX_BATCH
    assert max(sizes) > 1, f"no batch larger than one formed: {stats['batch_sizes']}"
    total = sum(
        int(size) * count
        for per_model in stats["batch_sizes"].values()
        for size, count in per_model.items()
    )
    n_two_sample = sum(1 for i in range(n_requests) if cases[(i * 7) % len(cases)][1].shape[0] == 2)
    assert total == n_requests + n_two_sample  # every sample dispatched exactly once

    # Engine side: batches never exceed B_max, and both widths of ppocr-cls ran, separately.
    runs = [(m, s) for m, s in log if s[0] <= MAX_BATCH]
    assert len(runs) == len(log), f"a batch exceeded {MAX_BATCH}: {log}"
    widths = {s[3] for m, s in log if m == "ppocr-cls"}
    assert widths == {192, 320}
