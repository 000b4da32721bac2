"""metrics.py: a process's Prometheus endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

A small WSGI server (wsgiref, one daemon thread per request) serves prometheus-client's
exposition of a private :class:`~prometheus_client.CollectorRegistry` (never the global
one: two brokers in one test process must not share figures). The figures belong to the
process's loop thread: a scrape asks the loop for a fresh snapshot through a
:class:`Snapshots` exchange (the loop builds it between two turns, on its own thread)
and waits a bounded time for it, so the HTTP thread never reads state the loop is
changing, and the loop pays nothing while nobody scrapes.

- ``/metrics``: the collectors' families at scrape time, plus host CPU and memory (psutil)
  and prometheus-client's process collector.
- ``/healthz``: 200 while the loop answers a snapshot within ``health_timeout_s`` (the
  process is alive and its loop turns), else 503.
- ``/readyz``: 200 when the latest snapshot says ``ready`` (the broker: sockets bound
  and not stopping; a worker: engines warm and registered with its broker), else 503.
"""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from carpool.common.errors import ConfigError
from carpool.common.listen import SHUTDOWN_POLL_S, parse_listen

logger = logging.getLogger(__name__)

#: How long a scrape or a health check waits for the loop's snapshot.
HEALTH_TIMEOUT_S = 1.0

Snapshot = dict[str, Any]


class Snapshots:
    """A snapshot the loop thread builds when another thread asks for one.

    The asking thread calls :meth:`ask`, which sets a flag, wakes the loop (``wake``) and
    waits; the loop checks :attr:`asked` once a turn (one attribute read) and, when set,
    calls :meth:`publish` with what it built. The latest one stays readable
    (:attr:`latest`) for a scrape that found the loop wedged."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._cond = threading.Condition()
        self._generation = 0
        self.asked = False  # read by the loop thread each turn
        self.latest: Snapshot | None = None

    def ask(self, timeout_s: float = HEALTH_TIMEOUT_S) -> Snapshot | None:
        """A snapshot the loop builds from now on; None if it gave none in ``timeout_s``."""
        with self._cond:
            generation = self._generation
            self.asked = True
        self._wake()
        with self._cond:
            fresh = self._cond.wait_for(lambda: self._generation > generation, timeout_s)
            return self.latest if fresh else None

    def publish(self, snapshot: Snapshot) -> None:
        """(The loop thread.) Hand over what it built for the threads waiting."""
        with self._cond:
            self.latest = snapshot
            self._generation += 1
            self.asked = False
            self._cond.notify_all()


class _Collector:
    """prometheus-client's collector protocol over a function of the fresh snapshot."""

    def __init__(
        self, snapshots: Snapshots, families: Callable[[Snapshot], Iterable[Metric]]
    ) -> None:
        self._snapshots = snapshots
        self._families = families

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshots.ask()
        up = GaugeMetricFamily(
            "carpool_loop_responsive", "1 when the process's loop answered this scrape in time"
        )
        up.add_metric([], 1.0 if snapshot is not None else 0.0)
        yield up
        snapshot = snapshot or self._snapshots.latest  # (a wedged loop: its last figures)
        if snapshot is not None:
            yield from self._families(snapshot)
        yield from host_families()


def gauges(snapshot: Snapshot, rows: Iterable[tuple[str, str, str]]) -> Iterator[Metric]:
    """A gauge per ``(snapshot key, metric name, help)`` row, of that key's value."""
    for key, name, text in rows:
        yield GaugeMetricFamily(name, text, value=float(snapshot[key]))


def host_families() -> Iterator[Metric]:
    """The host's CPU and memory use (psutil)."""
    cpu = GaugeMetricFamily("carpool_host_cpu_percent", "host CPU use since the last scrape")
    cpu.add_metric([], psutil.cpu_percent(interval=None))
    yield cpu
    memory = psutil.virtual_memory()
    used = GaugeMetricFamily("carpool_host_memory_used_bytes", "host memory in use")
    used.add_metric([], float(memory.total - memory.available))
    yield used
    total = GaugeMetricFamily("carpool_host_memory_total_bytes", "host memory")
    total.add_metric([], float(memory.total))
    yield total


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process's exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics %s", format % args)


class MetricsEndpoint:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``address`` (HOST:PORT; port 0: a
    free one, read back from :attr:`port`), served from a daemon thread until
    :meth:`close`.

    Args:
        address: where to listen; a bare ``:PORT`` or ``PORT`` listens on 127.0.0.1.
        snapshots: the loop's snapshot exchange.
        families: the process's metric families, from a fresh snapshot.

    Raises:
        ConfigError: a malformed address, or one that cannot be bound.
    """

    def __init__(
        self,
        address: str,
        snapshots: Snapshots,
        families: Callable[[Snapshot], Iterable[Metric]],
    ) -> None:
        host, port = parse_listen(address)
        self.snapshots = snapshots
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(snapshots, families))
        ProcessCollector(registry=self.registry)
        psutil.cpu_percent(interval=None)  # the first reading only starts the count
        self._metrics_app = make_wsgi_app(self.registry)
        try:
            self._server = make_server(
                host, port, self._app, server_class=_ThreadingServer, handler_class=_QuietHandler
            )
        except OSError as exc:
            raise ConfigError(f"metrics {address}: {exc.strerror or exc}") from None
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(SHUTDOWN_POLL_S,),
            name="carpool-metrics",
            daemon=True,
        )
        self._thread.start()
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _app(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            ok = self.snapshots.ask() is not None
            return _plain(start_response, ok, "ok" if ok else "the loop did not answer")
        if path == "/readyz":
            snapshot = self.snapshots.ask()
            ok = snapshot is not None and bool(snapshot.get("ready"))
            return _plain(start_response, ok, "ready" if ok else "not ready")
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"/metrics, /healthz or /readyz\n"]

    def close(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()

    def __enter__(self) -> MetricsEndpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _plain(start_response: Any, ok: bool, text: str) -> list[bytes]:
    start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
    return [text.encode() + b"\n"]
