"""gpu_check.py: one command that checks carpool's GPU side on a GPU machine.

    python bench/gpu_check.py [--out bench/out/gpu_check.json] [--no-bench]

In order, each step recorded as ok, skipped (with the reason) or failed, the report
written after each:

1. environment: which of the packages involved import, and the cores;
2. probe: the worker's GPU probe (a child process asks the CUDA binding: the device's
   name, compute capability, PCI bus id and UUID; the binding, CUDA runtime and driver);
3. cuda: each CUDA binding of the worker's CUDA layer that opens: pinned buffers, async
   copies both ways (bandwidth from CUDA events), events;
4. gil: the batch wait before (cudaEventSynchronize on a default event) and after
   (carpool's Cuda.wait), on the machine's binding and on cuda-bindings 12.9.0 where
   carried (bench/gpu_gil.py, in a child);
5. nvml: NVML opened by the probe's UUID (else PCI bus id), as the worker opens it: its
   name and UUID against CUDA's, memory and utilization idle and after the pipeline; and
   the probe with ``CUDA_VISIBLE_DEVICES`` empty, which must find no GPU;
6. pipeline: the TensorRT engine's CUDA pipeline with a CuPy kernel standing in for
   TensorRT (bench/gpu_standin.py): outputs checked, batches on one context and on two
   (copy/compute overlap), GPU busy time from events against the wall clock (ρ);
7. tensorrt: whether tensorrt imports; no real plan is built or run by this check;
8. benchmarks: bench/broker_ceiling.py and bench/added_latency.py in their quick modes
   (with a core per process: skipped on fewer than 8 cores).

Without a GPU, steps 3-7 are skipped, saying so, and it still exits 0 with its report.
It fits in 4 minutes. bench/gpu_check.sh installs the carried wheels first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from carpool.worker.cuda import open_cuda  # noqa: E402
from carpool.worker.cuda.base import CudaUnavailable  # noqa: E402
from carpool.worker.telemetry.nvml import PynvmlReader  # noqa: E402
from carpool.worker.telemetry.nvml import parse as nvml_fields  # noqa: E402
from carpool.worker.tensorrt.probe import GpuProbe, probe, run_probe  # noqa: E402

Step = dict[str, Any]
PACKAGES = ("cuda.bindings", "pycuda", "cupy", "tensorrt", "pynvml", "onnxruntime", "zmq")


def skipped(reason: str) -> Step:
    return {"status": "skipped", "reason": reason}


def _has(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def environment() -> Step:
    return {
        "status": "ok",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "imports": {name: _has(name) for name in PACKAGES},
    }


def cuda_layer(binding: str) -> Step:
    try:
        cuda = open_cuda(0, (binding,))
    except CudaUnavailable as exc:
        return skipped(str(exc))
    try:
        nbytes = 64 << 20
        src, dst, dev = cuda.pinned(nbytes), cuda.pinned(nbytes), cuda.device_buffer(nbytes)
        src.array[:] = np.arange(nbytes, dtype=np.uint8)  # (it wraps at 256)
        stream, a, b, c = cuda.stream(), cuda.event(), cuda.event(), cuda.event()
        cuda.record(a, stream)
        cuda.to_device(dev, src, nbytes, stream)
        cuda.record(b, stream)
        cuda.to_host(dst, dev, nbytes, stream)
        cuda.record(c, stream)
        cuda.synchronize(stream)
        same = bool(np.array_equal(src.array, dst.array))
        h2d_s, d2h_s = cuda.elapsed_s(a, b), cuda.elapsed_s(b, c)
        for buffer in (src, dst, dev):
            cuda.free(buffer)
        return {
            "status": "ok" if same else "failed",
            "round_trip_equal": same,
            "h2d_GBps": round(nbytes / h2d_s / 1e9, 2),
            "d2h_GBps": round(nbytes / d2h_s / 1e9, 2),
        }
    finally:
        cuda.close()


def pipeline(batches: int = 40) -> Step:
    if not _has("cupy"):
        return skipped("CuPy does not import: no stand-in kernel")
    try:
        cuda = open_cuda(0)
    except CudaUnavailable as exc:
        return skipped(str(exc))
    from gpu_standin import StandinPlan

    from carpool.worker.engines.trt import TensorRTEngine

    out: Step = {"status": "ok", "batches": batches}
    plan = StandinPlan()
    x = np.random.default_rng(0).random((plan.max_batch, plan.width), dtype=np.float32)
    for contexts in (1, 2):
        engine = TensorRTEngine(plan, cuda, contexts=contexts, owns_cuda=False)
        engine.run({"x": x})  # warm-up (the kernel compiles)
        busy0, t0 = engine.busy_s(), time.perf_counter()
        pending = [engine.enqueue({"x": x}) for _ in range(batches)]
        ys = [p.result()["y"] for p in pending]
        wall_s = time.perf_counter() - t0
        busy_s = engine.busy_s() - busy0
        right = all(np.allclose(y, 2 * x + 1) for y in ys)
        out[f"contexts_{contexts}"] = {
            "outputs_right": right,
            "wall_ms_per_batch": round(1000 * wall_s / batches, 3),
            "gpu_busy_ms_per_batch": round(1000 * busy_s / batches, 3),
            "rho": round(busy_s / wall_s, 3),
        }
        if not right:
            out["status"] = "failed"
        engine.close()
    cuda.close()
    one, two = out["contexts_1"]["wall_ms_per_batch"], out["contexts_2"]["wall_ms_per_batch"]
    out["two_contexts_speedup"] = round(one / two, 3) if two else None
    return out


def tensorrt_engine() -> Step:
    if not _has("tensorrt"):
        return skipped("tensorrt does not import: TensorRT is not installed on this machine")
    return skipped(
        "tensorrt imports, but this check never builds or runs a real plan: run "
        "`carpool build-engine` and a worker on it (docs/gpu.md, 'Serving a plan')"
    )


def gil(old_binding: Path | None) -> Step:
    """bench/gpu_gil.py in a child: the instrument on host waits, then the batch wait
    before and after on the machine's binding, and on ``old_binding`` (a folder holding
    cuda-bindings 12.9.0, whose cudaEventSynchronize holds the GIL) where given."""
    out: Step = {"status": "ok"}
    runs: list[tuple[str, list[str], str]] = [("calibration", ["--calibrate"], "")]
    runs.append(("machine_binding", [], ""))
    if old_binding is None or not old_binding.is_dir():
        out["cuda-bindings 12.9.0"] = skipped(f"no carried binding at {old_binding}")
    else:
        runs.append(("cuda-bindings 12.9.0", [], str(old_binding)))
    for name, args, first in runs:
        path = os.pathsep.join(p for p in (first, os.environ.get("PYTHONPATH", "")) if p)
        try:
            done = subprocess.run(
                [sys.executable, str(ROOT / "bench" / "gpu_gil.py"), *args],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                env={**os.environ, "PYTHONPATH": path},
            )
            lines = done.stdout.strip().splitlines()
            out[name] = json.loads(lines[-1]) if lines else {"status": "failed"}
            if done.returncode or not lines:
                out[name]["stderr"] = done.stderr[-2000:]
        except (subprocess.TimeoutExpired, ValueError) as exc:
            out[name] = {"status": "failed", "reason": repr(exc)}
        if out[name].get("status") == "failed":
            out["status"] = "failed"
    out["verdicts"] = verdicts(out)
    if not all(out["verdicts"].values()):
        out["status"] = "failed"
    return out


def verdicts(runs: Step) -> dict[str, bool]:
    """What the gil step's figures must show (each False fails the step): the instrument
    tells a GIL-holding, spinning wait from a sleeping one; the carried binding is the one
    that ran, and its event wait held the GIL; carpool's wait let the thread run and did
    not spin, on every binding."""
    out: dict[str, bool] = {}
    cal = runs.get("calibration", {})
    if cal.get("status") == "ok":
        held, slept = cal["holds_gil_and_spins (sum)"], cal["releases_gil_and_blocks (sleep)"]
        out["instrument"] = held["ticks_ratio"] < 0.2 < 0.5 < slept["ticks_ratio"] and (
            held["cpu_ratio"] > 0.7 > 0.2 > slept["cpu_ratio"]
        )
    old = runs.get("cuda-bindings 12.9.0", {})
    if old.get("status") == "ok":
        out["12.9.0 ran"] = old.get("binding") == "cuda-bindings 12.9.0"
        out["12.9.0 event wait held the GIL"] = old["before"]["ticks_ratio"] < 0.2
    for name in ("machine_binding", "cuda-bindings 12.9.0"):
        run = runs.get(name, {})
        if run.get("status") == "ok":
            after = run["after"]
            out[f"{name}: Cuda.wait let Python run"] = after["ticks_ratio"] > 0.5
            out[f"{name}: Cuda.wait did not spin"] = after["cpu_ratio"] < 0.3
    return out


def nvml(found: GpuProbe, during: Callable[[], Step] | None = None) -> tuple[Step, Step | None]:
    """NVML opened as the worker opens it (by CUDA's UUID, else PCI bus id), against what
    CUDA named, idle and after ``during``; and the probe with no visible device."""
    hidden = run_probe(env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    no_device = {"found_gpu": hidden.ok, "reason": hidden.reason}

    def without_nvml(why: str) -> tuple[Step, Step | None]:
        step = skipped(why)
        if hidden.ok:  # (the probe's half of the step stands without NVML)
            step = {"status": "failed", "reason": "a GPU found with none visible; " + why}
        return {**step, "no_visible_device": no_device}, during() if during else None

    if not _has("pynvml"):
        return without_nvml("nvidia-ml-py does not import")
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return without_nvml(f"NVML: {exc}")
    ran: list[Step] = []  # the pipeline's step, once it ran

    def run_during() -> Step | None:
        if during is not None and not ran:
            ran.append(during())
        return ran[0] if ran else None

    try:
        step = _nvml_step(pynvml, found, hidden.ok, run_during)
    except pynvml.NVMLError as exc:
        step = {"status": "failed", "reason": f"NVML: {exc!r}"}
    finally:
        pynvml.nvmlShutdown()
    return {**step, "no_visible_device": no_device}, run_during()


def _nvml_step(
    pynvml: Any, found: GpuProbe, hidden_found: bool, run_during: Callable[[], Step | None]
) -> Step:
    reader = PynvmlReader.open(pynvml, found.uuid, found.pci_bus_id)
    first = pynvml.nvmlDeviceGetHandleByIndex(0)
    step: Step = {
        "status": "ok",
        "cuda": {"uuid": found.uuid, "pci_bus_id": found.pci_bus_id},
        "nvml_devices": pynvml.nvmlDeviceGetCount(),
        "nvml_index_0_uuid": _text(pynvml.nvmlDeviceGetUUID(first)),
    }
    if hidden_found:
        step["status"] = "failed"  # the probe found a GPU that CUDA was told to hide
    if reader is None:
        step["status"] = "failed"
        step["reason"] = "NVML did not open CUDA's device (the worker's log says why)"
        return step

    def read() -> dict[str, Any]:
        return nvml_fields(reader.memory(), reader.utilization())

    handle = reader.handle
    step.update(
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        cuda_name=None if found.device is None else found.device.name,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        idle=read(),
    )
    step["same_device"] = step["uuid"] == found.uuid or not found.uuid
    if not step["same_device"]:
        step["status"] = "failed"
    run_during()
    step["after_pipeline"] = read()
    return step


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def benchmarks(enabled: bool) -> Step:
    cores = os.cpu_count() or 1
    if not enabled:
        return skipped("--no-bench")
    if cores < 8:
        return skipped(f"needs a core per process; this machine has {cores}")
    if not _has("zmq"):
        return skipped("pyzmq does not import (bench/gpu_check.sh installs the carried wheels)")
    out: Step = {"status": "ok"}
    path = f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"
    for script in ("broker_ceiling.py", "added_latency.py"):
        try:
            done = subprocess.run(
                [sys.executable, str(ROOT / "bench" / script), "--quick"],
                capture_output=True,
                text=True,
                timeout=100,
                check=False,
                env={**os.environ, "PYTHONPATH": path},
            )
            out[script] = {"rc": done.returncode, "output": done.stdout[-4000:]}
            if done.returncode:
                out[script]["stderr"] = done.stderr[-2000:]
                out["status"] = "failed"
        except subprocess.TimeoutExpired:
            out[script] = {"rc": None, "output": "timed out after 100 s"}
            out["status"] = "failed"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu_check.json")
    p.add_argument("--no-bench", action="store_true", help="skip the two CPU benchmarks")
    p.add_argument(
        "--old-binding",
        type=Path,
        default=Path("/tmp/carpool-cb129"),
        help="a folder with cuda-bindings 12.9.0 installed (bench/gpu_check.sh makes it)",
    )
    args = p.parse_args(argv)
    start = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Step] = {}

    def record(name: str, step: Step) -> None:
        """Keep ``step`` and write the report so far (a run cut short still leaves one)."""
        report[name] = step
        report["elapsed_s"] = {"status": "ok", "value": round(time.perf_counter() - start, 1)}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"{name:20} {step['status']:8} {step.get('reason', '')}", flush=True)

    record("environment", environment())
    found = probe()
    record(
        "probe",
        {
            "status": "ok" if found.ok else "skipped",
            "gpu": None if found.device is None else found.device.name,
            "compute_capability": None if found.device is None else found.device.compute_capability,
            "pci_bus_id": found.pci_bus_id,
            "uuid": found.uuid,
            "binding": found.binding,
            "cuda_runtime": found.runtime,
            "cuda_driver": found.driver,
            "reason": found.reason,
        },
    )
    if found.ok:
        for binding in ("cuda-python", "pycuda"):
            record(f"cuda[{binding}]", cuda_layer(binding))
        record("gil", gil(args.old_binding))
        step, piped = nvml(found, pipeline)
        record("nvml", step)
        record("pipeline", piped or skipped("not run"))
        record("tensorrt", tensorrt_engine())
    else:
        why = f"no GPU: {found.reason}"
        for name in ("cuda[cuda-python]", "cuda[pycuda]", "gil", "pipeline", "tensorrt", "nvml"):
            record(name, skipped(why))
    record("benchmarks", benchmarks(not args.no_bench))
    print(f"report: {args.out}")
    failed = [n for n, s in report.items() if s["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
