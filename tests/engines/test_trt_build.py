"""``carpool build-engine`` on a GPU with TensorRT: a tiny ONNX model built into a
repository's engine cache, found there the second time, and built again with a new key
when its profiles change, and a worker serving it from there. Marked ``gpu``: skipped where
tensorrt or a GPU is missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from carpool.worker.tensorrt.probe import probe
from tests.unit.worker.tensorrt.onnx_files import image_model

pytestmark = pytest.mark.gpu

TOML = """max_batch = 4
[inputs.x]
min_shape = [1, 3, 16, 16]
max_shape = [-1, 3, 64, 64]
"""


@pytest.fixture(scope="module")
def gpu() -> None:
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("tensorrt is not installed (it comes from NVIDIA or JetPack)")
    found = probe()
    if found.device is None:
        pytest.skip(f"no GPU: {found.reason}")


def _build(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "carpool", "build-engine", "--repository", str(repo), "img", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_plan_is_built_cached_and_keyed_by_its_profiles(gpu: None, tmp_path: Path) -> None:
    folder = tmp_path / "img"
    folder.mkdir()
    (folder / "model.toml").write_text(TOML)
    image_model(folder / "model.onnx")
    first = _build(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "built:" in first.stdout
    (sidecar,) = (folder / "plans").glob("*.json")
    assert json.loads(sidecar.read_text())["plan_bytes"] > 0
    assert list((tmp_path / ".timing").glob("*.cache"))
    second = _build(tmp_path)
    assert "cached:" in second.stdout
    third = _build(tmp_path, "--batch", "1:2:4")
    assert "built:" in third.stdout
    assert len(list((folder / "plans").glob("*.plan"))) == 2


def test_a_worker_finds_the_plan_in_the_cache_and_matches_onnx_runtime(
    gpu: None, tmp_path: Path
) -> None:
    from carpool.worker.engines.ort import OnnxRuntimeEngine
    from carpool.worker.engines.trt import TensorRTEngine
    from carpool.worker.factory import engine_factory
    from carpool.worker.repository import load

    folder = tmp_path / "img"
    folder.mkdir()
    (folder / "model.toml").write_text('engine = "tensorrt"\n' + TOML)
    image_model(folder / "model.onnx")
    assert _build(tmp_path).returncode == 0
    engine = engine_factory(load(tmp_path).models["img"].config)()
    try:
        assert isinstance(engine, TensorRTEngine)
        x = np.random.default_rng(0).random((3, 3, 32, 48), dtype=np.float32)
        want = OnnxRuntimeEngine(folder / "model.onnx").run({"x": x})
        got = engine.run({"x": x})
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=1e-4)
    finally:
        engine.close()
