"""A user's own ONNX models (README "Your own ONNX model"): small models built here with
``onnx.helper``, run by ONNX Runtime in real workers.

What users bring that the catalogue's models never exercise: outputs that are not per
sample (a transposed [D, N], batch 1 baked in, a softmax across the batch), inputs a model
refuses for some values (an index out of range), names longer than the protocol allows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.client import InvalidArgument
from carpool.common.errors import ConfigError
from carpool.common.shape_rules import ShapeRule
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.server import WorkerServer
from carpool.worker.warmup import warm_up

onnx = pytest.importorskip("onnx")
helper = onnx.helper
F32, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64


def save(
    path: Path,
    nodes: list[Any],
    inputs: list[Any],
    outputs: list[Any],
    initializers: tuple[Any, ...] = (),
) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # read by every onnxruntime carpool supports
    onnx.save(model, str(path))
    return path


def value(name: str, elem: int, shape: list[Any] | None) -> Any:
    return helper.make_tensor_value_info(name, elem, shape)


def const(name: str, array: np.ndarray[Any, Any]) -> Any:
    return onnx.numpy_helper.from_array(array, name)


# --------------------------------------------------------------------------- models


def transposed(tmp: Path) -> OnnxRuntimeEngine:
    """y = x^T: [D, N], its dim 0 is not the batch."""
    path = save(
        tmp / "t.onnx",
        [helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])],
        [value("x", F32, ["batch", "d"])],
        [value("y", F32, ["d", "batch"])],
    )
    return OnnxRuntimeEngine(path, shape_rules={"x": ShapeRule(min_shape=(1, 2))})


def first_sample_only(tmp: Path) -> OnnxRuntimeEngine:
    """y = x[:1], with the end computed (so ONNX Runtime cannot tell its dim 0 at load):
    a graph with batch 1 baked in, [1, 4] whatever the batch."""
    path = save(
        tmp / "first.onnx",
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Slice", ["shape", "zero", "one"], ["n"]),
            helper.make_node("Sub", ["n", "n"], ["none"]),
            helper.make_node("Add", ["none", "one"], ["end"]),
            helper.make_node("Slice", ["x", "zero", "end", "zero"], ["y"]),
        ],
        [value("x", F32, ["batch", 4])],
        [value("y", F32, ["batch", 4])],
        (const("zero", np.array([0], np.int64)), const("one", np.array([1], np.int64))),
    )
    return OnnxRuntimeEngine(path)


def softmax_across_the_batch(tmp: Path) -> OnnxRuntimeEngine:
    """The README's caveat: one softmax over the whole batch, reshaped back to [batch, 4].
    One sample alone is right; samples batched together change each other's outputs."""
    path = save(
        tmp / "softmax.onnx",
        [
            helper.make_node("Reshape", ["x", "flat"], ["f"]),
            helper.make_node("Softmax", ["f"], ["s"], axis=1),
            helper.make_node("Reshape", ["s", "rows"], ["y"]),
        ],
        [value("x", F32, ["batch", 4])],
        [value("y", F32, ["batch", 4])],
        (const("flat", np.array([1, -1], np.int64)), const("rows", np.array([-1, 4], np.int64))),
    )
    return OnnxRuntimeEngine(path)


def softmax_across_the_batch_beside_an_inf(tmp: Path) -> OnnxRuntimeEngine:
    """The softmax across the batch next to a column of -inf (log 0): an infinite value
    must not make the check's tolerance infinite and let the model pass."""
    path = save(
        tmp / "softmax-inf.onnx",
        [
            helper.make_node("Reshape", ["x", "flat"], ["f"]),
            helper.make_node("Softmax", ["f"], ["s"], axis=1),
            helper.make_node("Reshape", ["s", "rows"], ["soft"]),
            helper.make_node("Sub", ["x", "x"], ["zero"]),
            helper.make_node("Log", ["zero"], ["minf"]),
            helper.make_node("Concat", ["soft", "minf"], ["y"], axis=1),
        ],
        [value("x", F32, ["batch", 4])],
        [value("y", F32, ["batch", 8])],
        (const("flat", np.array([1, -1], np.int64)), const("rows", np.array([-1, 4], np.int64))),
    )
    return OnnxRuntimeEngine(path)


def batch_one_baked_in(tmp: Path) -> OnnxRuntimeEngine:
    """Reshaped to a constant [1, 4] and back to x's own shape (so the file passes the
    load): one sample runs, two fail."""
    path = save(
        tmp / "baked.onnx",
        [
            helper.make_node("Reshape", ["x", "one_row"], ["r"]),
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Reshape", ["r", "shape"], ["y"]),
        ],
        [value("x", F32, ["batch", 4])],
        [value("y", F32, ["batch", 4])],
        (const("one_row", np.array([1, 4], np.int64)),),
    )
    return OnnxRuntimeEngine(path)


def noisy(tmp: Path) -> OnnxRuntimeEngine:
    """y = x + noise: per sample, but no two runs agree."""
    path = save(
        tmp / "noisy.onnx",
        [
            helper.make_node("RandomNormalLike", ["x"], ["noise"]),
            helper.make_node("Add", ["x", "noise"], ["y"]),
        ],
        [value("x", F32, ["batch", 4])],
        [value("y", F32, ["batch", 4])],
    )
    return OnnxRuntimeEngine(path)


def per_sample(tmp: Path) -> OnnxRuntimeEngine:
    """y = relu(x W): an ordinary per-sample model."""
    w = np.arange(12, dtype=np.float32).reshape(4, 3) - 5
    path = save(
        tmp / "mm.onnx",
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [value("x", F32, ["batch", 4])],
        [value("y", F32, ["batch", 3])],
        (const("w", w),),
    )
    return OnnxRuntimeEngine(path)


TABLE = np.arange(20, dtype=np.float32).reshape(10, 2)


def lookup(tmp: Path, shift: int = 0) -> Path:
    """y = TABLE[idx - shift]: an index out of range fails the run (ORT's InvalidArgument)."""
    return save(
        tmp / f"lookup{shift}.onnx",
        [
            helper.make_node("Sub", ["idx", "shift"], ["i"]),
            helper.make_node("Gather", ["table", "i"], ["y"], axis=0),
        ],
        [value("idx", I64, ["batch"])],
        [value("y", F32, ["batch", 2])],
        (const("table", TABLE), const("shift", np.array(shift, np.int64))),
    )


# --------------------------------------------------------------------------- start


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (transposed, r"output 'y' has shape \[2, 1\] for one sample"),
        (first_sample_only, r"output 'y' is not per sample \(shape \[1, 4\] for two"),
        (softmax_across_the_batch, r"output 'y' is not per sample \(a sample's rows differ"),
        (softmax_across_the_batch_beside_an_inf, r"output 'y' is not per sample \(a sample's"),
        (batch_one_baked_in, r"fails on a batch of two samples that each run alone"),
    ],
)
def test_a_model_whose_outputs_are_not_per_sample_is_refused_at_start(
    tmp_path: Path, build: Any, says: str
) -> None:
    """The worker hands each request its rows of every output: served, these models would
    give requests each other's results whenever an output's dim 0 happened to equal the
    batch's sample count (two requests, each given a column of both)."""
    engine = build(tmp_path)
    with pytest.raises(ConfigError, match=says):
        warm_up(engine, "m")


def test_a_per_sample_model_passes_the_check(tmp_path: Path) -> None:
    warm_up(per_sample(tmp_path), "m")


def test_a_model_whose_runs_differ_is_served_unchecked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Random sampling in the graph: every comparison of rows fails, so the model is
    served unchecked, with a warning, rather than refused as 'not per sample'."""
    with caplog.at_level(logging.WARNING, logger="carpool.worker.warmup"):
        warm_up(noisy(tmp_path), "noisy")
    assert "two runs on the same inputs differ" in caplog.text


def test_a_model_that_fails_on_zeros_is_served_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Zeros are made-up inputs: an index model may refuse them (TABLE[0 - 11]). The
    worker warns and serves it; real requests decide."""
    engine = OnnxRuntimeEngine(lookup(tmp_path, shift=11))
    with caplog.at_level(logging.WARNING, logger="carpool.worker.warmup"):
        warm_up(engine, "lookup")
    assert "warm-up run on zeros failed" in caplog.text
    out = engine.run({"idx": np.array([12, 20], np.int64)})
    np.testing.assert_array_equal(out["y"], TABLE[[1, 9]])


def test_a_model_the_broker_would_refuse_is_refused_at_start(tmp_path: Path) -> None:
    """An input name over the protocol's 256 characters: a ConfigError at start, since
    the broker would drop every READY as a protocol error and the worker try for ever."""
    name = "x" * 300
    path = save(
        tmp_path / "long.onnx",
        [helper.make_node("Relu", [name], ["y"])],
        [value(name, F32, ["batch", 4])],
        [value("y", F32, ["batch", 4])],
    )
    with pytest.raises(ConfigError, match=r"model 'long' cannot be served: .*256"):
        WorkerServer("tcp://127.0.0.1:9", {"long": lambda: OnnxRuntimeEngine(path)})


# --------------------------------------------------------------------------- serving


@pytest.mark.timeout(60)
def test_one_bad_request_fails_alone_not_its_whole_batch(
    tmp_path: Path, fleet_factory: Any
) -> None:
    """An index out of range in one request fails that request INVALID_ARGUMENT; each of
    the others in its batch gets its own result, not INTERNAL."""
    fleet = fleet_factory(policy="fixed", max_batch=8, max_wait_s=0.2)
    path = lookup(tmp_path)
    fleet.add_worker({"lookup": lambda: OnnxRuntimeEngine(path)}, warmup=False)
    client = fleet.ready()
    indices = [1, 99, 3, 7]
    futures = [
        client.submit("lookup", {"idx": np.array([i], np.int64)}, timeout_s=10) for i in indices
    ]
    for i, future in zip(indices, futures, strict=True):
        if i == 99:
            with pytest.raises(InvalidArgument, match="engine error"):
                future.result(10)
        else:
            np.testing.assert_array_equal(future.outputs(10)["y"], TABLE[[i]])
    assert client.stats()["batch_sizes"]["lookup"] == {"4": 1}  # they rode together


def test_an_input_without_a_declared_shape_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The message names the file and says the input has no dims, not only "a scalar"."""
    path = save(
        tmp_path / "noshape.onnx",
        [helper.make_node("Relu", ["x"], ["y"])],
        [value("x", F32, None)],
        [value("y", F32, ["batch", 4])],
    )
    with pytest.raises(ConfigError, match=r"noshape\.onnx: input 'x' has no dims \(a scalar, or"):
        OnnxRuntimeEngine(path)
