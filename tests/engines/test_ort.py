"""OnnxRuntimeEngine on the real catalogue models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from carpool.common.errors import ConfigError
from carpool.common.protocol import TensorMeta
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.models import locate, sha256_of
from carpool.worker.repository import builtin


@pytest.mark.parametrize("name", sorted(builtin().models))
def test_catalogue_files_match_their_pinned_checksums(name: str) -> None:
    source = builtin().models[name].config.source
    assert source is not None
    assert sha256_of(locate(name)) == source.sha256


def test_unknown_catalogue_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="catalogue"):
        locate("resnet-9000")


def test_orientation_spec_has_a_dynamic_batch_dim() -> None:
    engine = OnnxRuntimeEngine(locate("orientation"), max_batch=4)
    assert engine.info.io.inputs == (TensorMeta("x", "float32", (-1, 3, 224, 224)),)
    assert engine.info.io.outputs == (TensorMeta("fetch_name_0", "float32", (-1, 4)),)
    assert engine.info.io.max_batch == 4
    assert engine.metadata["character"].split() == ["0", "90", "180", "270"]


@pytest.mark.parametrize(("name", "shape"), [("ppocr-cls", (3, 48, 192)), ("orientation", None)])
def test_a_batch_equals_its_requests_run_alone(name: str, shape: tuple[int, ...] | None) -> None:
    engine = OnnxRuntimeEngine(locate(name), max_batch=4)
    item = shape or engine.info.io.inputs[0].shape[1:]
    x = np.random.default_rng(0).standard_normal((4, *item)).astype(np.float32)
    out_name = engine.info.io.outputs[0].name
    batched = engine.run({"x": x})[out_name]
    alone = np.concatenate([engine.run({"x": x[i : i + 1]})[out_name] for i in range(4)])
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-6)


def test_dynamic_spatial_dims_are_marked() -> None:
    engine = OnnxRuntimeEngine(locate("ppocr-det"))
    assert engine.info.io.inputs[0].shape == (-1, 3, -1, -1)


def test_unreadable_model_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="cannot load"):
        OnnxRuntimeEngine(bad)


def test_execution_providers_are_chosen_and_checked() -> None:
    """CPU here; a provider this onnxruntime lacks (CUDA needs onnxruntime-gpu) is a
    ConfigError that says what it has, not ONNX Runtime's silent fall-back to the CPU."""
    import onnxruntime as ort

    engine = OnnxRuntimeEngine(locate("ppocr-cls"), providers=("CPUExecutionProvider",))
    assert engine._session.get_providers() == ["CPUExecutionProvider"]
    wanted = ("CUDAExecutionProvider", "NoSuchExecutionProvider")
    missing = [p for p in wanted if p not in ort.get_available_providers()]
    with pytest.raises(ConfigError, match=r"not available here; this onnxruntime has .*CPU"):
        OnnxRuntimeEngine(locate("ppocr-cls"), providers=(*missing, "CPUExecutionProvider"))
    with pytest.raises(ConfigError, match="not available"):
        OnnxRuntimeEngine(locate("ppocr-cls"), providers=())


def test_a_provider_that_does_not_start_is_not_a_silent_cpu_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """onnxruntime-gpu lists CUDA even without the CUDA libraries; its inference session
    then runs on the CPU without a word. Simulated: CUDA listed as available here."""
    import onnxruntime as ort

    listed = [*ort.get_available_providers(), "CUDAExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: listed)
    wanted = ("CUDAExecutionProvider", "CPUExecutionProvider")
    with pytest.warns(UserWarning, match="CUDA"), pytest.raises(ConfigError, match="did not start"):
        OnnxRuntimeEngine(locate("ppocr-cls"), providers=wanted)
