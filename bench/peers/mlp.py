"""mlp.py: the peers harness's benchmark model, an ONNX MLP [N,3,64,64] float32 -> [N,10].

Flatten, MatMul+Add, Relu, MatMul+Add, with seeded numpy weights and a dynamic batch
dimension. The hidden width (:data:`HIDDEN`) is chosen so that, on one ONNX Runtime
thread of the 2-core development machine, batch 1 costs about 1.0 ms and batch 16 about
3 ms: a model where batching pays (16 samples for about 3x one) and the fleet's own
per-batch cost is not lost in the noise. The file is written once under bench/out/ and
reused while its width matches.

Run:  .venv/bin/python bench/peers/mlp.py [--hidden H] [--batches 1,4,8,16]
      writes the model (when missing) and prints its measured time per batch size
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "out"
#: The hidden width: measured to give about 1.0 ms at batch 1 and 3 ms at batch 16.
HIDDEN = 576
ITEM_SHAPE = (3, 64, 64)
OUTPUTS = 10
INPUT_NAME = "x"
OUTPUT_NAME = "y"
SEED = 30


def model_path(hidden: int = HIDDEN) -> Path:
    """Where the model of width ``hidden`` is cached."""
    return OUT / f"peers-mlp-{hidden}.onnx"


def build(hidden: int = HIDDEN) -> bytes:
    """The serialised ONNX model of width ``hidden`` (deterministic for a width)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    features = int(np.prod(ITEM_SHAPE))
    rng = np.random.default_rng(SEED)
    scale1, scale2 = 1.0 / np.sqrt(features), 1.0 / np.sqrt(hidden)
    weights = {
        "w1": (rng.standard_normal((features, hidden)) * scale1).astype(np.float32),
        "b1": (rng.standard_normal(hidden) * 0.01).astype(np.float32),
        "w2": (rng.standard_normal((hidden, OUTPUTS)) * scale2).astype(np.float32),
        "b2": (rng.standard_normal(OUTPUTS) * 0.01).astype(np.float32),
    }
    nodes = [
        helper.make_node("Flatten", [INPUT_NAME], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["h1b"]),
        helper.make_node("Relu", ["h1b"], ["h1r"]),
        helper.make_node("MatMul", ["h1r", "w2"], ["h2"]),
        helper.make_node("Add", ["h2", "b2"], [OUTPUT_NAME]),
    ]
    graph = helper.make_graph(
        nodes,
        "peers_mlp",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", *ITEM_SHAPE])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", OUTPUTS])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def ensure(hidden: int = HIDDEN) -> Path:
    """The model file of width ``hidden``, written if it is not there yet."""
    path = model_path(hidden)
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(build(hidden))
        tmp.replace(path)
    return path


def runner(path: Path, threads: int = 1) -> object:
    """An ONNX Runtime inference session on ``threads`` intra-op threads (CPU)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def measure(path: Path, batches: Sequence[int], reps: int = 200) -> dict[int, float]:
    """Median milliseconds per run at each batch size, one thread."""
    engine = runner(path)
    out: dict[int, float] = {}
    rng = np.random.default_rng(0)
    for b in batches:
        x = rng.standard_normal((b, *ITEM_SHAPE)).astype(np.float32)
        for _ in range(20):
            engine.run(None, {INPUT_NAME: x})  # type: ignore[attr-defined]
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            engine.run(None, {INPUT_NAME: x})  # type: ignore[attr-defined]
            times.append(time.perf_counter() - t0)
        out[b] = statistics.median(times) * 1000
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden width (default {HIDDEN})")
    p.add_argument("--batches", default="1,2,4,8,16", help="batch sizes to time")
    args = p.parse_args(argv)
    path = ensure(args.hidden)
    times = measure(path, [int(b) for b in args.batches.split(",")])
    print(f"{path} (hidden {args.hidden}), one ONNX Runtime thread, median of 200:")
    for b, ms in times.items():
        print(f"  batch {b:3d}: {ms:6.3f} ms  ({ms / b:.3f} ms per sample)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
