"""precision.py: a requested precision as network and builder flags, per TensorRT release.

================  ==========================================  ===========================
asked             TensorRT 10.x                               TensorRT 11.x
================  ==========================================  ===========================
``fp32``          weakly typed network, no flag               strongly typed: the ONNX
                                                              file's types (refused when
                                                              it carries FP16 or Q/DQ)
``fp16``          weakly typed, ``BuilderFlag.FP16``          strongly typed, only from an
                                                              ONNX file that carries FP16
``int8``          weakly typed, ``BuilderFlag.INT8``, only    strongly typed, only from an
                  from an ONNX file with Q/DQ nodes           ONNX file with Q/DQ nodes
================  ==========================================  ===========================

INT8 comes only from the scales of QuantizeLinear/DequantizeLinear nodes in the file:
carpool never calibrates (implicit calibration is deprecated in 10 and gone in 11).
:func:`plan` is pure; :func:`inspect_onnx` reads a file with the ``onnx`` package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from carpool.common.errors import ConfigError
from carpool.worker.tensorrt.versions import TrtVersion

__all__ = ["PRECISIONS", "OnnxPrecision", "PrecisionPlan", "inspect_onnx", "plan"]

PRECISIONS = ("fp32", "fp16", "int8")
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
_FLOAT16 = 10  # onnx.TensorProto.FLOAT16 (a stable enum value of the ONNX format)

_CONVERT_FP16 = (
    "convert it first, e.g. with onnxconverter-common "
    "(float16.convert_float_to_float16(model, keep_io_types=True)) or ModelOpt AutoCast"
)


@dataclass(frozen=True, slots=True)
class OnnxPrecision:
    """What precision an ONNX file carries."""

    qdq: bool  # has QuantizeLinear/DequantizeLinear nodes
    fp16: bool  # has FLOAT16 tensors (initializers, values or casts)


@dataclass(frozen=True, slots=True)
class PrecisionPlan:
    """How to build one precision on one release."""

    precision: str  # as asked: fp32 | fp16 | int8
    strongly_typed: bool  # ask create_network for STRONGLY_TYPED (10.x); 11.x always is
    builder_flags: tuple[str, ...]  # BuilderFlag member names to set
    note: str  # one line for the user: where the precision comes from

    def to_key(self) -> dict[str, object]:
        return {
            "precision": self.precision,
            "strongly_typed": self.strongly_typed,
            "builder_flags": list(self.builder_flags),
        }


def plan(precision: str, version: TrtVersion, onnx: OnnxPrecision, model: str) -> PrecisionPlan:
    """How ``model``'s file (carrying ``onnx``) is built at ``precision`` on ``version``.

    Raises:
        ConfigError: the precision cannot be had from this file on this release; the
            message says why and what to do.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    what = f"model {model!r}, TensorRT {version}"
    if precision == "int8" and not onnx.qdq:
        raise ConfigError(
            f"{what}: int8 needs an ONNX file with QuantizeLinear/DequantizeLinear (Q/DQ) "
            "nodes, and this one has none; carpool does not calibrate (implicit INT8 "
            "calibration is deprecated in TensorRT 10 and removed in 11): quantize the "
            "model first (e.g. with ModelOpt or onnxruntime.quantization, QDQ format)"
        )
    if version.precision_flags:
        flags = {"fp32": (), "fp16": ("FP16",), "int8": ("INT8",)}[precision]
        note = {
            "fp32": "TensorRT 10: weakly typed network, FP32 (TF32 where the GPU has it)",
            "fp16": "TensorRT 10: weakly typed network with the FP16 builder flag",
            "int8": "TensorRT 10: INT8 from the file's Q/DQ scales (INT8 builder flag)",
        }[precision]
        return PrecisionPlan(precision, False, flags, note)
    # 11.x: the network is strongly typed; its precision is the file's, never a flag's.
    if precision == "fp16" and not onnx.fp16:
        raise ConfigError(
            f"{what}: TensorRT 11 removed the FP16 builder flag: a network takes its "
            "precision from the ONNX file, and this file carries no FP16 tensors; "
            f"{_CONVERT_FP16}, and build that file with --precision fp16"
        )
    if precision == "fp32" and (onnx.fp16 or onnx.qdq):
        carried = "Q/DQ (INT8) nodes" if onnx.qdq else "FP16 tensors"
        asked = "int8" if onnx.qdq else "fp16"
        raise ConfigError(
            f"{what}: the network is strongly typed and this ONNX file carries {carried}, "
            f"so the plan would not be fp32: ask --precision {asked}, or build the FP32 file"
        )
    note = f"TensorRT 11: strongly typed network, {precision} as the ONNX file carries it"
    return PrecisionPlan(precision, True, (), note)


def inspect_onnx(path: str | Path) -> OnnxPrecision:
    """Whether the ONNX file at ``path`` has Q/DQ nodes and FP16 tensors (its graph, the
    subgraphs of its nodes and its functions; weights in external files are not read).

    Raises:
        ConfigError: the file cannot be read as ONNX, or the ``onnx`` package is missing.
    """
    try:
        import onnx
    except ImportError:
        raise ConfigError(
            "reading an ONNX file's precision needs the onnx package (pip install onnx)"
        ) from None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, an OSError, ...
        raise ConfigError(f"cannot load ONNX model {path}: {exc}") from None
    qdq = fp16 = False
    graphs = [model.graph]
    nodes = [n for f in model.functions for n in f.node]
    while graphs:
        graph = graphs.pop()
        nodes += graph.node
        fp16 = fp16 or any(t.data_type == _FLOAT16 for t in graph.initializer)
        values = [*graph.input, *graph.output, *graph.value_info]
        fp16 = fp16 or any(v.type.tensor_type.elem_type == _FLOAT16 for v in values)
        for node in graph.node:
            graphs += [a.g for a in node.attribute if a.HasField("g")]
            graphs += [g for a in node.attribute for g in a.graphs]
    for node in nodes:
        qdq = qdq or node.op_type in _QDQ
        if node.op_type == "Cast":
            fp16 = fp16 or any(a.name == "to" and a.i == _FLOAT16 for a in node.attribute)
    return OnnxPrecision(qdq, fp16)
