"""demo.py: ``carpool demo --scenario ocr``: cameras of three resolutions reading text.

A broker and CPU workers (each serving the PP-OCRv4 detector and recognizer) run as
subprocesses on ``ipc://`` endpoints, as in :mod:`carpool.demo`. Cameras at 640x480,
1280x720 and 1920x1080 (camera ``k`` has the ``k mod 3``-th) send, open loop, one
rendered frame each every ``1/fps`` seconds to the detector, at their own size: the
fleet pads each frame to multiples of 32 and batches frames by bucket. As each frame's
probability map comes back, its boxes are cut out and sent to the recognizer at their
own widths, which the fleet pads into width buckets. At the end the demo prints the
requests per second, latency percentiles per model and per frame, the batches and the
padded share of compute per bucket (from the broker's STATS), and the character error
rate of the text read against the text rendered.
"""

from __future__ import annotations

import subprocess
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carpool.client import Client, ReplyFuture, RequestError
from carpool.common.errors import ConfigError
from carpool.demo import (
    DemoSettings,
    final_stats,
    none_exited,
    run_fleet,
    start_fleet,
    wait_ready,
)
from carpool.ocr import detect, recognize
from carpool.ocr.accuracy import Score, score_frame
from carpool.ocr.pipeline import DETECTOR, RECOGNIZER, DetectorPad, OcrSteps, load_charset
from carpool.ocr.render import Frame, render_frame

RESOLUTIONS = ((640, 480), (1280, 720), (1920, 1080))  # (W, H), camera k has k mod 3
LINES = 6  # text lines per frame
FRAMES_PER_CAMERA = 2  # distinct frames each camera cycles through
MAX_CER = 0.05  # the exit status says whether the text was read this well
REQUEST_TIMEOUT_S = 30.0  # a 1080p frame alone costs ~0.5 s on a CPU: room for queues
WATCHDOG_SLACK_S = 30.0  # the broker's watchdog_slack_s (below)


@dataclass(slots=True)
class _Shot:
    """One frame sent: when, what it shows, and what has come back for it so far."""

    camera: int
    frame: Frame
    sent_s: float
    read: list[tuple[detect.Box, str]] = field(default_factory=list)
    pending: int = -1  # recognizer replies still awaited; -1 before the detector's


@dataclass(slots=True)
class _Tally:
    sent: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    scores: dict[str, Score] = field(default_factory=lambda: defaultdict(Score))
    first_send_s: float = 0.0
    last_reply_s: float = 0.0


def run_ocr_demo(settings: DemoSettings) -> int:
    """Run the OCR fleet and cameras; print a report.

    Returns:
        0 if every request got a reply and the CER is at most 5%, else 1; 130 after
        Ctrl-C, 143 after SIGTERM (the processes started are stopped either way).

    Raises:
        ConfigError: an argument is out of range, Pillow or the model wheel is missing.
    """
    settings.check()
    duration_s, cameras, fps = settings.duration_s, settings.cameras, settings.fps
    workers, max_batch, max_wait_ms = settings.workers, settings.max_batch, settings.max_wait_ms
    from carpool.worker.models import locate

    try:
        steps = OcrSteps(load_charset(locate(RECOGNIZER)), DetectorPad.FLEET)
        shots = [
            [
                render_frame(1000 * camera + i, *RESOLUTIONS[camera % 3], lines=LINES)
                for i in range(FRAMES_PER_CAMERA)
            ]
            for camera in range(cameras)
        ]
    except ImportError as exc:
        raise ConfigError(str(exc)) from None

    def fleet(tmp: Path, procs: dict[str, subprocess.Popen[bytes]]) -> int:
        sizes = ", ".join(f"{w}x{h}" for w, h in RESOLUTIONS[: min(cameras, 3)])
        print(
            f"carpool demo (ocr): {cameras} cameras ({sizes}) x {fps:g} fps for "
            f"{duration_s:g} s; {workers} CPU workers serving {DETECTOR} and "
            f"{RECOGNIZER}; B_max {max_batch}, T_max {max_wait_ms:g} ms",
            flush=True,
        )
        # The engine watchdog predicts a batch's time from one fitted cost per model,
        # for all its buckets: a 1080p batch after 480p ones runs far past it. A long
        # slack keeps it from marking busy workers unhealthy.
        config = tmp / "broker.toml"
        config.write_text(f"watchdog_slack_s = {WATCHDOG_SLACK_S}\n")
        frontend = start_fleet(
            procs,
            tmp,
            workers,
            (
                "--config",
                str(config),
                "--max-batch",
                str(max_batch),
                "--max-wait-ms",
                str(max_wait_ms),
            ),
            ("--model", DETECTOR, "--model", RECOGNIZER, "--max-batch", str(max_batch)),
        )
        with Client(frontend, default_timeout_s=REQUEST_TIMEOUT_S) as client:
            ready_s = wait_ready(client, procs, workers)
            print(f"fleet ready in {ready_s:.1f} s; cameras rolling", flush=True)
            tally = _run_cameras(client, steps, shots, duration_s, fps)
            stats = final_stats(client)
        total = _report(tally, stats)
        ok = tally.replies == tally.sent and not tally.errors
        return 0 if none_exited(procs) and ok and total.cer <= MAX_CER else 1

    return run_fleet(fleet)


def _run_cameras(
    client: Client,
    steps: OcrSteps,
    shots: list[list[Frame]],
    duration_s: float,
    fps: float,
) -> _Tally:
    """Send frames open loop at every tick; as replies come, send lines, score frames."""
    clock = client.clock
    tally = _Tally()
    # future -> (model, when sent, the shot it belongs to, which of its boxes)
    in_flight: dict[ReplyFuture, tuple[str, float, _Shot, int]] = {}

    def send(model: str, x: Any, shot: _Shot, line: int = -1) -> None:
        future = client.submit(model, {"x": x}, REQUEST_TIMEOUT_S)
        in_flight[future] = (model, clock.now(), shot, line)
        tally.sent[model] += 1

    def finish(shot: _Shot, now: float) -> None:
        tally.latency_ms["frame"].append((now - shot.sent_s) * 1000)
        size = f"{shot.frame.width_px}x{shot.frame.height_px}"
        tally.scores[size] += score_frame(shot.frame.lines, shot.read)

    def collect() -> None:
        now = clock.now()
        for future in [f for f in in_flight if f.done()]:
            model, sent_s, shot, line = in_flight.pop(future)
            try:
                output = future.result(0).outputs
            except RequestError as exc:
                tally.errors[f"{model} {type(exc).__name__}"] += 1
                continue
            tally.replies[model] += 1
            tally.last_reply_s = now
            tally.latency_ms[model].append((now - sent_s) * 1000)
            if model == DETECTOR:
                boxes = steps.boxes(shot.frame.pixels, output[detect.OUTPUT])
                shot.pending = len(boxes)
                shot.read = [(box, "") for box in boxes]
                for k, box in enumerate(boxes):
                    send(RECOGNIZER, recognize.line_input(shot.frame.pixels, box), shot, k)
            else:
                shot.read[line] = (shot.read[line][0], steps.text(output[recognize.OUTPUT])[0])
                shot.pending -= 1
            if shot.pending == 0:
                finish(shot, now)

    period_s = 1.0 / fps
    ticks = max(1, round(duration_s * fps))
    start_s = tally.first_send_s = clock.now()
    for tick in range(ticks):
        due_s = start_s + tick * period_s
        while (left_s := due_s - clock.now()) > 0:
            if client.poll(left_s):
                collect()
        for camera, frames in enumerate(shots):
            frame = frames[tick % len(frames)]
            send(DETECTOR, steps.detector_input(frame.pixels), _Shot(camera, frame, clock.now()))
    # Every future completes by its local deadline (timeout + grace) at the latest; lines
    # sent late get theirs from when they were sent.
    until = clock.now() + 2 * (REQUEST_TIMEOUT_S + client.core.grace_s) + 1.0
    while in_flight and clock.now() < until:
        if client.poll(min(1.0, until - clock.now())):
            collect()
    for model, *_ in in_flight.values():
        tally.errors[f"{model} NoReply"] += 1
    return tally


def _report(tally: _Tally, stats: dict[str, Any]) -> Score:
    """Print the report; returns the score over every frame read."""
    errors = ", ".join(f"{k} {v}" for k, v in sorted(tally.errors.items())) or "none"
    elapsed_s = tally.last_reply_s - tally.first_send_s
    replies = sum(tally.replies.values())
    lines = [
        f"requests sent:     {sum(tally.sent.values())} ("
        + ", ".join(f"{m} {n}" for m, n in sorted(tally.sent.items()))
        + ")",
        f"replies:           {replies}",
        f"errors:            {errors}",
        f"achieved QPS:      {replies / elapsed_s if elapsed_s > 0 else 0.0:.1f}",
    ]
    for what in (DETECTOR, RECOGNIZER, "frame"):
        got = tally.latency_ms.get(what)
        if got:
            p50, p95, p99 = np.percentile(got, [50, 95, 99])
            lines.append(f"latency ms ({what}): p50 {p50:.0f}  p95 {p95:.0f}  p99 {p99:.0f}")
    for model, sizes in sorted((stats.get("batch_sizes") or {}).items()):
        counts = {int(size): int(n) for size, n in sizes.items()}
        shown = ", ".join(f"{n} of {size}" for size, n in sorted(counts.items()))
        lines.append(f"batches ({model}): {sum(counts.values())}: {shown}")
    for model, labels in sorted((stats.get("buckets") or {}).items()):
        lines.extend(
            f"bucket ({model} {label}): {b['batches']} batches, {b['samples']} samples, "
            f"padded share of compute {100.0 * float(b['padded_share']):.1f}%"
            for label, b in sorted(labels.items(), key=lambda kv: _elements(kv[0]))
        )
    total = Score()
    for size, score in sorted(tally.scores.items(), key=lambda kv: _elements(kv[0])):
        total += score
        lines.append(
            f"text read ({size}): {score.lines} lines, {score.exact} exact, "
            f"CER {100.0 * score.cer:.1f}%"
        )
    lines.append(f"text read (all):   {total.lines} lines, CER {100.0 * total.cer:.1f}%")
    print("\n".join(lines), flush=True)
    return total


def _elements(label: str) -> int:
    """A bucket or frame label's element count (``3x736x1280`` -> 2826240), for order."""
    try:
        return int(np.prod([int(d) for d in label.split("x")]))
    except ValueError:
        return 0
