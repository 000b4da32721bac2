"""What does padding a frame to a larger bucket cost the PP-OCRv4 detector in accuracy?

Question: the fleet pads each request into its bucket and crops the answer back (protocol
§8.1). With the minimal padding the detector needs (H and W to multiples of 32) every
frame runs at nearly its own size; with coarser buckets (one bucket for a camera mix:
every frame padded to the largest, 1920 x 1088) a small frame runs inside a large field
of padding. Does the cropped probability map change, and by how much?

Method: for cameras at 640 x 480, 1280 x 720 and 1920 x 1080, a seeded frame of dark
text lines (Pillow's default font, scaled up) on a light, slightly noisy background,
some lines at the right and bottom edges, normalised as RapidOCR does ((x / 255 - 0.5)
/ 0.5). Each frame runs on ONNX Runtime (CPU, one thread) twice, alone: padded minimally
(``PadRule(multiple_of=[1, 32, 32])``, the catalogue's rule) and padded to 1920 x 1088,
both with zeros at the bottom and right, then cropped back to the frame. Reported per
resolution: the largest absolute difference of the two probability maps, the share of
pixels whose text / background call at DB's threshold 0.3 differs, and the IoU of the two
text masks (1.0: the same text found).

Target: none fixed; read it as the accuracy side of the padded share of compute that
STATS reports (a mask IoU near 1 says the coarse bucket costs compute, not accuracy).

Run:  .venv/bin/python bench/bucket_accuracy.py          (about half a minute)
      .venv/bin/python bench/bucket_accuracy.py --quick  (640 x 480 and 1280 x 720 only)
Writes bench/out/bucket_accuracy.json.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from common import parser, quiet_logs, table, write_json
from numpy.typing import NDArray

from carpool.common.padding import PadRule
from carpool.worker.models import locate
from carpool.worker.repository import builtin

CAMERAS = [(480, 640), (720, 1280), (1080, 1920)]
LARGEST = (1088, 1920)
THRESHOLD = 0.3  # DB post-processing's binarisation threshold (RapidOCR's default)


def text_frame(h: int, w: int, seed: int) -> NDArray[np.float32]:
    """A [1, 3, h, w] normalised frame of seeded dark text lines on a light background."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    small = Image.new("L", (w // 2, h // 2), 225)
    draw = ImageDraw.Draw(small)
    letters = "ABCDEFGHJKLMNPRSTUVWXYZ0123456789"
    for i in range(8):
        text = "".join(rng.choice(list(letters), size=int(rng.integers(4, 12))))
        x = int(rng.integers(0, max(1, w // 2 - 40)))
        y = int(rng.integers(0, max(1, h // 2 - 8)))
        if i < 2:  # near the right and bottom edges
            x, y = w // 2 - 30, h // 2 - 9
        draw.text((x, y), text, fill=int(rng.integers(0, 60)))
    gray = np.asarray(small.resize((w, h)), dtype=np.float32)
    gray = gray + rng.normal(0, 4, gray.shape).astype(np.float32)
    rgb = np.clip(np.stack([gray] * 3), 0, 255)
    return ((rgb / 255.0 - 0.5) / 0.5)[None].astype(np.float32)


def padded(x: NDArray[np.float32], bucket: Sequence[int]) -> NDArray[np.float32]:
    h, w = x.shape[2:]
    return np.pad(x, ((0, 0), (0, 0), (0, bucket[0] - h), (0, bucket[1] - w)))


def measure(cameras: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    det = ort.InferenceSession(
        str(locate("ppocr-det")), sess_options=options, providers=["CPUExecutionProvider"]
    )
    (name,) = (o.name for o in det.get_outputs())
    rule = builtin().models["ppocr-det"].config.inputs["x"].pad
    assert rule == PadRule(multiple_of=(1, 32, 32))
    rows = []
    for seed, (h, w) in enumerate(cameras):
        x = text_frame(h, w, seed)
        minimal = rule.bucket(x.shape[1:])
        assert minimal is not None
        (near,) = det.run([name], {"x": padded(x, minimal[1:])})
        (far,) = det.run([name], {"x": padded(x, LARGEST)})
        a, b = near[0, 0, :h, :w], far[0, 0, :h, :w]
        mask_a, mask_b = a > THRESHOLD, b > THRESHOLD
        union = int(np.sum(mask_a | mask_b))
        rows.append(
            {
                "camera": f"{w}x{h}",
                "minimal_bucket": f"{minimal[2]}x{minimal[1]}",
                "coarse_bucket": f"{LARGEST[1]}x{LARGEST[0]}",
                "padded_share_minimal": 1 - h * w / (minimal[1] * minimal[2]),
                "padded_share_coarse": 1 - h * w / (LARGEST[0] * LARGEST[1]),
                "max_abs_diff": float(np.max(np.abs(a - b))),
                "pixels_flipped": float(np.mean(mask_a != mask_b)),
                "text_pixels": float(np.mean(mask_a)),
                "mask_iou": 1.0 if union == 0 else float(np.sum(mask_a & mask_b)) / union,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    quiet_logs()
    rows = measure(CAMERAS[:2] if args.quick else CAMERAS)
    headers = ["camera", "minimal", "padded", "coarse", "padded", "max |diff|", "flipped", "IoU"]
    print(
        table(
            headers,
            [
                [
                    r["camera"],
                    r["minimal_bucket"],
                    f"{100 * r['padded_share_minimal']:.1f}%",
                    r["coarse_bucket"],
                    f"{100 * r['padded_share_coarse']:.1f}%",
                    f"{r['max_abs_diff']:.2g}",
                    f"{100 * r['pixels_flipped']:.3f}%",
                    f"{r['mask_iou']:.4f}",
                ]
                for r in rows
            ],
        )
    )
    write_json("bucket_accuracy", {"threshold": THRESHOLD, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
