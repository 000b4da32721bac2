"""``carpool demo`` end to end: real subprocesses, real pages, real model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytest.importorskip("PIL")

DEMO_TIMEOUT_S = 120.0


def _leftovers(marker: str) -> list[psutil.Process]:
    """Processes whose command line mentions ``marker`` (our own temporary directory)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(proc)
    return found


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 30)
def test_demo_serves_every_frame_correctly(tmp_path: Path) -> None:
    # The demo puts its ipc:// endpoints in a temporary directory under TMPDIR, so every
    # process it starts names tmp_path on its command line: we can check none is left.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "carpool", "demo", "--duration-s", "3", "--cameras", "4"]
    demo = subprocess.Popen(
        [*command, "--fps", "10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = demo.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        demo.terminate()  # the demo stops its broker and workers on SIGTERM
        output, _ = demo.communicate(timeout=30)
        pytest.fail(f"the demo ran past {DEMO_TIMEOUT_S} s:\n{output}")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        stray = _leftovers(str(tmp_path))
        for proc in stray:
            proc.kill()
    assert not stray, f"the demo left processes running: {[p.pid for p in stray]}"

    assert demo.returncode == 0, output
    assert re.search(r"^requests sent:\s+120$", output, re.M), output
    assert re.search(r"^replies:\s+120$", output, re.M), output
    assert re.search(r"^errors:\s+none$", output, re.M), output
    assert re.search(r"^achieved QPS:\s+\d+\.\d$", output, re.M), output
    assert re.search(r"p50 \d+\.\d\s+p95 \d+\.\d\s+p99 \d+\.\d", output), output
    assert re.search(r"^batch sizes \(orientation\): \d+ batches", output, re.M), output
    assert re.search(r"^\s+size\s+\d+:\s+\d+ batches", output, re.M), output
    assert re.search(r"^worker rho:\s+cpu-0 \d\.\d\d, cpu-1 \d\.\d\d$", output, re.M), output
    assert "correct rotations: 120/120 (100.0%)" in output, output


def test_demo_rejects_bad_arguments() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "carpool", "demo", "--workers", "0", "--fps", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "workers must be > 0" in result.stderr
    assert "fps must be > 0" in result.stderr


@pytest.mark.timeout(30)
def test_a_child_that_does_not_stop_has_its_stacks_dumped_then_is_killed(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """So that the next one that will not stop says where it is stuck."""
    from carpool.demo import _reap

    stuck = (
        "import faulthandler, signal, sys, threading\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "def wait_forever():\n"
        "    threading.Event().wait()\n"
        "print('ready', flush=True)\n"
        "wait_forever()\n"
    )
    with subprocess.Popen([sys.executable, "-c", stuck], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        proc.terminate()  # ignored
        _reap("broker", proc, timeout_s=0.2)
    assert proc.returncode == -9  # killed, after the dump
    err = capfd.readouterr().err
    assert "broker did not stop within" in err
    assert "in wait_forever" in err  # the child's stack, on the shared stderr


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 30)
def test_the_ocr_scenario_reads_the_rendered_text(tmp_path: Path) -> None:
    # Two cameras (640x480 and 1280x720) for one tick: the 1080p camera's frames cost the
    # detector half a second each on this CPU (bench/ocr_buckets.py runs all three).
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "carpool", "demo", "--scenario", "ocr", "--cameras", "2"]
    result = subprocess.run(
        [*command, "--duration-s", "1", "--fps", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    output = result.stdout + result.stderr
    stray = _leftovers(str(tmp_path))
    for proc in stray:
        proc.kill()
    assert not stray, f"the demo left processes running: {[p.pid for p in stray]}"
    assert result.returncode == 0, output
    assert re.search(r"^requests sent:\s+14 \(ppocr-det 2, ppocr-rec 12\)$", output, re.M), output
    assert re.search(r"^replies:\s+14$", output, re.M), output
    assert re.search(r"^errors:\s+none$", output, re.M), output
    assert re.search(r"^latency ms \(frame\): p50 \d+\s+p95 \d+\s+p99 \d+$", output, re.M), output
    assert re.search(r"^batches \(ppocr-det\): \d+: ", output, re.M), output
    # The 720-row frame ran in its bucket, 736 rows: 16 of them padding.
    bucket = (
        r"^bucket \(ppocr-det 3x736x1280\): 1 batches, 1 samples, padded share of compute 2\.2%$"
    )
    assert re.search(bucket, output, re.M), output
    assert re.search(r"^bucket \(ppocr-rec 3x48x\d+\): \d+ batches", output, re.M), output
    assert re.search(r"^text read \(640x480\): 6 lines, \d exact, CER \d+\.\d%$", output, re.M)
    assert re.search(r"^text read \(1280x720\): 6 lines, ", output, re.M), output
    assert re.search(r"^text read \(all\):\s+12 lines, CER \d+\.\d%$", output, re.M), output
