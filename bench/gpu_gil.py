"""gpu_gil.py: does waiting for a batch hold the GIL, or spin a core? Two waits compared.

    python bench/gpu_gil.py [--calibrate]

Prints one JSON line. bench/gpu_check.py runs it in a child process twice: on the
machine's CUDA binding, and on cuda-bindings 12.9.0 (carried in .whl/cb129, put first on
``PYTHONPATH``), whose ``cudaEventSynchronize`` holds the GIL.

Both halves wait for the same device work: copies of a pinned buffer to the device queued
on one stream, about 0.3 s of it.

- before (the event wait, kept here as the reference): ``cudaEventSynchronize`` on an
  event made with ``cudaEventCreate`` (default flags), under the device's default
  schedule (``cudaDeviceScheduleAuto``);
- after: carpool's :meth:`Cuda.wait <carpool.worker.cuda.base.Cuda.wait>` on a completion
  event (:class:`~carpool.worker.cuda.runtime.RuntimeCuda`).

While the main thread waits, a Python thread counts. ``ticks_ratio`` is its count during
the wait over its count in as long a time right after, while the main thread sleeps: near
1 when the wait released the GIL, near 0 when it held it. ``cpu_ratio`` is the waiting
thread's CPU time over the wait: near 1 when it spun, near 0 when it blocked.
``--calibrate`` runs the same instrument on two host waits instead, a C call that holds
the GIL and burns CPU (``sum`` over a range) and ``time.sleep``, and needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "src"))  # after PYTHONPATH: a carried binding comes first

WORK_S = 0.3
CHUNK = 64 << 20  # bytes per copy


class Ticker(threading.Thread):
    """Counts as fast as the GIL lets it."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.count = 0
        self.stopped = False

    def run(self) -> None:
        while not self.stopped:
            self.count += 1


def measure(wait: Callable[[], None]) -> dict[str, float]:
    """Run ``wait`` on this thread while a ticker counts (see the module docstring)."""
    ticker = Ticker()
    ticker.start()
    time.sleep(0.05)  # the ticker is running
    before, cpu0, t0 = ticker.count, time.thread_time(), time.perf_counter()
    wait()
    wall_s = time.perf_counter() - t0
    cpu_s, ticks = time.thread_time() - cpu0, ticker.count - before
    after = ticker.count
    time.sleep(wall_s)
    baseline = ticker.count - after
    ticker.stopped = True
    ticker.join()
    return {
        "wait_ms": round(1000 * wall_s, 1),
        "ticks_ratio": round(ticks / baseline, 3) if baseline else float("nan"),
        "cpu_ratio": round(cpu_s / wall_s, 3) if wall_s else float("nan"),
    }


def calibrate() -> dict[str, Any]:
    n = 1
    while True:  # a sum of about WORK_S
        t0 = time.perf_counter()
        sum(range(n))
        if time.perf_counter() - t0 > WORK_S / 4:
            break
        n *= 2

    def hold() -> None:
        sum(range(4 * n))  # one C call: no bytecode, so the GIL is never handed over

    return {
        "holds_gil_and_spins (sum)": measure(hold),
        "releases_gil_and_blocks (sleep)": measure(lambda: time.sleep(WORK_S)),
    }


def _runtime() -> tuple[Any, str]:
    try:
        import cuda.bindings as bindings
        from cuda.bindings import runtime

        return runtime, f"cuda-bindings {bindings.__version__}"
    except ImportError:
        from importlib.metadata import version

        from cuda import cudart

        return cudart, f"cuda-python {version('cuda-python')}"


def _ok(result: Any) -> Any:
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else values


def before(rt: Any) -> dict[str, float]:
    """The event wait, on the raw runtime under the default schedule."""
    _ok(rt.cudaSetDevice(0))
    host = _ok(rt.cudaMallocHost(CHUNK))
    device = _ok(rt.cudaMalloc(CHUNK))
    stream = _ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
    h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice

    def copy() -> None:
        _ok(rt.cudaMemcpyAsync(device, host, CHUNK, h2d, stream))

    start, end = _ok(rt.cudaEventCreate()), _ok(rt.cudaEventCreate())
    _ok(rt.cudaEventRecord(start, stream))
    copy()
    _ok(rt.cudaEventRecord(end, stream))
    _ok(rt.cudaStreamSynchronize(stream))
    copies = max(1, min(2000, round(WORK_S * 1000 / _ok(rt.cudaEventElapsedTime(start, end)))))
    event = _ok(rt.cudaEventCreate())  # the event wait's event: default flags

    def wait() -> None:
        for _ in range(copies):
            copy()
        _ok(rt.cudaEventRecord(event, stream))
        _ok(rt.cudaEventSynchronize(event))

    # (queueing the copies is part of what the ticker sees: microseconds each)
    out = measure(wait)
    out["copies"] = copies
    for ptr, free in ((host, rt.cudaFreeHost), (device, rt.cudaFree)):
        _ok(free(ptr))
    return out


def after(copies: int) -> dict[str, float]:
    """carpool's wait, through its CUDA layer."""
    from carpool.worker.cuda.runtime import open_runtime

    cuda = open_runtime(0)
    host, device, stream = cuda.pinned(CHUNK), cuda.device_buffer(CHUNK), cuda.stream()
    done = cuda.event(timing=False)

    def wait() -> None:
        for _ in range(copies):
            cuda.to_device(device, host, CHUNK, stream)
        cuda.record(done, stream)
        cuda.wait(done, stream)

    out = measure(wait)
    for buffer in (host, device):
        cuda.free(buffer)
    cuda.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calibrate", action="store_true", help="the instrument on host waits")
    args = p.parse_args(argv)
    if args.calibrate:
        print(json.dumps({"status": "ok", **calibrate()}))
        return 0
    try:
        rt, binding = _runtime()
    except ImportError as exc:
        print(json.dumps({"status": "skipped", "reason": f"no cuda-python: {exc}"}))
        return 0
    try:
        old = before(rt)
        new = after(int(old["copies"]))
    except Exception as exc:  # (a report, not a traceback: the parent records it)
        print(json.dumps({"status": "failed", "binding": binding, "reason": repr(exc)}))
        return 0
    print(json.dumps({"status": "ok", "binding": binding, "before": old, "after": new}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
