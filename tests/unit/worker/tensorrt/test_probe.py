"""worker/tensorrt/probe.py: the GPU probe's answer, and the probe run here (no GPU)."""

from __future__ import annotations

import json

import pytest

from carpool.worker.tensorrt.cache import Device
from carpool.worker.tensorrt.probe import GpuProbe, parse, probe


def test_an_nvml_answer_is_a_device() -> None:
    out = json.dumps({"name": "NVIDIA H200", "cc": [9, 0], "via": "nvml"})
    assert parse(0, out + "\n") == GpuProbe(Device("NVIDIA H200", (9, 0)), via="nvml")


def test_a_pycuda_answer_is_a_device() -> None:
    out = json.dumps({"name": "Orin", "cc": [8, 7], "via": "pycuda"})
    found = parse(0, out)
    assert found.ok
    assert found.via == "pycuda"


def test_a_jetson_answer_carries_its_l4t_release() -> None:
    out = json.dumps({"name": "Orin", "cc": [8, 7], "via": "cuda"})
    assert parse(0, out, "R36.4.3").device == Device("Orin", (8, 7), "R36.4.3")


@pytest.mark.parametrize(
    ("rc", "out", "words"),
    [
        (0, json.dumps({"error": "nvidia-ml-py is not installed"}), "no GPU found (nvidia-ml-py"),
        (-11, "", "exited with status -11 and no answer"),  # the child crashed
        (0, "garbage", "exited with status 0 and no answer"),
        (0, json.dumps({"name": "x"}), "answered"),
    ],
)
def test_a_missing_or_crashed_gpu_is_a_reason(rc, out, words) -> None:
    found = parse(rc, out)
    assert found.device is None
    assert not found.ok
    assert words in found.reason


def test_the_probe_runs_in_a_child_and_answers_either_way() -> None:
    found = probe(timeout_s=60)
    assert (found.device is None) == bool(found.reason)
