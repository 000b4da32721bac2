"""gpu_probe.py: is there a CUDA device? Asked in a child process, before any TensorRT
object exists.

TensorRT's Runtime made without a usable GPU returns an object that crashes the
interpreter on first use (TensorRT 11's lean runtime) or raises from its constructor
(older releases); a broken driver can take down whatever process asks it first. So the
question goes to a short-lived child (:func:`probe_gpu`) that asks the CUDA runtime
through cuda-python (else pycuda) for its device count and prints one JSON line, which
:func:`parse_probe` reads — pure, and tested with recorded answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

#: What the child runs: one JSON line {"binding", "devices", "error"}.
PROBE = r"""
import json
out = {"binding": None, "devices": 0, "error": ""}
rt = None
try:
    from cuda.bindings import runtime as rt
except ImportError:
    try:
        from cuda import cudart as rt
    except ImportError:
        pass
if rt is not None:
    out["binding"] = "cuda-python"
    err, count = rt.cudaGetDeviceCount()
    if int(err):
        out["error"] = rt.cudaGetErrorName(err)[1].decode()
    else:
        out["devices"] = count
else:
    try:
        import pycuda.driver as drv
        out["binding"] = "pycuda"
        drv.init()
        out["devices"] = drv.Device.count()
    except ImportError:
        out["error"] = "no CUDA binding is installed (cuda-python or pycuda)"
    except Exception as exc:
        out["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
print(json.dumps(out))
"""

PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """The answer: how many devices, through which binding, or why none."""

    devices: int
    binding: str | None = None
    reason: str = ""  # why there is no device ("" when there is one)

    @property
    def ok(self) -> bool:
        return self.devices > 0


def parse_probe(returncode: int, stdout: str, stderr: str = "") -> GpuProbe:
    """What the child's exit status and output say."""
    if returncode < 0:
        return GpuProbe(0, reason=f"the CUDA probe crashed (signal {-returncode})")
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    try:
        answer = json.loads(line)
        devices, binding, error = answer["devices"], answer["binding"], answer["error"]
    except (ValueError, KeyError, TypeError):
        tail = (stderr.strip().splitlines() or [f"exit status {returncode}"])[-1]
        return GpuProbe(0, reason=f"the CUDA probe failed: {tail[:300]}")
    if not isinstance(devices, int) or devices < 0:
        return GpuProbe(0, reason=f"the CUDA probe answered {line[:300]}")
    if devices == 0:
        why = f"no CUDA device ({binding}: {error})" if binding else str(error)
        return GpuProbe(0, binding, why or "no CUDA device")
    return GpuProbe(devices, binding)


def probe_gpu(timeout_s: float = PROBE_TIMEOUT_S) -> GpuProbe:
    """Ask a child process for the CUDA devices (see the module docstring)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return GpuProbe(0, reason=f"the CUDA probe did not answer in {timeout_s:g} s")
    except OSError as exc:
        return GpuProbe(0, reason=f"the CUDA probe could not start: {exc}")
    return parse_probe(done.returncode, done.stdout, done.stderr)
