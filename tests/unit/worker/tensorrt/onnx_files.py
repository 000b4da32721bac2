"""Small ONNX files for the TensorRT build tests, made with onnx.helper: a [N,3,H,W]
image model, plain, with Q/DQ nodes, or carrying FP16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def image_model(path: Path, *, qdq: bool = False, fp16: bool = False) -> Path:
    """x [N,3,H,W] float32 → Relu → y; with ``qdq`` a QuantizeLinear/DequantizeLinear pair
    before the Relu, with ``fp16`` a Cast to FLOAT16 and back."""
    dims: list[int | str] = ["N", 3, "H", "W"]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    nodes = []
    inits = []
    last = "x"
    if qdq:
        inits += [
            numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
            numpy_helper.from_array(np.array(0, np.int8), "zero"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xd"]),
        ]
        last = "xd"
    if fp16:
        nodes += [
            helper.make_node("Cast", [last], ["xh"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", ["xh"], ["xf"], to=TensorProto.FLOAT),
        ]
        last = "xf"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    graph = helper.make_graph(nodes, "image", [x], [y], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
