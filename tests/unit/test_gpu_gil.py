"""bench/gpu_gil.py on a fake cuda-python runtime: the event wait it keeps as the
reference, and carpool's wait, make the calls they stand for (the figures themselves come
only from a GPU: bench/gpu_check.py runs it there); and its instrument on host waits."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench_scripts import BENCH, load_script
from tests.unit.worker.cuda_python_fake import FakeRuntime, installed

gil = load_script("gpu_gil.py")


def test_the_event_wait_then_carpools_wait_on_a_fake_runtime(monkeypatch):
    monkeypatch.setattr(gil, "CHUNK", 4096)
    monkeypatch.setattr(gil, "measure", lambda wait: (wait(), {"wait_ms": 1.0})[1])
    rt = FakeRuntime()
    with installed(rt):
        old = gil.before(rt)
        opened = len(rt.calls)
        new = gil.after(int(old["copies"]))
    assert old["copies"] == 300  # 0.3 s of the fake's 1 ms copies
    assert new == {"wait_ms": 1.0}
    names = [c[0] for c in rt.calls]
    before, after = names[:opened], names[opened:]
    assert "cudaSetDeviceFlags" not in before  # the default schedule
    assert before.count("cudaMemcpyAsync") == 301
    assert before[-3:] == ["cudaEventSynchronize", "cudaFreeHost", "cudaFree"]
    assert ("cudaSetDeviceFlags", 4) in rt.calls[opened:]
    assert after.count("cudaMemcpyAsync") == 300
    assert "cudaEventSynchronize" not in after
    assert "cudaStreamSynchronize" in after


def test_the_instrument_runs_without_a_gpu():
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_gil.py"), "--calibrate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["status"] == "ok"
    assert set(report) == {
        "status",
        "holds_gil_and_spins (sum)",
        "releases_gil_and_blocks (sleep)",
    }
