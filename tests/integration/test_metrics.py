"""/metrics, /healthz and /readyz of a live broker and worker, over real loopback sockets.

Known traffic goes through a real fleet (broker and worker on threads, ZeroMQ on
127.0.0.1, a synthetic engine); the exposition is scraped over HTTP and parsed with
prometheus_client's own parser, then held against what was sent and against STATS.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool.broker.server import BrokerServer
from carpool.client import Client
from carpool.common.clock import MonotonicClock
from carpool.common.errors import ConfigError, NotFound
from carpool.common.testing import ServerThread
from carpool.worker.config import ModelConfig
from carpool.worker.factory import engine_factory
from carpool.worker.server import WorkerServer
from tests.conftest import loopback_config, wait_for_workers

MODEL = "synthetic"
SENT = 40  # requests of one sample each
MADE_UP = 50  # requests for model names nobody serves


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(url: str) -> dict[str, Any]:
    """Every sample of ``url``/metrics: name → list of (labels, value)."""
    status, text = get(url + "/metrics")
    assert status == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


#: The series names each family type exposes (a family with no sample yet included).
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names(url: str) -> set[str]:
    """Every series name ``url``/metrics declares, whether it has samples yet or not."""
    status, text = get(url + "/metrics")
    assert status == 200
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    (found,) = [v for got, v in samples[name] if all(got.get(k) == w for k, w in labels.items())]
    return float(found)


@pytest.fixture
def fleet() -> Iterator[tuple[BrokerServer, WorkerServer, Client]]:
    config = dataclasses.replace(loopback_config(max_batch=8), metrics="127.0.0.1:0")
    with ServerThread(BrokerServer(config)) as broker:
        model = ModelConfig.synthetic(MODEL, 1.0, 0.1, 8)
        worker = WorkerServer(
            broker.backend_endpoint,
            {MODEL: engine_factory(model)},
            name="w1",
            metrics="127.0.0.1:0",
        )
        with ServerThread(worker), Client(broker.frontend_endpoint) as client:
            wait_for_workers(client, 1)
            yield broker, worker, client


def until(check: Any, timeout_s: float = 10.0) -> None:
    clock, pause = MonotonicClock(), threading.Event()
    end = clock.now() + timeout_s
    while not check():
        assert clock.now() < end, "condition not met in time"
        pause.wait(0.02)  # (nothing to wait on: the worker's first heartbeat from its broker)


@pytest.mark.timeout(60)
def test_scrape_counts_what_was_sent_and_matches_stats(fleet: Any) -> None:
    broker, worker, client = fleet
    assert broker.metrics is not None
    assert worker.metrics is not None
    x = np.ones((1, 16), np.float32)
    # In waves, so that batches of several sizes form.
    for wave in (1, 3, 8, 12, 16):
        futures = [client.submit(MODEL, {"x": x}) for _ in range(wave)]
        for future in futures:
            future.result(10)
    assert SENT == 1 + 3 + 8 + 12 + 16
    for i in range(MADE_UP):
        with pytest.raises(NotFound):
            client.infer(f"made-up-{i}", {"x": x})
    stats = client.stats()
    samples = scrape(broker.metrics.endpoint.url)

    assert value(samples, "carpool_requests_total", model=MODEL, outcome="ok") == SENT
    assert value(samples, "carpool_errors_total", code="not_found") == MADE_UP
    # The batch-size histogram is STATS' batch sizes, bucketed.
    sizes = {int(k): n for k, n in stats["batch_sizes"][MODEL].items()}
    assert sum(size * n for size, n in sizes.items()) == SENT
    assert value(samples, "carpool_batch_size_count", model=MODEL) == sum(sizes.values())
    assert value(samples, "carpool_batch_size_sum", model=MODEL) == SENT
    for le, count in (("1", 1), ("4", 4), ("8", 8), ("+Inf", 1024)):
        expected = sum(n for size, n in sizes.items() if size <= count)
        assert value(samples, "carpool_batch_size_bucket", model=MODEL, le=le) == expected
    # Each answered request is in the latency and queue-wait histograms once.
    for name in ("carpool_request_latency_seconds", "carpool_queue_wait_seconds"):
        assert value(samples, f"{name}_count", model=MODEL) == SENT
    assert value(samples, "carpool_compute_seconds_count", model=MODEL) == sum(sizes.values())
    assert value(samples, "carpool_model_workers", model=MODEL) == 1
    assert value(samples, "carpool_worker_slots", worker="w1") == 2
    assert value(samples, "carpool_loop_responsive") == 1
    assert value(samples, "carpool_host_memory_total_bytes") > 0
    # Made-up names never become labels.
    labelled = {
        labels["model"] for rows in samples.values() for labels, _ in rows if "model" in labels
    }
    assert labelled == {MODEL}

    # The worker ran every batch the broker sent, with the same sizes.
    wsamples = scrape(worker.metrics.endpoint.url)
    assert value(wsamples, "carpool_worker_batches_total", model=MODEL, outcome="ok") == sum(
        sizes.values()
    )
    assert value(wsamples, "carpool_worker_batch_size_sum", model=MODEL) == SENT
    assert value(wsamples, "carpool_worker_ready") == 1
    # The host figures of the worker's latest telemetry sample (§8.2).
    assert value(wsamples, "carpool_worker_host_memory_total_mib") > 0


@pytest.mark.timeout(60)
def test_health_and_readiness(fleet: Any) -> None:
    broker, worker, _ = fleet
    for endpoint in (broker.metrics.endpoint, worker.metrics.endpoint):
        assert endpoint.host == "127.0.0.1"
        assert get(endpoint.url + "/healthz")[0] == 200
        until(lambda e=endpoint: get(e.url + "/readyz")[0] == 200)
        assert get(endpoint.url + "/nothing")[0] == 404


@pytest.mark.timeout(60)
def test_a_flood_of_made_up_names_does_not_grow_the_exposition(fleet: Any) -> None:
    broker, _, client = fleet
    url = broker.metrics.endpoint.url
    x = np.ones((1, 16), np.float32)
    client.infer(MODEL, {"x": x})
    before = {name: len(rows) for name, rows in scrape(url).items()}
    for i in range(300):
        with pytest.raises(NotFound):
            client.infer(f"flood-{i}", {"x": x})
    after = {name: len(rows) for name, rows in scrape(url).items()}
    assert after == before


def test_a_stopped_loop_fails_health_and_a_bad_address_is_refused() -> None:
    config = dataclasses.replace(loopback_config(), metrics="127.0.0.1:0")
    with BrokerServer(config) as broker:  # constructed, sockets bound; nobody runs its loop
        assert broker.metrics is not None
        url = broker.metrics.endpoint.url
        assert get(url + "/healthz")[0] == 503
        assert get(url + "/readyz")[0] == 503
        status, text = get(url + "/metrics")
        assert status == 200
        assert "carpool_loop_responsive 0.0" in text
        port = broker.metrics.endpoint.port
        taken = dataclasses.replace(loopback_config(), metrics=f"127.0.0.1:{port}")
        with pytest.raises(ConfigError, match="metrics"):
            BrokerServer(taken)
    for bad in ("127.0.0.1:http", "1:2:3", "127.0.0.1:70000"):
        with pytest.raises(ConfigError, match="metrics"):
            dataclasses.replace(loopback_config(), metrics=bad)


DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "fleet-dashboard.json"


@pytest.mark.timeout(60)
def test_the_grafana_dashboard_asks_only_for_metrics_the_code_exports(fleet: Any) -> None:
    broker, worker, client = fleet
    client.infer(MODEL, {"x": np.ones((1, 16), np.float32)})
    exported = exported_names(broker.metrics.endpoint.url) | exported_names(
        worker.metrics.endpoint.url
    )
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(dashboard["panels"]) >= 12
    assert all(panel["targets"] for panel in dashboard["panels"])
    asked = {name for expr in exprs for name in re.findall(r"\bcarpool_[a-z0-9_]+", expr)}
    assert asked, "no carpool_ metric in the dashboard"
    assert asked - exported == set()
    # And the dashboard shows what the operators tune from: QPS, p95, batch sizes.
    assert {
        "carpool_requests_total",
        "carpool_request_latency_seconds_bucket",
        "carpool_batch_size_bucket",
        "carpool_worker_rho",
        "carpool_model_b_max",
    } <= asked
