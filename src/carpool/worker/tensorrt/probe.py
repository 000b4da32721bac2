"""probe.py: is there a GPU? Asked in a subprocess, before any TensorRT object exists.

A TensorRT Runtime or Builder made without a usable GPU can return a null-backed object
that crashes the interpreter on first use, so a worker or ``carpool build-engine`` asks
first, in a child process (a crash there is an answer, not the end of this process):
NVML (nvidia-ml-py) where it answers, as on GPU servers; else the CUDA driver through
cuda-python (``cuDeviceGetCount``), as on a Jetson, whose iGPU has no NVML; else pycuda,
which some Jetson setups have instead. The child prints one JSON line; :func:`parse`
(pure) reads it. The worker's fallback, ``carpool build-engine`` and bench/gpu_check.py
all ask through :func:`probe`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from carpool.worker.tensorrt.cache import Device, read_l4t

__all__ = ["GpuProbe", "parse", "probe"]

# Runs in the child: the first GPU's name and compute capability, or why there is none.
_CHILD = r"""
import json

def nvml():
    import pynvml
    pynvml.nvmlInit()
    if pynvml.nvmlDeviceGetCount() < 1:
        raise RuntimeError("NVML sees no GPU")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(h)
    name = name.decode() if isinstance(name, bytes) else name
    return name, list(pynvml.nvmlDeviceGetCudaComputeCapability(h))

def cuda():
    from cuda.bindings import driver as cu
    def ok(result):
        err, *rest = result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(err.name)
        return rest[0] if len(rest) == 1 else rest
    ok(cu.cuInit(0))
    if ok(cu.cuDeviceGetCount()) < 1:
        raise RuntimeError("the CUDA driver sees no GPU")
    dev = ok(cu.cuDeviceGet(0))
    name = ok(cu.cuDeviceGetName(64, dev)).split(b"\0", 1)[0].decode()
    attr = cu.CUdevice_attribute
    major = attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    minor = attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
    return name, [ok(cu.cuDeviceGetAttribute(major, dev)), ok(cu.cuDeviceGetAttribute(minor, dev))]

def pycuda():
    import pycuda.driver as drv
    drv.init()
    if drv.Device.count() < 1:
        raise RuntimeError("pycuda sees no GPU")
    dev = drv.Device(0)
    return dev.name(), list(dev.compute_capability())

why = []
ways = [("nvml", nvml, "nvidia-ml-py"), ("cuda", cuda, "cuda-python")]
for via, ask, package in ways + [("pycuda", pycuda, "pycuda")]:
    try:
        name, cc = ask()
    except ImportError:
        why.append(f"{package} is not installed")
    except Exception as exc:
        why.append(f"{via}: {type(exc).__name__}: {exc}")
    else:
        print(json.dumps({"name": name, "cc": cc, "via": via}))
        break
else:
    print(json.dumps({"error": "; ".join(why)}))
"""


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """What the probe found: a device, or why there is none."""

    device: Device | None
    reason: str = ""  # why there is no GPU (empty when there is one)
    via: str = ""  # nvml | cuda | pycuda

    @property
    def ok(self) -> bool:
        return self.device is not None


def parse(returncode: int, stdout: str, l4t: str | None = None) -> GpuProbe:
    """The child's answer (its exit status and output) as a probe result."""
    last = stdout.strip().rsplit("\n", 1)[-1] if stdout.strip() else ""
    try:
        data = json.loads(last) if last else None
    except ValueError:
        data = None
    if returncode != 0 or not isinstance(data, dict):
        return GpuProbe(None, f"the GPU probe exited with status {returncode} and no answer")
    if "error" in data:
        return GpuProbe(None, f"no GPU found ({data['error']})")
    cc = data.get("cc")
    name = data.get("name")
    if not (isinstance(name, str) and isinstance(cc, list) and len(cc) == 2):
        return GpuProbe(None, f"the GPU probe answered {last!r}")
    return GpuProbe(Device(name, (int(cc[0]), int(cc[1])), l4t), via=str(data.get("via", "")))


def probe(timeout_s: float = 30.0) -> GpuProbe:
    """Ask a child process for the first GPU (with this machine's L4T release)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return GpuProbe(None, f"the GPU probe did not answer within {timeout_s:g} s")
    except OSError as exc:
        return GpuProbe(None, f"the GPU probe could not start: {exc}")
    return parse(done.returncode, done.stdout, read_l4t())
