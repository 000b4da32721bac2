"""A model configured for TensorRT on a worker where TensorRT cannot serve it: one log
line, and the same ONNX model served with ONNX Runtime (or a clear refusal)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from carpool.client import Client
from carpool.common.errors import ConfigError
from carpool.worker.config import ModelConfig, TensorRTConfig
from carpool.worker.engines import trt_load
from carpool.worker.engines.base import engines_busy_s
from carpool.worker.engines.ort import OnnxRuntimeEngine
from carpool.worker.engines.trt_load import TensorRT
from carpool.worker.factory import engine_factory
from carpool.worker.models import locate
from carpool.worker.tensorrt import cache
from carpool.worker.tensorrt.build import prepare, request_for
from carpool.worker.tensorrt.cache import Device
from carpool.worker.tensorrt.probe import GpuProbe
from carpool.worker.tensorrt.versions import TrtVersion
from tests.system.test_cli import Spawn, _logs, _until_registered, spawn  # noqa: F401

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt") is not None,
    reason="TensorRT is installed here: the fallback for its absence is not reachable",
)

GPU = GpuProbe(Device("NVIDIA H200", (9, 0)), binding="cuda-bindings 12.9.1")
NO_GPU = GpuProbe(None, "no GPU found (nvml: NVMLError_LibraryNotFound)")


def _cls(tmp_path: Path) -> Path:
    model = tmp_path / "cls.onnx"
    shutil.copyfile(locate("ppocr-cls"), model)
    return model


def _configured(onnx: Path) -> ModelConfig:
    """ppocr-cls for TensorRT: its width has no upper bound, so a profile is given."""
    profile = "x=1x3x48x192:4x3x48x192:8x3x48x192"
    return ModelConfig(
        name="cls", engine="tensorrt", path=str(onnx), tensorrt=TensorRTConfig(profiles=(profile,))
    )


def test_without_tensorrt_the_onnx_model_is_served_by_onnx_runtime(tmp_path, caplog):
    config = ModelConfig(name="cls", engine="tensorrt", path=str(_cls(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="carpool.worker.engines.trt_load"):
        engine = engine_factory(config)()
    assert isinstance(engine, OnnxRuntimeEngine)
    assert engines_busy_s({"m": engine}) is None  # measured on the wall clock by the worker
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "model 'cls': serving with ONNX Runtime, not TensorRT: TensorRT is not installed "
        "(docs/gpu.md says how to get it)"
    ]
    engine.close()


@pytest.mark.parametrize(
    ("probe", "plan", "says"),
    [
        (NO_GPU, None, "no GPU found (nvml: NVMLError_LibraryNotFound)"),
        (GPU, None, "this worker does not build plans: run `carpool build-engine"),
        (GPU, b"not a plan", "the plan did not load"),
    ],
    ids=["no GPU", "no plan", "plan fails to load"],
)
def test_each_reason_tensorrt_cannot_serve_falls_back_in_one_line(
    tmp_path, caplog, probe, plan, says
):
    """Through the real engine cache and loader (tensorrt itself is missing here: only
    its presence, the probe and its version are told)."""
    config = _configured(_cls(tmp_path))
    request = request_for(config, tmp_path, tmp_path.parent)
    if plan is not None:
        version = TrtVersion.parse("10.3.0")
        assert probe.device is not None
        cache.store(tmp_path, prepare(request, version, probe.device).key, plan)
    told = TensorRT(installed=lambda: True, probe=lambda: probe, version=lambda: "10.3.0")
    with caplog.at_level(logging.WARNING, logger="carpool.worker.engines.trt_load"):
        engine = trt_load.tensorrt_or_onnxruntime(
            lambda: request, "model 'cls'", lambda: OnnxRuntimeEngine(request.onnx), trt=told
        )
    assert isinstance(engine, OnnxRuntimeEngine)
    assert len(caplog.records) == 1
    assert says in caplog.records[0].getMessage()


def test_backends_without_onnxruntime_refuse_instead(tmp_path):
    config = ModelConfig(
        name="cls", engine="tensorrt", path=str(_cls(tmp_path)), backends=("tensorrt",)
    )
    with pytest.raises(ConfigError, match="cannot be served with TensorRT here: TensorRT is not"):
        engine_factory(config)()


def test_the_worker_entry_point_falls_back_and_serves(tmp_path: Path, spawn: Spawn) -> None:  # noqa: F811
    model = _cls(tmp_path)
    toml = tmp_path / "worker.toml"
    toml.write_text(f'[[models]]\nname = "cls"\nengine = "tensorrt"\npath = "{model}"\n')
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    broker = spawn("broker", "--frontend", frontend, "--backend", backend)
    worker = spawn("worker", "--broker", backend, "--config", str(toml), "--name", "w0")
    x = np.random.default_rng(0).random((2, 3, 48, 192), dtype=np.float32)
    with Client(frontend, default_timeout_s=10.0) as client:
        workers = _until_registered(client, broker, worker, tmp_path)
        assert [w["models"] for w in workers] == [["cls"]]
        result = client.infer("cls", {"x": x}, timeout_s=10.0)
    want = OnnxRuntimeEngine(model).run({"x": x})
    for name, value in want.items():
        np.testing.assert_allclose(result[name], value, rtol=1e-5, atol=1e-6)
    logs = _logs(tmp_path)
    line = "model 'cls': serving with ONNX Runtime, not TensorRT: TensorRT is not installed"
    assert logs.count(line) == 1, logs


def test_importing_the_engine_modules_imports_no_tensorrt():
    code = (
        "import sys, carpool.worker.engines.trt, carpool.worker.engines.trt_load, "
        "carpool.worker.engines.trt_engine, carpool.worker.tensorrt.build, "
        "carpool.worker.tensorrt.command, carpool.worker.tensorrt.probe, carpool.worker.cuda; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'cuda', 'pycuda')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
