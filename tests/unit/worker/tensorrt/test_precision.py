"""worker/tensorrt/precision.py: fp32/fp16/int8 on TensorRT 10 (weak typing, builder
flags) and 11 (strongly typed, the ONNX file's own precision), and what an ONNX file
carries (Q/DQ nodes, FP16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.common.errors import ConfigError
from carpool.worker.tensorrt.precision import OnnxPrecision, inspect_onnx, plan
from carpool.worker.tensorrt.versions import TrtVersion

from .onnx_files import image_model

V10 = TrtVersion.parse("10.3.0")
V11 = TrtVersion.parse("11.4.0.106")
FP32_FILE = OnnxPrecision(qdq=False, fp16=False)
FP16_FILE = OnnxPrecision(qdq=False, fp16=True)
QDQ_FILE = OnnxPrecision(qdq=True, fp16=False)


@pytest.mark.parametrize(
    ("precision", "onnx", "flags"),
    [
        ("fp32", FP32_FILE, ()),
        ("fp16", FP32_FILE, ("FP16",)),
        ("fp16", FP16_FILE, ("FP16",)),
        ("int8", QDQ_FILE, ("INT8",)),
    ],
)
def test_tensorrt_10_sets_a_builder_flag_on_a_weakly_typed_network(precision, onnx, flags) -> None:
    got = plan(precision, V10, onnx, "m")
    assert (got.strongly_typed, got.builder_flags, got.precision) == (False, flags, precision)
    assert got.note.startswith("TensorRT 10")


@pytest.mark.parametrize(
    ("precision", "onnx"), [("fp32", FP32_FILE), ("fp16", FP16_FILE), ("int8", QDQ_FILE)]
)
def test_tensorrt_11_builds_strongly_typed_with_no_flag(precision, onnx) -> None:
    got = plan(precision, V11, onnx, "m")
    assert (got.strongly_typed, got.builder_flags) == (True, ())
    assert "strongly typed" in got.note


def test_fp16_on_11_from_an_fp32_file_says_the_flag_is_gone_and_how_to_convert() -> None:
    with pytest.raises(ConfigError) as caught:
        plan("fp16", V11, FP32_FILE, "det")
    message = str(caught.value)
    assert "model 'det', TensorRT 11.4.0.106" in message
    assert "TensorRT 11 removed the FP16 builder flag" in message
    assert "onnxconverter-common" in message


@pytest.mark.parametrize("version", [V10, V11])
def test_int8_without_qdq_nodes_is_refused_not_calibrated(version) -> None:
    with pytest.raises(ConfigError, match=r"Q/DQ.*does not calibrate"):
        plan("int8", version, FP16_FILE, "m")


@pytest.mark.parametrize(("onnx", "ask"), [(FP16_FILE, "fp16"), (QDQ_FILE, "int8")])
def test_fp32_on_11_from_a_reduced_precision_file_names_the_precision_it_would_be(onnx, ask):
    with pytest.raises(ConfigError, match=f"ask --precision {ask}"):
        plan("fp32", V11, onnx, "m")


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ConfigError, match="fp32, fp16, int8"):
        plan("bf16", V10, FP32_FILE, "m")


def test_the_key_names_the_plan_it_builds() -> None:
    assert plan("fp16", V10, FP32_FILE, "m").to_key() == {
        "precision": "fp16",
        "strongly_typed": False,
        "builder_flags": ["FP16"],
    }


@pytest.mark.parametrize(
    ("qdq", "fp16"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_an_onnx_file_says_whether_it_has_qdq_nodes_and_fp16(tmp_path: Path, qdq, fp16) -> None:
    path = image_model(tmp_path / "m.onnx", qdq=qdq, fp16=fp16)
    assert inspect_onnx(path) == OnnxPrecision(qdq=qdq, fp16=fp16)


def test_an_unreadable_onnx_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="cannot load ONNX model"):
        inspect_onnx(bad)
