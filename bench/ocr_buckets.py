"""Static padding against shape buckets for cameras of three resolutions, on the real
PP-OCRv4 detector (the table of seed 002: throughput, P99, padded share of compute).

Question: cameras at 640x480, 1280x720 and 1920x1080 send frames to one text detector.
Without shape buckets a fleet batches one shape only, so every frame is padded to the
largest (1088x1920, the 1080p frame rounded up to the model's multiples of 32) and the
map cropped back: static. With buckets the worker pads each frame only to its own
multiples of 32 (480x640, 736x1280, 1088x1920) and batches frames by bucket: dynamic.
How do throughput, tail latency and the share of compute spent on padding compare?

Method: one fleet, a ``carpool broker`` (B_max 4, T_max 5 ms) and two ``carpool worker
--model ppocr-det --threads 1`` processes (ONNX Runtime on the CPU), serves both
configurations, alternating within each round. This process keeps 3 requests in flight
(a closed loop: a new frame as soon as one returns), the three cameras' rendered frames
(``carpool.ocr.render``, 10 text lines each) in turn, for 8 s a configuration (3 s with
--quick). Static pads each frame here, with zeros at the bottom and right, to
1088x1920; dynamic sends it at its own size (the catalogue detector's pad rule pads it
in the worker). Both crop the map back to the frame. Before measuring, one frame of each
camera is read both ways and their boxes compared (``carpool.ocr.detect``). The padded
share of compute is Σ(padded elements) / Σ(elements run): for static computed here from
the frames sent (the 1088x1920 bucket needs no padding in the worker), for dynamic from
the broker's STATS ``buckets`` (two snapshots around each phase, protocol §6.4).
3 rounds (1 with --quick) after a warm-up round; medians; ratios are dynamic / static
per round, then the median.

The recognizer's side, the accuracy cost of bucket padding: the text lines of 3 frames
per camera (1 with --quick; 10 lines of up to 3 words each) are read in this process
(ONNX Runtime, the catalogue's files) at their own width, padded to width buckets of
powers of two, and padded to the catalogue's (every 160 columns up to 960), each padded
with 0.0 on the right and its sequence cropped to ceil(W / 8) as the worker does; the
table gives each one's character error rate (``carpool.ocr.accuracy``) and padded share of compute.

Target: none fixed (seed 002 reports +81% throughput, -15% P99, 38% -> 7% wasted
compute on a GPU); read the ratios.

Run:  .venv/bin/python bench/ocr_buckets.py            (about 2 minutes)
      .venv/bin/python bench/ocr_buckets.py --quick    (under a minute)
Writes bench/out/ocr_buckets.json.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from common import ProcessGroup, median, parser, pct, quiet_logs, table, wait_workers, write_json

from carpool.client import Client, ReplyFuture, RequestError
from carpool.common.padding import PadRule
from carpool.ocr import detect, recognize
from carpool.ocr.accuracy import Score, score_frame
from carpool.ocr.pipeline import OcrSteps
from carpool.ocr.recognize import Charset
from carpool.ocr.render import Frame, render_frame
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.models import locate
from carpool.worker.repository import builtin

MODEL = "ppocr-det"
CAMERAS = ((640, 480), (1280, 720), (1920, 1080))  # (W, H)
STATIC_HW = detect.padded_shape(1080, 1920)  # (1088, 1920)
IN_FLIGHT = 3
FRAMES_PER_CAMERA = 2
WORKERS = 2
CONFIGS = ("static", "dynamic")
COARSE_WIDTHS = (160, 320, 640, 1280, 2560)  # powers of two, against the catalogue's
COARSE_BUCKETS = tuple((3, 48, w) for w in COARSE_WIDTHS)


def frames() -> list[Frame]:
    """The cameras' frames in sending order (camera 0, 1, 2, 0, 1, 2, ...)."""
    rendered = [
        [render_frame(100 * c + i, w, h) for i in range(FRAMES_PER_CAMERA)]
        for c, (w, h) in enumerate(CAMERAS)
    ]
    return [rendered[c][i] for i in range(FRAMES_PER_CAMERA) for c in range(len(CAMERAS))]


def request_input(pixels: Any, config: str) -> Any:
    x = detect.preprocess(pixels)
    return detect.pad_to(x, *STATIC_HW) if config == "static" else x


def bucket_sums(client: Client) -> dict[str, tuple[int, int, int, int]]:
    """The detector's STATS buckets: label -> (batches, samples, padded, elements)."""
    buckets = (client.stats().get("buckets") or {}).get(MODEL, {})
    return {
        label: (b["batches"], b["samples"], b["padded_elements"], b["bucket_elements"])
        for label, b in buckets.items()
    }


def phase(
    client: Client, shown: Sequence[Frame], inputs: Sequence[Any], config: str, duration_s: float
) -> dict[str, Any]:
    """A closed loop of IN_FLIGHT requests over ``inputs`` in turn for ``duration_s``."""
    before = bucket_sums(client)
    own = padded_here = 0
    latencies: list[float] = []
    in_flight: dict[ReplyFuture, float] = {}
    errors = 0
    sent = 0

    def send() -> None:
        nonlocal sent
        x = inputs[sent % len(inputs)]
        in_flight[client.submit(MODEL, {"x": x}, 60.0)] = time.perf_counter()
        sent += 1

    start = time.perf_counter()
    for _ in range(IN_FLIGHT):
        send()
    completed = 0
    while in_flight:
        client.poll(1.0)
        for future in [f for f in in_flight if f.done()]:
            sent_at = in_flight.pop(future)
            try:
                future.result(0)
            except RequestError as exc:
                errors += 1
                print(f"  {config}: {type(exc).__name__}: {exc}")
                continue
            latencies.append(time.perf_counter() - sent_at)
            completed += 1
            if time.perf_counter() - start < duration_s:
                send()
    wall = time.perf_counter() - start
    for f in (shown[i % len(shown)] for i in range(sent)):
        own += f.height_px * f.width_px
        padded_here += STATIC_HW[0] * STATIC_HW[1] if config == "static" else 0
    after = bucket_sums(client)
    delta = {
        label: tuple(
            a - b for a, b in zip(after[label], before.get(label, (0, 0, 0, 0)), strict=True)
        )
        for label in after
    }
    padded = sum(d[2] for d in delta.values())
    elements = sum(d[3] for d in delta.values())
    if config == "static":  # every request is already its bucket's shape: padded here
        share = (padded_here - own) / padded_here if padded_here else float("nan")
    else:
        share = padded / elements if elements else float("nan")
    return {
        "completed": completed,
        "errors": errors,
        "rate": completed / wall,
        "p50_ms": 1000 * pct(latencies, 50),
        "p99_ms": 1000 * pct(latencies, 99),
        "padded_share": share,
        "buckets": {label: {"batches": d[0], "samples": d[1]} for label, d in delta.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    quiet_logs()
    reps = args.reps or (1 if args.quick else 3)
    duration_s = 3.0 if args.quick else 8.0
    shown = frames()
    inputs = {c: [request_input(f.pixels, c) for f in shown] for c in CONFIGS}
    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    with ProcessGroup(args.transport) as group:
        frontend, backend = group.endpoint("front"), group.endpoint("back")
        # The watchdog's prediction is one fitted cost for all of a model's buckets: a
        # 1088x1920 batch after 480x640 ones runs far past it (a false "unhealthy").
        group.broker(
            frontend,
            backend,
            *("--max-batch", "4", "--max-wait-ms", "5"),
            config={"watchdog_slack_s": 60.0},
        )
        for _ in range(WORKERS):
            group.worker(backend, "--model", MODEL, "--threads", "1", "--max-batch", "4")
        wait_workers(frontend, WORKERS, group)
        with Client(frontend) as client:
            agree = check_boxes(client, shown, inputs)
            print(f"static vs dynamic, one frame per camera: {agree}")
            for rnd in range(reps + 1):  # round 0 is the warm-up
                for config in CONFIGS if rnd % 2 else reversed(CONFIGS):
                    result = phase(
                        client, shown, inputs[config], config, duration_s if rnd else 2.0
                    )
                    if rnd:
                        rounds[config].append(result)
                if rnd:
                    print(f"round {rnd}/{reps} done")

    rec_rows = recognizer_padding(1 if args.quick else 3)
    metrics = ("rate", "p50_ms", "p99_ms", "padded_share")
    med = {c: {m: median([r[m] for r in rounds[c]]) for m in metrics} for c in CONFIGS}
    ratio = {
        m: median([d[m] / s[m] for s, d in zip(rounds["static"], rounds["dynamic"], strict=True)])
        for m in ("rate", "p50_ms", "p99_ms")
    }
    rows: list[list[object]] = [
        ["throughput (frames/s)", med["static"]["rate"], med["dynamic"]["rate"], ratio["rate"]],
        ["P50 latency (ms)", med["static"]["p50_ms"], med["dynamic"]["p50_ms"], ratio["p50_ms"]],
        ["P99 latency (ms)", med["static"]["p99_ms"], med["dynamic"]["p99_ms"], ratio["p99_ms"]],
        [
            "padded share of compute",
            f"{100 * med['static']['padded_share']:.1f}%",
            f"{100 * med['dynamic']['padded_share']:.1f}%",
            "-",
        ],
    ]
    print(
        f"\nPP-OCRv4 detector, cameras {', '.join(f'{w}x{h}' for w, h in CAMERAS)} in turn, "
        f"{IN_FLIGHT} in flight, {WORKERS} CPU workers (1 thread each), {args.transport}; "
        f"median of {reps} rounds of {duration_s:g} s"
    )
    print(table(["metric", "static (pad to 1088x1920)", "dynamic (buckets)", "× static"], rows))
    last = rounds["dynamic"][-1]["buckets"]
    print(
        "dynamic, last round, batches per bucket: "
        + ", ".join(
            f"{label} {b['batches']} ({b['samples']} frames)" for label, b in sorted(last.items())
        )
    )
    print(
        "\nPP-OCRv4 recognizer, the cameras' text lines (10 a frame, up to 3 words) at their own"
        " width, padded to width buckets of powers of two "
        f"({', '.join(str(w) for w in COARSE_WIDTHS)}), and to the catalogue's, in process;"
        " CER / padded share"
    )
    print(
        table(
            ["camera", "lines", "own width", "power-of-two buckets", "catalogue buckets"],
            [
                [
                    r["camera"],
                    r["lines"],
                    *(
                        f"{100 * r[m]['cer']:.1f}% / {100 * r[m]['padded_share']:.0f}%"
                        for m in ("own", "coarse", "catalogue")
                    ),
                ]
                for r in rec_rows
            ],
        )
    )
    write_json(
        "ocr_buckets",
        {
            "rounds": rounds,
            "medians": med,
            "ratios": ratio,
            "boxes": agree,
            "recognizer": rec_rows,
            "quick": args.quick,
        },
    )
    return 0 if all(r["errors"] == 0 for c in CONFIGS for r in rounds[c]) else 1


def recognizer_padding(frames_per_camera: int) -> list[dict[str, Any]]:
    """CER and padded share of the recognizer's compute per camera, for lines read at
    their own width, in power-of-two width buckets and in the catalogue's (padded
    with 0.0 on the right and the sequence cropped to ceil(W / 8), as the worker does)."""
    det = OnnxRuntimeEngine(locate(MODEL))
    rec = OnnxRuntimeEngine(locate("ppocr-rec"))
    steps = OcrSteps(Charset.from_metadata(rec.metadata))
    catalogue = builtin().models["ppocr-rec"].config.inputs["x"].pad
    assert catalogue is not None
    rules = {"own": None, "coarse": PadRule(buckets=COARSE_BUCKETS), "catalogue": catalogue}
    rows = []
    for c, (w, h) in enumerate(CAMERAS):
        scores = dict.fromkeys(rules, Score())
        padded = dict.fromkeys(rules, 0)
        total = dict.fromkeys(rules, 0)
        for i in range(frames_per_camera):
            frame = render_frame(100 * c + i, w, h)
            prob = det.run({"x": steps.detector_input(frame.pixels)})[detect.OUTPUT]
            boxes = steps.boxes(frame.pixels, prob)
            lines = [recognize.line_input(frame.pixels, b) for b in boxes]
            for name, rule in rules.items():
                read = []
                for box, x in zip(boxes, lines, strict=True):
                    width = x.shape[3]
                    bucket = width if rule is None else (rule.bucket(x.shape[1:]) or (0, 0, 0))[2]
                    padded[name] += 3 * 48 * (bucket - width)
                    total[name] += 3 * 48 * bucket
                    y = np.zeros((1, 3, 48, bucket), dtype=np.float32)
                    y[..., :width] = x
                    out = rec.run({"x": y})[recognize.OUTPUT][:, : -(-width // 8)]
                    read.append((box, steps.text(out)[0]))
                scores[name] += score_frame(frame.lines, read)
        rows.append(
            {
                "camera": f"{w}x{h}",
                "lines": scores["own"].lines,
                **{
                    name: {"cer": scores[name].cer, "padded_share": padded[name] / total[name]}
                    for name in rules
                },
            }
        )
    return rows


def check_boxes(client: Client, shown: Sequence[Frame], inputs: dict[str, list[Any]]) -> str:
    """Read the first frame of each camera both ways: boxes found, and the largest
    difference of a box corner between the two (px), or a count mismatch."""
    notes = []
    for k in range(len(CAMERAS)):
        frame = shown[k]
        got = []
        for config in CONFIGS:
            prob = client.infer(MODEL, {"x": inputs[config][k]}, timeout_s=60.0)[detect.OUTPUT]
            h, w = frame.height_px, frame.width_px
            got.append([(b.x0, b.y0, b.x1, b.y1) for b in detect.boxes(prob[0, 0, :h, :w])])
        size = f"{frame.width_px}x{frame.height_px}"
        if len(got[0]) != len(got[1]):
            notes.append(f"{size}: {len(got[0])} vs {len(got[1])} boxes")
            continue
        pairs = zip(*got, strict=True)
        diff = max((abs(a - b) for p, q in pairs for a, b in zip(p, q, strict=True)), default=0)
        notes.append(f"{size}: {len(got[0])} boxes, corners within {diff} px")
    return "; ".join(notes)


if __name__ == "__main__":
    raise SystemExit(main())
