"""command.py: ``carpool up`` — a broker and N workers under one supervisor, and the page.

The parser (:func:`add_parsers`), the checks of its flags, and the wiring: a
:class:`~carpool.up.processes.FleetRunner` on the main thread (SIGTERM and SIGINT stop it;
SIGCHLD wakes it), and with ``--page`` a :class:`~carpool.up.page.PageServer`, a
:class:`~carpool.up.feed.StatsPoller` and, with ``--traffic``, the built-in clients.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import secrets
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from carpool.commandline import METRICS_COMMANDS, add_batching_flags, add_command
from carpool.common.curve import check_private, load_keypair
from carpool.common.errors import ConfigError
from carpool.curvecmd import add_broker_flags
from carpool.roles import check_environment
from carpool.up.plan import FleetPlan
from carpool.up.processes import FleetRunner
from carpool.up.supervisor import RestartPolicy, Supervisor

if TYPE_CHECKING:  # (the client, the page and the traffic load when the fleet starts)
    from carpool.client import Client
    from carpool.up.traffic import Traffic, TrafficPlan

__all__ = ["add_parsers", "child_args"]

#: ``carpool up`` flag -> ``carpool broker`` flag, passed on when given.
_BROKER_FLAGS = {
    "broker_config": "--config",
    "max_batch": "--max-batch",
    "max_wait_ms": "--max-wait-ms",
    "policy": "--policy",
    "curve_server_key": "--curve-server-key",
    "curve_clients": "--curve-clients",
    "curve_workers": "--curve-workers",
    "curve_operators": "--curve-operators",
}
#: ``carpool up`` flag -> ``carpool worker`` flag, passed on when given.
_WORKER_FLAGS = {
    "worker_config": "--config",
    "repository": "--repository",
    "synthetic_name": "--synthetic-name",
    "worker_max_batch": "--max-batch",
    "threads": "--threads",
    "slots": "--slots",
    "curve_worker_key": "--curve-key",
}


def _given(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    return [
        part
        for dest, flag in flags.items()
        if getattr(args, dest) is not None
        for part in (flag, str(getattr(args, dest)))
    ]


def child_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The extra ``carpool broker`` and ``carpool worker`` arguments of ``carpool up ARGS``."""
    broker = _given(args, _BROKER_FLAGS) + (["--curve"] if args.curve else [])
    worker = _given(args, _WORKER_FLAGS)
    for model in args.model or ():
        worker += ["--model", model]
    if args.synthetic:
        worker += ["--synthetic", *(f"{v:g}" for v in args.synthetic)]
    if args.curve_worker_key is not None:
        if not args.curve_server_key:
            raise ConfigError("--curve-worker-key needs --curve-server-key (the broker's pair)")
        public = load_keypair(args.curve_server_key, "--curve-server-key").public.decode()
        # (A public key: fine on a command line. Joined by "=": a Z85 key may begin with
        # "-", which argparse would take for a flag.)
        worker.append(f"--curve-broker-key={public}")
    return broker, worker


def _page_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--page {text!r}: HOST:PORT is needed, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def _page_token(args: argparse.Namespace, host: str) -> str:
    """The page's token: from ``--page-token-file`` (mode 0600), else a new random one;
    a page bound to anything but loopback must have the operator's own."""
    from carpool.up.page import is_loopback

    if args.page_token_file is None:
        if not is_loopback(host):
            raise ConfigError(
                f"--page {host}: a page bound to anything but loopback needs "
                "--page-token-file FILE (a token of the operator's own, mode 0600)"
            )
        return secrets.token_urlsafe(24)
    path = Path(args.page_token_file)
    check_private(path)
    token = path.read_text(encoding="utf-8").strip()
    if len(token) < 16:
        raise ConfigError(f"--page-token-file {path}: the token must be 16 characters or more")
    return token


def _traffic_plan(args: argparse.Namespace) -> TrafficPlan | None:
    if args.traffic is None:
        return None
    from carpool.up.traffic import KNOWN_SHAPES, TrafficPlan

    if not args.traffic > 0:
        raise ConfigError(f"--traffic must be > 0 requests per second, got {args.traffic:g}")
    model = args.traffic_model or (
        (args.model or [None])[0]
        or (args.synthetic_name or "synthetic" if args.synthetic else "orientation")
    )
    if args.traffic_shape:
        try:
            shape = tuple(int(d) for d in args.traffic_shape.split(","))
        except ValueError:
            shape = ()
        if not shape or any(d < 1 for d in shape):
            raise ConfigError(f"--traffic-shape {args.traffic_shape!r}: e.g. 1,3,224,224")
    elif model in KNOWN_SHAPES:
        shape = KNOWN_SHAPES[model]
    else:
        raise ConfigError(f"--traffic to model {model!r} needs --traffic-shape (e.g. 1,16)")
    return TrafficPlan(args.traffic, model, shape, timeout_ms=args.traffic_timeout_ms)


def _client(args: argparse.Namespace) -> Client:
    """A client of the fleet's frontend (its CURVE keys with ``--curve``)."""
    from carpool.client import Client

    keys: dict[str, Any] = {}
    if args.curve:
        if not args.curve_client_key or not args.curve_server_key:
            raise ConfigError(
                "--page and --traffic with --curve need --curve-client-key (a key of "
                "the broker's operators allow-list: STATS is answered to operators only)"
            )
        public = load_keypair(args.curve_server_key, "--curve-server-key").public.decode()
        keys = {"curve_server_key": public, "curve_key": args.curve_client_key}
    return Client(args.frontend, grace_s=1.0, send_timeout_s=0.0, **keys)


@contextlib.contextmanager
def _signals(runner: FleetRunner) -> Iterator[None]:
    """SIGTERM and SIGINT stop the fleet; a child's exit (SIGCHLD) wakes the runner."""

    def stop(signum: int, frame: FrameType | None) -> None:
        runner.request_stop()

    def child(signum: int, frame: FrameType | None) -> None:
        pass  # (the wake-up descriptor is what the runner watches)

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)}
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGCHLD, child)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    previous = signal.set_wakeup_fd(runner.wake.write_fd, warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class _Board:
    """The page's figures: the feed (fed by the poller thread) behind a lock."""

    def __init__(self, runner: FleetRunner, max_workers: int, traffic: Traffic | None) -> None:
        from carpool.up.feed import FleetFeed

        self.runner = runner
        self.max_workers = max_workers
        self.traffic = traffic
        self.feed = FleetFeed()
        self._lock = threading.Lock()
        self._traffic_started = False

    def on_stats(self, stats: dict[str, Any] | None) -> None:
        with self._lock:
            self.feed.on_stats(self.runner.clock.now(), stats)
        # The built-in clients start once a worker serves: no NOT_FOUND flood at start.
        if self.traffic and stats and stats.get("workers") and not self._traffic_started:
            self._traffic_started = True
            self.traffic.start()

    def view(self) -> dict[str, Any]:
        latencies = self.traffic.latencies_ms() if self.traffic else []
        figures = self.traffic.figures() if self.traffic else None
        status = self.runner.status()
        with self._lock:
            return self.feed.view(status, latencies, figures, self.max_workers)

    def scale(self, workers: int) -> str | None:
        if not 1 <= workers <= self.max_workers:
            return f"workers must be in 1..{self.max_workers}, got {workers}"
        if self.runner.status().stopping:
            return "the fleet is stopping"
        self.runner.request_scale(workers)
        return None


def _up(args: argparse.Namespace) -> int:
    """run a broker and N workers under one supervisor (and the live fleet page)

    A broker and --workers local workers as separate processes (carpool broker, carpool
    worker), as on a single Jetson: a worker that exits is started again (backoff 0.5 s
    doubling to 30 s; given up after 5 quick exits in a row); SIGTERM or Ctrl-C drains
    the workers, then the broker (SIGKILL after --stop-timeout-s). With --page
    HOST:PORT, the live fleet page (docs/fleet-page.md): its URL, with the token that
    changing the fleet needs, is printed at start.
    """
    from carpool.up.feed import StatsPoller
    from carpool.up.page import PageServer
    from carpool.up.traffic import Traffic

    # A misspelt setting stops carpool up here, not its children one restart after
    # another; the children (same environment) warn of the other names themselves.
    check_environment(os.environ)
    problems = []
    if not 1 <= args.max_workers <= 256:
        problems.append(f"--max-workers must be in 1..256, got {args.max_workers}")
    if not 1 <= args.workers <= args.max_workers:
        problems.append(f"--workers must be in 1..{args.max_workers}, got {args.workers}")
    broker_args, worker_args = child_args(args)
    plan = FleetPlan(
        args.frontend,
        args.backend,
        tuple(broker_args),
        tuple(worker_args),
        metrics_base=args.metrics_base,
        metrics_flag=METRICS_COMMANDS,
        log_level=args.log_level,
    )
    problems += plan.check(args.max_workers)
    if problems:
        raise ConfigError("up: " + "; ".join(problems))
    try:
        policy = RestartPolicy(stop_timeout_s=args.stop_timeout_s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    traffic_plan = _traffic_plan(args)
    runner = FleetRunner(plan, Supervisor(args.workers, policy))
    with contextlib.ExitStack() as stack:
        stack.callback(runner.close)
        if args.page is not None:
            host, port = _page_address(args.page)
            token = _page_token(args, host)
            traffic = Traffic(_client(args), traffic_plan) if traffic_plan else None
            if traffic is not None:
                stack.callback(traffic.stop)
            board = _Board(runner, args.max_workers, traffic)
            try:
                page = PageServer(host, port, token, board.view, board.scale)
            except OSError as exc:
                raise ConfigError(f"--page {args.page}: cannot listen: {exc.strerror}") from None
            stack.callback(page.close)
            poller = StatsPoller(_client(args), board.on_stats)
            stack.callback(poller.stop)
            page.start()
            poller.start()
            shown = "#token=" + token if args.page_token_file is None else ""
            print(f"carpool up: fleet page {page.url}{shown}", flush=True)
        elif traffic_plan is not None:
            raise ConfigError("--traffic feeds the page: it needs --page HOST:PORT")
        print(
            f"carpool up: broker at {args.frontend} and {args.workers} workers; "
            "SIGTERM or Ctrl-C stops them",
            flush=True,
        )
        with _signals(runner):
            return runner.run()


def add_parsers(sub: Any) -> None:
    u = add_command(sub, "up", _up)
    u.add_argument("--workers", type=int, default=1, help="workers to start (default 1)")
    u.add_argument(
        "--max-workers", type=int, default=16, help="the most the page may ask for (default 16)"
    )
    u.add_argument(
        "--frontend", default="tcp://127.0.0.1:5555", help="endpoint for clients (%(default)s)"
    )
    u.add_argument(
        "--backend", default="tcp://127.0.0.1:5556", help="endpoint for workers (%(default)s)"
    )
    u.add_argument("--stop-timeout-s", type=float, default=10.0, help="SIGTERM to SIGKILL")
    u.add_argument(
        "--metrics-base",
        type=int,
        metavar="PORT",
        help="metrics listeners on 127.0.0.1: the broker on PORT, worker k on PORT+1+k",
    )
    b = u.add_argument_group("broker", "passed to carpool broker")
    b.add_argument("--broker-config", metavar="FILE", help="broker TOML file")
    add_batching_flags(b)
    add_broker_flags(u)
    c = u.add_argument_group("CURVE keys of the workers and of the page's clients")
    c.add_argument("--curve-worker-key", metavar="FILE", help="the workers' .key_secret")
    c.add_argument(
        "--curve-client-key", metavar="FILE", help="the page's and traffic's .key_secret"
    )
    w = u.add_argument_group("workers", "passed to every carpool worker")
    w.add_argument("--worker-config", metavar="FILE", help="worker TOML file")
    w.add_argument("--repository", metavar="DIR", help="a model repository")
    w.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help="model to serve (repeatable; default: orientation), as carpool worker --model",
    )
    w.add_argument(
        "--synthetic",
        nargs=2,
        type=float,
        metavar=("FIXED_MS", "PER_SAMPLE_MS"),
        help="also serve a synthetic engine whose batch costs FIXED_MS + PER_SAMPLE_MS * B",
    )
    w.add_argument("--synthetic-name", help="model name of --synthetic (default synthetic)")
    w.add_argument("--worker-max-batch", type=int, help="each worker's largest batch")
    w.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads per worker")
    w.add_argument("--slots", type=int, help="batches outstanding per worker at most")
    p = u.add_argument_group("fleet page")
    p.add_argument("--page", metavar="HOST:PORT", help="serve the live fleet page here")
    p.add_argument("--page-token-file", metavar="FILE", help="the page's token (mode 0600)")
    p.add_argument("--traffic", type=float, metavar="RATE", help="built-in clients: req/s")
    p.add_argument("--traffic-model", help="their model (default: the first served)")
    p.add_argument("--traffic-shape", help="their request shape, e.g. 1,16")
    p.add_argument("--traffic-timeout-ms", type=int, default=1000, help="their deadline")
