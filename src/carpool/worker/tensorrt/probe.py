"""probe.py: is there a GPU? Asked in a subprocess, before any TensorRT object exists.

A TensorRT Runtime or Builder made without a usable GPU can return a null-backed object
that crashes the interpreter on first use, so a worker or ``carpool build-engine`` asks
first, in a child process (a crash there is an answer, not the end of this process). The
child (:mod:`.probe_child`) asks CUDA, through the worker's own CUDA bindings in their
order, for the first device ``CUDA_VISIBLE_DEVICES`` leaves visible: its name, compute
capability, PCI bus id and UUID, and the binding's, CUDA runtime's and driver's versions.
:func:`parse` (pure) reads its one JSON line.

:func:`probe` is this process's answer: the child runs once, the first caller's answer is
logged once and kept, and every later caller (each TensorRT model's plan lookup, the
worker's telemetry, ``carpool build-engine``, bench/gpu_check.py) shares it.
:func:`run_probe` asks again, in the environment it is given.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from carpool.worker.tensorrt.device import Device, read_l4t

__all__ = ["GpuProbe", "ProbeCache", "parse", "probe", "run_probe"]

logger = logging.getLogger(__name__)

#: The child's source, run with ``python -c`` (nothing of carpool is imported there).
CHILD = Path(__file__).with_name("probe_child.py")
#: How long the child may take (the first CUDA call on a big machine takes seconds).
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """What the probe found: a device, or why there is none; the versions either way."""

    device: Device | None
    reason: str = ""  # why there is no GPU (empty when there is one)
    binding: str = ""  # "cuda-bindings 12.9.1", "cuda-python 12.6.0", "pycuda 2025.1"
    runtime: str = ""  # the binding's CUDA runtime, "12.9"
    driver: str = ""  # the CUDA version the driver supports, "12.6"; "" without a driver
    pci_bus_id: str = ""  # CUDA's name of the device's slot, "0000:65:00.0"
    uuid: str = ""  # as NVML writes it, "GPU-…"; "" where the binding gives none (pycuda)

    @property
    def ok(self) -> bool:
        return self.device is not None

    @property
    def via(self) -> str:
        """The binding's package: cuda-bindings, cuda-python or pycuda ("" for none)."""
        return self.binding.split(" ", 1)[0]


def _text(data: Mapping[str, object], key: str) -> str:
    value = data.get(key)
    return value if isinstance(value, str) else ""


def parse(returncode: int, stdout: str, l4t: str | None = None) -> GpuProbe:
    """The child's answer (its exit status and output) as a probe result."""
    last = stdout.strip().rsplit("\n", 1)[-1] if stdout.strip() else ""
    try:
        data = json.loads(last) if last else None
    except ValueError:
        data = None
    if returncode != 0 or not isinstance(data, dict):
        return GpuProbe(None, f"the GPU probe exited with status {returncode} and no answer")
    told = {key: _text(data, key) for key in ("binding", "runtime", "driver")}
    if "error" in data:
        return GpuProbe(None, f"no GPU found ({data['error']})", **told)
    cc = data.get("cc")
    name = data.get("name")
    if not (isinstance(name, str) and isinstance(cc, list) and len(cc) == 2):
        return GpuProbe(None, f"the GPU probe answered {last!r}", **told)
    device = Device(name, (int(cc[0]), int(cc[1])), l4t)
    return GpuProbe(device, **told, pci_bus_id=_text(data, "pci_bus_id"), uuid=_text(data, "uuid"))


def run_probe(timeout_s: float = PROBE_TIMEOUT_S, env: Mapping[str, str] | None = None) -> GpuProbe:
    """Ask a child process for the first visible GPU (with this machine's L4T release).

    Args:
        timeout_s: how long the child may take.
        env: the child's environment (None: this process's).
    """
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD.read_text(encoding="utf-8")],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=None if env is None else dict(env),
        )
    except subprocess.TimeoutExpired:
        return GpuProbe(None, f"the GPU probe did not answer within {timeout_s:g} s")
    except OSError as exc:
        return GpuProbe(None, f"the GPU probe could not start: {exc}")
    return parse(done.returncode, done.stdout, read_l4t())


def describe(found: GpuProbe) -> str:
    """One line for the log: the GPU and the CUDA it is reached through, or why none."""
    cuda = f"CUDA runtime {found.runtime or '?'}, driver {found.driver or 'none'}"
    if found.device is None:
        return f"{found.reason}; {cuda}" if found.binding else found.reason
    major, minor = found.device.compute_capability
    slot = f", PCI {found.pci_bus_id}" if found.pci_bus_id else ""
    return f"GPU: {found.device.name} (sm_{major}{minor}{slot}) through {found.binding}: {cuda}"


def _level(found: GpuProbe) -> int:
    """INFO for a GPU; WARNING where a binding imports but no device answers; DEBUG where
    no binding is installed (a host without a GPU: nothing to act on)."""
    if found.ok:
        return logging.INFO
    return logging.WARNING if found.binding else logging.DEBUG


class ProbeCache:
    """The probe's answer, asked once: the first caller runs ``run``, logs the answer (at
    :func:`_level`) and keeps it; callers meanwhile wait for it."""

    def __init__(self, run: Callable[[], GpuProbe] = run_probe) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._found: GpuProbe | None = None  # guarded by _lock

    def get(self) -> GpuProbe:
        with self._lock:
            if self._found is None:
                self._found = found = self._run()
                logger.log(_level(found), "%s", describe(found))
            return self._found


_SHARED = ProbeCache()


def probe() -> GpuProbe:
    """This process's answer: the child runs at the first call only."""
    return _SHARED.get()
