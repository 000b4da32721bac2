"""worker/engines/trt_load.py: a worker finds its plan through the engine cache (a hit
loads; a missing, stale or foreign plan is built where the model may build, else refused
naming the build-engine command) — against fakes of tensorrt's presence, the GPU probe,
its version, the builder adapter and the loader."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from carpool.common.errors import ConfigError
from carpool.worker.engines.trt_load import GET_TENSORRT, TensorRT, Unavailable, find_plan
from carpool.worker.engines.trt_load import tensorrt_or_onnxruntime as serve
from carpool.worker.tensorrt import cache
from carpool.worker.tensorrt.build import BuildRequest, prepare
from carpool.worker.tensorrt.cache import Device
from carpool.worker.tensorrt.precision import OnnxPrecision
from carpool.worker.tensorrt.probe import GpuProbe
from carpool.worker.tensorrt.profiles import InputRange, Profile
from carpool.worker.tensorrt.versions import TrtVersion
from tests.unit.worker.tensorrt.test_build import RecordingBuilder

H200 = Device("NVIDIA H200", (9, 0))
ORIN = Device("Orin (nvgpu)", (8, 7), "R36.4.3")
PROFILES = (Profile((InputRange("x", (1, 3, 32, 32), (4, 3, 32, 32), (8, 3, 32, 32)),)),)


def _request(tmp_path: Path) -> BuildRequest:
    folder = tmp_path / "repo" / "m"
    folder.mkdir(parents=True)
    onnx = folder / "model.onnx"
    onnx.write_bytes(b"an onnx file")
    return BuildRequest("m", onnx, folder, folder.parent, PROFILES, OnnxPrecision(False, False))


class Machine:
    """What the worker would find: tensorrt, a GPU, a TensorRT version; what it did."""

    def __init__(self, *, installed: bool = True, device: Device | None = H200) -> None:
        self.device = device
        self.version = "10.3.0"
        self.asked: list[str] = []
        self.builders: list[RecordingBuilder] = []
        self.loaded: list[Path] = []
        self._installed = installed

    def trt(self) -> TensorRT:
        return TensorRT(
            installed=lambda: self._installed,
            probe=self._probe,
            version=self._version,
            new_builder=self._builder,
            load=self._load,
        )

    def _probe(self) -> GpuProbe:
        self.asked.append("probe")
        return GpuProbe(self.device, "" if self.device else "no GPU found (nvml: no driver)")

    def _version(self) -> str:
        self.asked.append("version")
        return self.version

    def _builder(self) -> RecordingBuilder:
        self.builders.append(RecordingBuilder(self.version))
        return self.builders[-1]

    def _load(self, plan: Path, what: str, shapes: Any) -> Any:
        self.loaded.append(plan)
        return ("engine", plan.read_bytes())


def _store(request: BuildRequest, version: str, device: Device, plan: bytes = b"PLAN") -> Path:
    key = prepare(request, TrtVersion.parse(version), device).key
    return cache.store(request.folder, key, plan)


def test_a_plan_in_the_cache_under_this_machines_key_loads(tmp_path: Path) -> None:
    request, machine = _request(tmp_path), Machine()
    stored = _store(request, "10.3.0", H200)
    assert find_plan(lambda: request, False, machine.trt(), "model 'm'") == stored
    assert machine.builders == []


def test_a_missing_plan_is_refused_naming_the_command_to_run(tmp_path: Path) -> None:
    request, machine = _request(tmp_path), Machine()
    with pytest.raises(Unavailable) as refused:
        find_plan(lambda: request, False, machine.trt(), "model 'm'")
    assert str(refused.value) == (
        f"no plan in {request.folder / 'plans'} for this model, TensorRT and GPU; this "
        f"worker does not build plans: run `carpool build-engine --repository "
        f"{request.repository} m` on this machine"
    )
    assert machine.builders == []


@pytest.mark.parametrize(
    ("version", "device", "differs"),
    [
        ("10.3.0", ORIN, "gpu_name 'Orin (nvgpu)'; compute_capability [8, 7]; l4t 'R36.4.3'"),
        ("10.16.1.11", H200, "trt_version '10.16.1.11'"),
    ],
    ids=["foreign GPU", "stale TensorRT"],
)
def test_a_plan_for_another_gpu_or_tensorrt_is_not_loaded(
    tmp_path: Path, version: str, device: Device, differs: str
) -> None:
    request, machine = _request(tmp_path), Machine()
    _store(request, version, device)
    with pytest.raises(Unavailable, match="does not build plans") as refused:
        find_plan(lambda: request, False, machine.trt(), "model 'm'")
    assert f"was built for {differs}" in str(refused.value)
    assert machine.loaded == []


def test_a_worker_that_may_build_builds_once_then_finds_it(tmp_path: Path) -> None:
    request, machine = _request(tmp_path), Machine()
    _store(request, "10.16.1.11", H200, b"OLD")  # stale: built by another release
    first = find_plan(lambda: request, True, machine.trt(), "model 'm'")
    assert first.read_bytes() == b"PLAN"
    assert [c[0] for c in machine.builders[0].calls].count("add_profile") == 1
    assert find_plan(lambda: request, True, machine.trt(), "model 'm'") == first
    assert len(machine.builders) == 1
    assert cache.timing_cache_path(request.repository, "10.3.0", H200).is_file()


def test_without_tensorrt_no_gpu_is_probed(tmp_path: Path) -> None:
    machine = Machine(installed=False)
    with pytest.raises(Unavailable, match=re.escape(GET_TENSORRT)):
        find_plan(lambda: _request(tmp_path), False, machine.trt(), "model 'm'")
    assert machine.asked == []


def test_without_a_gpu_tensorrt_is_not_asked_anything(tmp_path: Path) -> None:
    machine = Machine(device=None)
    with pytest.raises(Unavailable, match="no GPU found"):
        find_plan(lambda: _request(tmp_path), False, machine.trt(), "model 'm'")
    assert machine.asked == ["probe"]


def test_a_profile_set_too_large_is_a_reason(tmp_path: Path) -> None:
    request = _request(tmp_path)
    wide = (Profile((InputRange("x", (1, 3, 32, 32), (4, 3, 32, 32), (64, 3, 32, 32)),)),)
    big = dataclasses.replace(request, profiles=wide)
    with pytest.raises(Unavailable, match=r"dim 0 \(the batch\): profile 0 spans 1..64"):
        find_plan(lambda: big, True, Machine().trt(), "model 'm'")


def test_serving_loads_a_hit_and_falls_back_in_one_line_otherwise(tmp_path, caplog) -> None:
    request, machine = _request(tmp_path), Machine()
    ort: Any = object()  # what ONNX Runtime would serve
    with caplog.at_level(logging.WARNING, logger="carpool.worker.engines.trt_load"):
        assert serve(lambda: request, "model 'm'", lambda: ort, trt=machine.trt()) is ort
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("model 'm': serving with ONNX Runtime, not TensorRT: no plan in ")
    stored = _store(request, "10.3.0", H200)
    assert serve(lambda: request, "model 'm'", lambda: ort, trt=machine.trt()) is not ort
    assert machine.loaded == [stored]
    with pytest.raises(ConfigError, match="cannot be served with TensorRT here: no GPU"):
        serve(
            lambda: request,
            "model 'm'",
            lambda: ort,
            may_fall_back=False,
            trt=Machine(device=None).trt(),
        )
