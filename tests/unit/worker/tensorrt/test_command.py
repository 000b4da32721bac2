"""``carpool build-engine`` (worker/tensorrt/command.py) through ``carpool.cli.main``, with
tensorrt, the GPU probe and the builder adapter replaced by fakes: a profile TensorRT
refuses is a refused request (exit 2, one line), not a traceback."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool import cli
from carpool.worker.engines import trt
from carpool.worker.tensorrt import probe
from carpool.worker.tensorrt.cache import Device

from .onnx_files import image_model
from .test_build import RecordingBuilder

TOML = """max_batch = 8
[inputs.x]
min_shape = [1, 3, 32, 32]
max_shape = [-1, 3, 64, 64]
"""


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """cli.main installs a root log handler: take it off again."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> list[RecordingBuilder]:
    """tensorrt 10.3.0 installed and an H200 answering; the builders made."""
    made: list[RecordingBuilder] = []
    find_spec = importlib.util.find_spec

    def found(name: str, *args: Any) -> Any:
        return object() if name == "tensorrt" else find_spec(name, *args)

    def builder() -> RecordingBuilder:
        made.append(RecordingBuilder(profile_error="Shape provided for min is inconsistent"))
        return made[-1]

    monkeypatch.setattr(importlib.util, "find_spec", found)
    monkeypatch.setattr(probe, "run_probe", lambda: probe.GpuProbe(Device("NVIDIA H200", (9, 0))))
    monkeypatch.setattr(trt, "tensorrt_version", lambda: "10.3.0")
    monkeypatch.setattr(trt, "TensorRTBuilder", builder)
    return made


def test_a_profile_tensorrt_refuses_exits_2_with_one_line(
    tmp_path: Path, machine: list[RecordingBuilder], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "img"
    folder.mkdir()
    (folder / "model.toml").write_text(TOML)
    image_model(folder / "model.onnx")
    assert cli.main(["build-engine", "--repository", str(tmp_path), "img"]) == 2
    assert len(machine) == 1
    assert capsys.readouterr().err.splitlines() == [
        "carpool: model 'img': TensorRT refused optimization profile 0 (x [1..8, 3, 32..64, "
        "32..64]): Shape provided for min is inconsistent"
    ]
    assert not (folder / "plans").exists()
