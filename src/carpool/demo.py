"""demo.py: ``carpool demo`` — a broker, CPU workers and cameras sending real pages.

The broker and the workers run as real subprocesses (``python -m carpool ...``) on
``ipc://`` endpoints in a temporary directory. A camera-like client then sends, for
``duration_s`` seconds, one frame per camera every ``1/fps`` seconds, all cameras at the
same tick, open loop: each send happens at its scheduled time whatever the replies do.
A frame is a page of text rendered with Pillow and rotated by 0/90/180/270°, and the
page-orientation model must tell the rotation back. At the end the demo prints what
happened (latency percentiles, batch sizes, worker load, correct rotations) and stops
every process it started.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from carpool.common.clock import MonotonicClock
from carpool.common.config import check, signs
from carpool.common.errors import ConfigError

if TYPE_CHECKING:  # (the client loads when the demo runs, not with carpool's parser)
    from carpool.client import Client, ReplyFuture

MODEL = "orientation"
INPUT = "x"
OUTPUT = "fetch_name_0"
PAGES = 8  # distinct pages, each sent in 4 rotations
REQUEST_TIMEOUT_S = 2.0  # deadline of each frame
READY_TIMEOUT_S = 60.0  # broker up and every worker registered (model loaded) within this
STOP_TIMEOUT_S = 10.0  # after SIGTERM, before SIGKILL
_CHILD_LOG_LEVEL = "WARNING"  # keep the children's INFO lines out of the demo's report


class DemoError(Exception):
    """The demo could not run (a process died, the fleet never became ready)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One pre-rendered camera frame and the orientation class it should get."""

    pixels: NDArray[np.float32]
    angle_deg: int
    label: int


@dataclass(slots=True)
class Tally:
    """What the camera client saw."""

    sent: int = 0
    replies: int = 0
    correct: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    first_send_s: float = 0.0
    last_reply_s: float = 0.0


def render_frames(pages: int = PAGES) -> list[Frame]:
    """Render ``pages`` pages in every rotation, preprocessed for the orientation model."""
    from carpool.pages import ANGLES_DEG, expected_label, preprocess, render_page

    rendered = [render_page(seed) for seed in range(pages)]
    return [
        Frame(preprocess(page.rotate(angle)), angle, expected_label(angle))
        for page in rendered
        for angle in ANGLES_DEG
    ]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """What ``carpool demo`` runs (each scenario its own defaults: ``carpool demo --help``).

    Args:
        duration_s: how long the cameras send.
        cameras: cameras sending in step.
        fps: frames per second per camera.
        workers: CPU worker processes to start.
        max_batch: the broker's B_max (and the workers' largest batch).
        max_wait_ms: the broker's T_max.
    """

    duration_s: float = 10.0
    cameras: int = 4
    fps: float = 10.0
    workers: int = 2
    max_batch: int = 8
    max_wait_ms: float = 5.0

    def check(self) -> None:
        """Raise :class:`ConfigError` naming each setting out of its range."""
        positive = ("duration_s", "cameras", "fps", "workers", "max_batch")
        problems = signs(self, positive=positive, non_negative=("max_wait_ms",))
        check(problems, "demo")


def run_demo(settings: DemoSettings) -> int:
    """Run the demo fleet and cameras; print a report.

    Returns:
        0 if every request got a reply and every rotation was classified correctly, else 1;
        130 after Ctrl-C, 143 after SIGTERM (the processes started are stopped either way).

    Raises:
        ConfigError: an argument is out of range, or Pillow is not installed.
    """
    from carpool.client import Client

    settings.check()
    duration_s, cameras, fps = settings.duration_s, settings.cameras, settings.fps
    workers, max_batch, max_wait_ms = settings.workers, settings.max_batch, settings.max_wait_ms
    try:
        frames = render_frames()
    except ImportError as exc:
        raise ConfigError(str(exc)) from None

    def fleet(tmp: Path, procs: dict[str, subprocess.Popen[bytes]]) -> int:
        print(
            f"carpool demo: {cameras} cameras x {fps:g} fps for {duration_s:g} s; "
            f"{workers} CPU workers; B_max {max_batch}, T_max {max_wait_ms:g} ms",
            flush=True,
        )
        frontend = start_fleet(
            procs,
            tmp,
            workers,
            ("--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms)),
            ("--model", MODEL, "--max-batch", str(max_batch)),
        )
        with Client(frontend, default_timeout_s=REQUEST_TIMEOUT_S) as client:
            ready_s = wait_ready(client, procs, workers)
            print(f"fleet ready in {ready_s:.1f} s; cameras rolling", flush=True)
            tally = _run_cameras(client, frames, duration_s, cameras, fps)
            stats = final_stats(client)
        _report(tally, stats)
        ok = tally.replies == tally.sent and tally.correct == tally.sent
        return 0 if none_exited(procs) and ok else 1

    return run_fleet(fleet)


def run_fleet(body: Callable[[Path, dict[str, subprocess.Popen[bytes]]], int]) -> int:
    """Run ``body(tmp, procs)`` in a temporary folder, and stop every process it put in
    ``procs`` at the end, whatever happens: a :class:`DemoError` is exit code 1, Ctrl-C
    130 and SIGTERM 143 (each said on stderr)."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="carpool-demo-") as tmp:
        try:
            return body(Path(tmp), procs)
        except DemoError as exc:
            print(f"carpool demo: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("carpool demo: interrupted", file=sys.stderr)
            return 130
        except Terminated:
            print("carpool demo: terminated", file=sys.stderr)
            return 143
        finally:
            stop(procs)


def start_fleet(
    procs: dict[str, subprocess.Popen[bytes]],
    tmp: Path,
    workers: int,
    broker_args: Sequence[str],
    worker_args: Sequence[str],
) -> str:
    """Start a broker on ipc endpoints in ``tmp`` and ``workers`` workers (``cpu-0``,
    ...) with these extra arguments, into ``procs``; returns the frontend."""
    frontend, backend = f"ipc://{tmp / 'frontend'}", f"ipc://{tmp / 'backend'}"
    procs["broker"] = spawn("broker", "--frontend", frontend, "--backend", backend, *broker_args)
    for i in range(workers):
        procs[f"cpu-{i}"] = spawn("worker", "--broker", backend, "--name", f"cpu-{i}", *worker_args)
    return frontend


def final_stats(client: Client) -> dict[str, Any]:
    """The broker's STATS after the run ({} when it does not answer, said on stderr)."""
    try:
        return client.stats(timeout_s=2.0)
    except TimeoutError:
        print("carpool demo: no STATS reply from the broker", file=sys.stderr)
        return {}


def none_exited(procs: dict[str, subprocess.Popen[bytes]]) -> bool:
    """No process of the fleet has exited (those that have are said on stderr)."""
    dead = exited(procs)
    if dead:
        print(f"carpool demo: exited early: {dead}", file=sys.stderr)
    return not dead


class Terminated(Exception):
    """SIGTERM arrived: unwind so that the children are stopped too."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (main thread only: elsewhere
    signal handlers cannot be set, and the block leaves SIGTERM as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def spawn(*args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "carpool", "--log-level", _CHILD_LOG_LEVEL, *args]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL)


def exited(procs: dict[str, subprocess.Popen[bytes]]) -> str:
    """The processes that have exited, as ``name (code N)``, comma-separated."""
    return ", ".join(
        f"{name} (code {proc.returncode})"
        for name, proc in procs.items()
        if proc.poll() is not None
    )


def wait_ready(client: Client, procs: dict[str, subprocess.Popen[bytes]], workers: int) -> float:
    """Wait until the broker answers STATS with ``workers`` live workers; returns the
    seconds it took."""
    clock = client.clock
    start_s = clock.now()
    until = start_s + READY_TIMEOUT_S
    while clock.now() < until:
        dead = exited(procs)
        if dead:
            raise DemoError(f"exited early: {dead}")
        try:
            if len(client.stats(timeout_s=1.0)["workers"]) >= workers:
                return clock.now() - start_s
        except TimeoutError:
            continue  # the broker is still starting
        client.poll(0.05)
    raise DemoError(f"the broker did not report {workers} workers within {READY_TIMEOUT_S:g} s")


def _run_cameras(
    client: Client, frames: list[Frame], duration_s: float, cameras: int, fps: float
) -> Tally:
    """Send frames open loop at every tick; collect replies between ticks."""
    from carpool.client import RequestError

    clock = client.clock
    tally = Tally()
    in_flight: list[tuple[ReplyFuture, float, Frame]] = []

    def collect() -> None:
        now = clock.now()
        still = []
        for future, sent_s, frame in in_flight:
            if not future.done():
                still.append((future, sent_s, frame))
                continue
            try:
                outputs = future.result(0).outputs
            except RequestError as exc:
                tally.errors[type(exc).__name__] += 1
                continue
            tally.replies += 1
            tally.last_reply_s = now
            tally.latencies_ms.append((now - sent_s) * 1000)
            tally.correct += int(np.argmax(outputs[OUTPUT][0])) == frame.label
        in_flight[:] = still

    period_s = 1.0 / fps
    ticks = max(1, round(duration_s * fps))
    start_s = clock.now()
    tally.first_send_s = start_s
    for tick in range(ticks):
        due_s = start_s + tick * period_s
        while (left_s := due_s - clock.now()) > 0:
            if client.poll(left_s):
                collect()
        for camera in range(cameras):
            frame = frames[(tick * cameras + camera) % len(frames)]
            sent_s = clock.now()
            future = client.submit(MODEL, {INPUT: frame.pixels}, REQUEST_TIMEOUT_S)
            in_flight.append((future, sent_s, frame))
            tally.sent += 1
    # Every future completes by its local deadline (timeout + grace) at the latest.
    until = clock.now() + REQUEST_TIMEOUT_S + client.core.grace_s + 1.0
    while in_flight and clock.now() < until:
        if client.poll(until - clock.now()):
            collect()
    for _ in in_flight:
        tally.errors["NoReply"] += 1
    return tally


def _report(tally: Tally, stats: dict[str, Any]) -> None:
    errors = ", ".join(f"{k} {v}" for k, v in sorted(tally.errors.items())) or "none"
    elapsed_s = tally.last_reply_s - tally.first_send_s
    qps = tally.replies / elapsed_s if elapsed_s > 0 else 0.0
    lines = [
        f"requests sent:     {tally.sent}",
        f"replies:           {tally.replies}",
        f"errors:            {errors}",
        f"achieved QPS:      {qps:.1f}",
    ]
    if tally.latencies_ms:
        p50, p95, p99 = np.percentile(tally.latencies_ms, [50, 95, 99])
        lines.append(f"latency ms:        p50 {p50:.1f}  p95 {p95:.1f}  p99 {p99:.1f}")
    else:
        lines.append("latency ms:        p50 -  p95 -  p99 -  (no replies)")
    batch_sizes = stats.get("batch_sizes") or {}
    if not batch_sizes:
        lines.append("batch sizes:       none reported")
    for model, sizes in sorted(batch_sizes.items()):
        counts = {int(size): int(n) for size, n in sizes.items()}
        batches = sum(counts.values())
        mean = sum(s * n for s, n in counts.items()) / batches if batches else 0.0
        lines.append(f"batch sizes ({model}): {batches} batches, mean size {mean:.2f}")
        lines.extend(
            f"  size {size:>3}: {n:>6} batches ({100.0 * n / batches:5.1f}%)"
            for size, n in sorted(counts.items())
        )
    for model, labels in sorted((stats.get("buckets") or {}).items()):
        lines.extend(  # a padded model's buckets (protocol §8.1)
            f"bucket ({model} {label}): {b['batches']} batches, {b['samples']} samples, "
            f"padded share of compute {100.0 * float(b['padded_share']):.1f}%"
            for label, b in sorted(labels.items())
        )
    rhos = ", ".join(
        f"{w['name']} {float(w['rho']):.2f}"
        for w in sorted(stats.get("workers", []), key=lambda w: str(w["name"]))
    )
    lines.append(f"worker rho:        {rhos or 'no workers'}")
    for w in sorted(stats.get("workers", []), key=lambda w: str(w["name"])):
        for model, lane in sorted(w.get("lanes", {}).items()):
            fitted = "fitted" if lane["calibrated"] else "not yet fitted"
            lines.append(
                f"batch cost ({w['name']}, {model}): {lane['fixed_cost_ms']:.1f} ms + "
                f"{lane['per_sample_ms']:.1f} ms x B ({fitted}); B_max now {lane['b_max']}"
            )
    lanes = [lane for w in stats.get("workers", []) for lane in w.get("lanes", {}).values()]
    if lanes and not any(lane["calibrated"] for lane in lanes):
        lines.append(
            "  (one batch size seen so far: no evidence that waiting pays, so batches leave"
            " at once)"
        )
    elif any(lane["calibrated"] and lane["fixed_cost_ms"] < 0.5 for lane in lanes):
        lines.append(
            "  (on a CPU the fixed cost is ~0: waiting for a fuller batch buys nothing, so"
            " batches leave at once)"
        )
    share = 100.0 * tally.correct / tally.sent if tally.sent else 0.0
    lines.append(f"correct rotations: {tally.correct}/{tally.sent} ({share:.1f}%)")
    print("\n".join(lines), flush=True)


def stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM the processes (workers before the broker), wait, then SIGKILL stragglers."""
    clock = MonotonicClock()
    ordered = list(reversed(procs.items()))
    for _, proc in ordered:
        if proc.poll() is None:
            proc.terminate()
    until = clock.now() + STOP_TIMEOUT_S
    for name, proc in ordered:
        _reap(name, proc, until - clock.now())


def _reap(name: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait for a process to exit; kill it if it is still running after ``timeout_s``."""
    try:
        proc.wait(timeout=max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        print(
            f"carpool demo: {name} did not stop within {STOP_TIMEOUT_S:g} s of SIGTERM; "
            "its threads' stacks follow (SIGUSR1), then it is killed",
            file=sys.stderr,
            flush=True,
        )
        proc.send_signal(signal.SIGUSR1)  # carpool's commands dump their stacks on it
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        proc.kill()
        proc.wait()
