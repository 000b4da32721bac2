"""The GPU extras: each asks for the CUDA binding its target's driver runs, offline.

The CUDA binding must match the machine's driver, which environment markers cannot see:
``jetpack6``, ``cu12`` and ``cu13`` name the target; ``gpu`` picks what markers can tell
apart (aarch64 with Python 3.10 is JetPack 6's); ``trt`` is ``gpu``. These tests read
pyproject.toml's extras and evaluate their markers per target, with the helpers of
bench/extras_resolve.py, which resolves the same extras against the package index
(``pip download --platform``; not run here: CI has no index to rely on).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
CUDA = ("cuda-python", "cuda-bindings")


er = load_script("extras_resolve.py")
EXTRAS = er.extras()
TARGETS = {t.name: t for t in er.TARGETS}


def _cuda(lines: list[str]) -> list[Requirement]:
    return [r for r in map(Requirement, lines) if r.name in CUDA]


def test_no_extra_asks_for_an_unbounded_cuda_binding_but_cu13():
    for name, lines in EXTRAS.items():
        for req in _cuda(lines):
            admits_13 = any(req.specifier.contains(v) for v in ("13.0.0", "13.5.0", "14.0"))
            if name == "cu13":
                assert not req.specifier.contains("12.9.10"), req
            else:
                assert not admits_13, f"[{name}] asks for {req}: a CUDA 13 binding needs r580"


def test_each_target_extra_names_one_binding_whatever_the_platform():
    expected = {
        "jetpack6": ("cuda-python", "12.6.2", "12.7"),
        "cu12": ("cuda-bindings", "12.9.1", "13.0"),
        "cu13": ("cuda-bindings", "13.0", None),
    }
    for extra, (package, low, high) in expected.items():
        for target in er.TARGETS:
            (req,) = _cuda(er.active(EXTRAS[extra], target))
            assert req.name == package
            assert req.specifier.contains(low)
            if high is not None:
                assert not req.specifier.contains(high)


@pytest.mark.parametrize("extra", ["gpu", "trt"])
def test_gpu_gives_jetpack6_its_binding_and_every_other_platform_cu12s(extra):
    for name, target in TARGETS.items():
        (req,) = _cuda(er.active(EXTRAS[extra], target))
        wanted = "jetpack6" if (target.machine, target.python) == ("aarch64", "3.10") else "cu12"
        assert str(req) == str(_cuda(er.active(EXTRAS[wanted], target))[0]), name


def test_every_gpu_extra_brings_nvml():
    for extra in ("gpu", "trt", "jetpack6", "cu12", "cu13"):
        assert "nvidia-ml-py" in {Requirement(r).name for r in EXTRAS[extra]}


def test_the_docs_give_one_install_line_per_target():
    gpu_md = (ROOT / "docs" / "gpu.md").read_text()
    for extra in ("jetpack6", "cu12", "cu13"):
        assert re.search(rf'pip install "carpool\[{extra}\]"', gpu_md), extra
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert re.search(r"carpool\[[a-z0-9,]*jetpack6", deploy)
    for doc in (gpu_md, deploy):
        assert "cuda-python>=12" not in doc
