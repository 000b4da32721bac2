"""``carpool build-engine`` through its entry point: the profiles it derives, a refused
profile set (exit 2, naming the dim), and, where tensorrt or a GPU is missing, exit 3
with one line saying which."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.worker.tensorrt.onnx_files import image_model

CARPOOL = [sys.executable, "-m", "carpool", "build-engine"]

TOML = """description = "a [B,3,H,W] image model"
max_batch = 8
[inputs.x]
min_shape = [1, 3, 32, 32]
max_shape = [-1, 3, 256, 256]
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CARPOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    folder = tmp_path / "img"
    folder.mkdir()
    (folder / "model.toml").write_text(TOML)
    image_model(folder / "model.onnx")
    return tmp_path


def test_a_dry_run_shows_the_profiles_from_the_shape_rule(repo: Path) -> None:
    done = _run("--repository", str(repo), "img", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "profile 0: x [1..8, 3, 32..256, 32..256]",
        f"plans go to {repo / 'img' / 'plans'}",
    ]


def test_the_models_tensorrt_table_gives_the_defaults_and_flags_win(repo: Path) -> None:
    toml = repo / "img" / "model.toml"
    profile = "x=1x3x64x64:4x3x64x64:8x3x64x64"
    toml.write_text(TOML + f'[tensorrt]\nprofiles = ["{profile}"]\nmax_ratio = 4.0\n')
    done = _run("--repository", str(repo), "img", "--dry-run", "--max-ratio", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "profile 0: x [1..8, 3, 64, 64]"
    refused = _run("--repository", str(repo), "img", "--dry-run")  # the table's max_ratio
    assert refused.returncode == 2
    assert "max/min 8 is above 4" in refused.stderr


def test_a_profile_set_too_wide_is_refused_naming_the_dim(repo: Path) -> None:
    done = _run("--repository", str(repo), "img", "--max-ratio", "4")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "carpool: model 'img', input 'x', dim 0 (the batch): profile 0 spans 1..8, max/min 8 "
        "is above 4 (kernels tuned for one end run slowly at the other): split the batch "
        "with --batch ranges, or raise --max-ratio"
    )


def test_an_unknown_model_is_refused_listing_the_models(repo: Path) -> None:
    done = _run("--repository", str(repo), "nope")
    assert done.returncode == 2
    assert "has no model 'nope'; it has ['img']" in done.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here"
)
def test_without_tensorrt_it_exits_3_with_one_line_saying_so(repo: Path) -> None:
    done = _run("--repository", str(repo), "img", "--batch", "1:4:8")
    assert done.returncode == 3
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("carpool build-engine: cannot build here: tensorrt is not installed")
    assert "docs/gpu.md" in line
    assert not (repo / "img" / "plans").exists()


def test_with_tensorrt_but_no_gpu_it_exits_3_before_any_tensorrt_object(
    repo: Path, tmp_path: Path
) -> None:
    """A stand-in tensorrt package whose Builder ends the process: the probe answers first."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver: the probe may find a GPU")
    fake = tmp_path / ".site" / "tensorrt"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        '__version__ = "10.3.0"\n'
        "def Builder(*args):\n"
        '    raise SystemExit("a Builder was created")\n'
    )
    done = subprocess.run(
        [*CARPOOL, "--repository", str(repo), "img"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path / ".site")},
    )
    assert done.returncode == 3
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("carpool build-engine: cannot build here: no GPU found (")


def test_the_built_in_recognizer_builds_a_profile_per_bucket_with_no_flags() -> None:
    from carpool.worker.repository import BUILTIN_ROOT

    done = _run("--repository", str(BUILTIN_ROOT), "ppocr-rec", "--dry-run")
    assert done.returncode == 0, done.stderr
    shown = [line for line in done.stdout.splitlines() if line.startswith("profile ")]
    assert len(shown) == 10
    assert shown[0] == "profile 0: x [1..8, 3, 48, 160]"
