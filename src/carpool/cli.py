"""cli.py: the ``carpool`` command — broker, worker, demo, simulate and tune.

The only module that reads ``argv`` and the environment. Settings load in this order:
TOML file (``--config``), then ``CARPOOL_*`` environment variables, then flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from carpool import __version__
from carpool.commandline import (
    METRICS_COMMANDS,
    add_batching_flags,
    add_command,
    add_metrics_flag,
)
from carpool.common.errors import ConfigError
from carpool.common.logs import configure
from carpool.common.memory import tune_allocator
from carpool.common.sdnotify import SdNotifier
from carpool.curvecmd import add_broker_flags, add_worker_flags
from carpool.curvecmd import add_parsers as add_keygen_parsers
from carpool.roles import broker_config, check_environment, embedded_workers, worker_config

__all__ = ["build_parser", "main", "worker_config"]

logger = logging.getLogger("carpool")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@contextlib.contextmanager
def _stopped_by_signals(stop: Any, wakeup_fd: int = -1) -> Iterator[None]:
    """SIGTERM and SIGINT call ``stop`` (in the main thread); SIGUSR1 dumps the stacks.

    ``wakeup_fd`` (the server's ``signal_fd``) is written by the signal's C handler on
    whichever thread the kernel gave the signal to: a thread that does not block it (numpy's
    OpenBLAS threads do not) may take it, and then the main thread, blocked in its poll,
    would run the Python handler only when the poll ends (never, while idle: the broker
    would ignore SIGTERM). The poll watches that descriptor. Restored on exit, before the
    server closes it."""
    _stop_on_signals(stop)
    previous = signal.set_wakeup_fd(wakeup_fd, warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)


def _stop_on_signals(stop: Any) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        # Stop first: the handler runs between two bytecodes of whatever the main thread
        # was doing, and a log line can fail there (a reentrant write to a stderr that
        # was mid-write); the stop must not depend on it.
        stop()
        logger.info("signal %s: stopping", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # SIGUSR1 writes every thread's Python stack to stderr (the journal, under systemd)
    # and the process goes on: what a broker or worker that will not stop is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # SIGABRT (systemd's watchdog kill), SIGSEGV and the like: the stacks, then the end.
    faulthandler.enable(all_threads=True)


def _check_writable(path: str, what: str) -> None:
    """Fail now, with one line, where opening ``path`` to append would fail later."""
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write {what} {path}: {exc.strerror}") from None


def _check_environment() -> None:
    """Stop (ConfigError) at a ``CARPOOL_*`` variable meant as a setting that is none;
    one WARNING line for each other unknown ``CARPOOL_*`` name (a user's own)."""
    for name in check_environment(os.environ):
        logger.warning("%s: not a carpool setting, nor near one: ignored", name)


# ---------------------------------------------------------------------- broker


def _broker(args: argparse.Namespace) -> int:
    """run a broker"""
    from carpool.broker.notify import broker_watch
    from carpool.broker.server import BrokerFault, BrokerServer

    _check_environment()
    config = broker_config(args, os.environ)
    record = getattr(args, "record", None)
    if record:
        _check_writable(record, "trace")
    tune_allocator()  # large tensor frames reuse heap memory (carpool.common.memory)
    with contextlib.ExitStack() as stack:
        notifier = stack.enter_context(contextlib.closing(SdNotifier()))
        embedded = [stack.enter_context(w) for w in embedded_workers(args)]
        server = stack.enter_context(BrokerServer(config, record=record, embedded=embedded))
        # SIGHUP reads the CURVE allow-lists again (revocation without a restart).
        signal.signal(signal.SIGHUP, lambda signum, frame: server.ask_reload())
        with _stopped_by_signals(server.stop, server.signal_fd):
            try:
                server.serve(broker_watch(server.core, server.clock, notifier))
            except BrokerFault:
                return 1  # (logged with its traceback): systemd restarts it (on-failure)
    return 0


def _record(args: argparse.Namespace) -> int:
    """run a broker that records its arrivals as a trace (for tune and replay)

    A broker that appends every arriving request (time, model, shape, timeout, priority,
    the engines' batch limit) to a JSON-lines trace, for carpool tune and carpool replay;
    those refused at the door for overload are recorded too (the load offered).
    """
    return _broker(args)


# ---------------------------------------------------------------------- worker


def _worker(args: argparse.Namespace) -> int:
    """run a worker

    A worker: runs the batches the broker sends it. Settings come from --config, then
    CARPOOL_WORKER_* variables, then --set KEY=VALUE, then these flags. The models it
    serves are those of --model and --synthetic together, or, when neither is given, the
    [[models]] of --config, else every model of --repository (or the repository of
    --config), else the built-in model orientation. --max-batch and --threads apply to
    every model served, including those of --config.
    """
    from carpool.worker.factory import worker_server
    from carpool.worker.notify import start_extension, worker_watch

    _check_environment()
    config = worker_config(args, os.environ)
    tune_allocator()
    with contextlib.closing(SdNotifier()) as notifier:
        notifier.send(STATUS=f"loading {len(config.models)} models")
        starting = start_extension(notifier, len(config.models), config.start_timeout_s)
        with (
            worker_server(config, starting=starting) as server,
            _stopped_by_signals(server.stop, server.signal_fd),
        ):
            server.serve(worker_watch(server, notifier, config.hung_batch_s))
    return 0


# ---------------------------------------------------------------------- demo


#: ``carpool demo``'s flags, by the :class:`~carpool.demo.DemoSettings` field each sets.
_DEMO_FLAGS: dict[str, str] = {
    "duration_s": "how long the cameras send",
    "cameras": "cameras sending in step",
    "fps": "frames per second per camera",
    "workers": "CPU workers to start",
    "max_batch": "broker B_max",
    "max_wait_ms": "broker T_max",
}
#: Where ``--scenario ocr`` has defaults of its own: a 1080p frame costs the detector
#: about half a second on a CPU, so fewer frames, for a few seconds.
_OCR_DEMO_DEFAULTS: dict[str, float] = {"duration_s": 4.0, "cameras": 3, "fps": 0.5}


def _demo(args: argparse.Namespace) -> int:
    """run a broker, two CPU workers and a camera client"""
    from carpool.demo import DemoSettings

    # A misspelt setting stops the demo here rather than each child it starts; the
    # children (same environment) warn of the other names themselves.
    check_environment(os.environ)
    ocr = args.scenario == "ocr"
    values: dict[str, Any] = dict(_OCR_DEMO_DEFAULTS) if ocr else {}
    values.update({k: getattr(args, k) for k in _DEMO_FLAGS if getattr(args, k) is not None})
    settings = DemoSettings(**values)
    if ocr:
        from carpool.ocr.demo import run_ocr_demo

        return run_ocr_demo(settings)
    from carpool.demo import run_demo

    return run_demo(settings)


# ---------------------------------------------------------------------- parser


def _broker_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--config", help="broker TOML file")
    b.add_argument("--frontend", help="endpoint for clients (default tcp://127.0.0.1:5555)")
    b.add_argument("--backend", help="endpoint for workers (default tcp://127.0.0.1:5556)")
    b.add_argument(
        "--local",
        metavar="unix:PATH",
        help="also take workers on this host on a unix socket (cheaper hops than ZeroMQ)",
    )
    add_batching_flags(b)
    add_broker_flags(b)
    _set_arg(b, "broker.toml", "batching.max_wait_s=0.004")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="carpool", description="ZeroMQ inference fleet with dynamic batching"
    )
    parser.add_argument("--version", action="version", version=f"carpool {__version__}")
    _log_level_arg(parser, default=os.environ.get("CARPOOL_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    b = add_command(sub, "broker", _broker)
    _broker_args(b)
    b.add_argument("--record", help="append every arriving request to this JSON-lines trace")
    e = b.add_argument_group(
        "embedded worker",
        "a worker inside the broker's process: no hops between them, short batches run on "
        "the broker's thread; an engine failure can take the broker down with it",
    )
    e.add_argument("--embed-model", action="append", help="catalogue model (repeatable)")
    _cost_flag(
        e,
        "--embed-synthetic",
        "a synthetic engine (model 'synthetic') costing FIXED_MS + PER_SAMPLE_MS * B",
    )
    e.add_argument("--embed-max-batch", type=int, help="largest batch of --embed-* models")
    e.add_argument("--embed-config", help="worker TOML file (its models, slots, shm settings)")

    rec = add_command(sub, "record", _record)
    _broker_args(rec)
    rec.add_argument("--record", "--out", dest="record", required=True, help="trace file")

    w = add_command(sub, "worker", _worker)
    w.add_argument("--config", help="worker TOML file")
    w.add_argument(
        "--broker",
        help="broker backend endpoint (default tcp://127.0.0.1:5556), or its --local unix:PATH",
    )
    w.add_argument("--name", help="worker name in logs and STATS (default HOST-PID)")
    w.add_argument("--slots", type=int, help="batches outstanding at most")
    w.add_argument(
        "--repository",
        metavar="DIR",
        help="a model repository (docs/models.md): serve every model in it, or those "
        "named by --model",
    )
    w.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help="model to serve (repeatable): a model of --repository, a built-in model "
        "(orientation, ppocr-cls, ppocr-det, ppocr-rec), an ONNX file (served under the "
        "file's name without .onnx), or NAME=FILE.onnx",
    )
    _cost_flag(
        w,
        "--synthetic",
        "also serve a synthetic engine whose batch costs FIXED_MS + PER_SAMPLE_MS * B",
    )
    w.add_argument("--synthetic-name", help="model name of --synthetic (default synthetic)")
    w.add_argument(
        "--max-batch",
        type=int,
        help="largest batch of every model served (default: what its engine takes, so "
        "the broker's --max-batch binds; max_batch of --config's models)",
    )
    w.add_argument(
        "--threads",
        type=int,
        help="ONNX Runtime intra-op threads of every model served (default 1, or "
        "intra_op_threads of --config's models)",
    )

    add_worker_flags(w)
    _set_arg(w, "worker.toml", "hung_batch_s=300")
    add_keygen_parsers(sub)

    d = add_command(sub, "demo", _demo)
    d.add_argument(
        "--scenario",
        choices=("orientation", "ocr"),
        default="orientation",
        help="orientation: pages in four rotations to the orientation model (default); "
        "ocr: cameras at 640x480, 1280x720 and 1920x1080 to the text detector, their "
        "lines to the recognizer",
    )
    from carpool.demo import DemoSettings

    for field in dataclasses.fields(DemoSettings):
        default, ocr = field.default, _OCR_DEMO_DEFAULTS.get(field.name)
        shown = f"{default:g}" + ("" if ocr is None else f"; ocr {ocr:g}")
        kind = int if isinstance(default, int) else float
        text = _DEMO_FLAGS[field.name]
        d.add_argument(
            "--" + field.name.replace("_", "-"), type=kind, default=None, help=f"{text} ({shown})"
        )

    from carpool.benchcmd import add_parsers as add_bench_parsers
    from carpool.modelscmd import add_parsers as add_models_parsers
    from carpool.ops import add_parsers as add_ops_parsers
    from carpool.sim.commands import add_parsers as add_sim_parsers
    from carpool.up.command import add_parsers as add_up_parsers
    from carpool.worker.tensorrt.command import add_parsers as add_build_engine_parsers

    add_sim_parsers(sub)
    add_bench_parsers(sub)
    add_models_parsers(sub)
    add_build_engine_parsers(sub)
    add_ops_parsers(sub)
    add_up_parsers(sub)
    for name in METRICS_COMMANDS:  # (the one table carpool up reads too)
        add_metrics_flag(sub.choices[name])
    # --log-level after the command too (carpool tune --log-level DEBUG); SUPPRESS keeps a
    # command that was not given it from overwriting the value before it (or the env's).
    for command in sub.choices.values():
        _log_level_arg(command, default=argparse.SUPPRESS)
    return parser


def _set_arg(parser: argparse.ArgumentParser, file: str, example: str) -> None:
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help=f"any setting of {file}, dotted as in TOML (--set {example}); over the file "
        "and the environment, under the flags above (repeatable)",
    )


def _cost_flag(parser: Any, flag: str, text: str) -> None:
    """A synthetic engine's batch cost, FIXED_MS and PER_SAMPLE_MS (``ModelConfig.synthetic``)."""
    parser.add_argument(flag, nargs=2, type=float, metavar=("FIXED_MS", "PER_SAMPLE_MS"), help=text)


def _log_level_arg(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help="log level (default INFO, or CARPOOL_LOG_LEVEL)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # argparse checks choices of flags, not defaults
        parser.error(
            f"CARPOOL_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {args.log_level!r}"
        )
    configure(args.log_level)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"carpool: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
