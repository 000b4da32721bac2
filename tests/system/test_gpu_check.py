"""bench/gpu_check.py on a machine without a GPU: it runs up to what needs one, says
so, and exits 0 with its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.worker.tensorrt.probe import probe

CHECK = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_without_a_gpu_the_check_reports_what_it_skipped(tmp_path: Path) -> None:
    if probe().ok:
        pytest.skip("a CUDA device answers here: the GPU check's own run covers it")
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(CHECK), "--out", str(report_path), "--no-bench"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    assert report["environment"]["status"] == "ok"
    assert report["probe"]["status"] == "skipped"
    for step in ("cuda[cuda-python]", "cuda[pycuda]", "gil", "pipeline", "tensorrt", "nvml"):
        assert report[step]["status"] == "skipped"
        assert report[step]["reason"].startswith("no GPU: ")
    assert report["benchmarks"] == {"status": "skipped", "reason": "--no-bench"}
    assert "skipped" in done.stdout
