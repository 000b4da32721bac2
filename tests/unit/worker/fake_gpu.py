# ruff: noqa: N802  (the fakes keep the real APIs' names)
"""Fakes of the GPU APIs the probe and the telemetry ask, for machines without a GPU.

:func:`install` writes fake ``cuda`` (cuda-python, either import layout), ``pycuda`` and
``pynvml`` packages into a folder and gives the environment that puts it first on a child
process's path; a binding left out is written as a package that fails to import, so the
child sees none of this machine's own. The fake CUDA knows a list of physical devices
(:class:`Gpu`) and, like the driver, shows only those ``CUDA_VISIBLE_DEVICES`` names,
renumbered from 0; its runtime fails with cudaErrorInsufficientDriver (35) where the
runtime is a newer CUDA major than the driver. The fake ``pynvml``, like NVML, ignores
``CUDA_VISIBLE_DEVICES``.
:class:`FakeNvml` is NVML for this process: a module-like object that records its calls.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

MIB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    """A physical device, as CUDA and NVML describe it."""

    name: str
    cc: tuple[int, int]
    pci: str  # CUDA's form, "0000:17:00.0"
    uuid: str  # 32 hex digits
    used_mib: int = 1024
    total_mib: int = 81920
    util_pct: int = 0

    @property
    def nvml_uuid(self) -> str:
        u = self.uuid
        return f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"


H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), "0000:17:00.0", "1" * 32, 2048, 81559, 11)
L4 = Gpu("NVIDIA L4", (8, 9), "0000:65:00.0", "abcdef01" * 4, 9000, 23034, 77)


@dataclass
class Cuda:
    """What the fake CUDA install says: its devices and versions."""

    devices: list[Gpu] = field(default_factory=lambda: [H100, L4])
    runtime: int = 12090  # cudaRuntimeGetVersion
    driver: int = 12060  # cudaDriverGetVersion; 0: no driver
    version: str = "12.9.1"  # the binding's __version__
    raises: str = ""  # the RuntimeError cuda-python 12.6.0 raises without a driver


# The runtime API of cuda-python, as cuda.bindings.runtime or cuda.cudart.
_RUNTIME = r"""
import enum, json, os
from types import ModuleType, SimpleNamespace

class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100
    cudaErrorInvalidDevice = 101

_C = json.loads(os.environ["FAKE_CUDA"])
OK = cudaError_t.cudaSuccess

def _driver():
    if _C["raises"]:
        raise RuntimeError(_C["raises"])

def _visible():
    devices = _C["devices"]
    told = os.environ.get("CUDA_VISIBLE_DEVICES")
    if told is None:
        return devices
    seen = []
    for item in told.split(","):  # the driver stops at the first invalid entry
        if not item.strip().isdigit() or int(item) >= len(devices):
            break
        seen.append(devices[int(item)])
    return seen

def cudaRuntimeGetVersion():
    return OK, _C["runtime"]

def cudaDriverGetVersion():
    _driver()
    return OK, _C["driver"]

def cudaGetDeviceCount():  # the count is None on an error (cuda-bindings 12.9, 13)
    _driver()
    if _C["runtime"] // 1000 > _C["driver"] // 1000:
        return cudaError_t.cudaErrorInsufficientDriver, None
    n = len(_visible())
    return (OK, n) if n else (cudaError_t.cudaErrorNoDevice, None)

def cudaGetDeviceProperties(device):
    d = _visible()[device]
    uuid = SimpleNamespace(bytes=bytes.fromhex(d["uuid"]))
    name = d["name"].encode().ljust(256, b"\0")
    return OK, SimpleNamespace(name=name, major=d["cc"][0], minor=d["cc"][1], uuid=uuid)

def cudaDeviceGetPCIBusId(length, device):
    return OK, _visible()[device]["pci"].encode().ljust(length, b"\0")
"""

_PYCUDA_DRIVER = r"""
import json, os

_C = json.loads(os.environ["FAKE_CUDA"])

class Error(Exception):
    pass

class RuntimeError(Error):
    pass

def _visible():
    devices = _C["devices"]
    told = os.environ.get("CUDA_VISIBLE_DEVICES")
    if told is None:
        return devices
    return [devices[int(i)] for i in told.split(",") if i.strip().isdigit()]

def get_version():
    return (_C["runtime"] // 1000, _C["runtime"] % 1000 // 10, 0)

def get_driver_version():
    return _C["driver"]

def init(flags=0):
    if not _visible():
        raise RuntimeError("cuInit failed: no CUDA-capable device is detected")

class Device:
    def __init__(self, index):
        self._d = _visible()[index]

    @staticmethod
    def count():
        return len(_visible())

    def name(self):
        return self._d["name"]

    def compute_capability(self):
        return tuple(self._d["cc"])

    def pci_bus_id(self):
        return self._d["pci"]
"""

# pynvml in a child: every physical device, in its order, whatever CUDA_VISIBLE_DEVICES says.
_PYNVML = r"""
import json, os

_C = json.loads(os.environ["FAKE_CUDA"])

class NVMLError(Exception):
    pass

def nvmlInit():
    pass

def nvmlDeviceGetCount():
    return len(_C["devices"])

def nvmlDeviceGetHandleByIndex(index):
    return _C["devices"][index]

def nvmlDeviceGetName(handle):
    return handle["name"]

def nvmlDeviceGetCudaComputeCapability(handle):
    return tuple(handle["cc"])
"""


def _absent(package: str) -> str:
    """A package's ``__init__.py`` whose import fails as an absent package's does."""
    return f"raise ModuleNotFoundError(\"No module named '{package}'\", name={package!r})\n"


def _distribution(name: str, version: str) -> dict[str, str]:
    """The metadata ``importlib.metadata.version(name)`` reads."""
    folder = f"{name.replace('-', '_')}-{version}.dist-info"
    return {f"{folder}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"}


def _config(cuda: Cuda) -> str:
    return json.dumps({**asdict(cuda), "devices": [asdict(d) for d in cuda.devices]})


def install(
    root: Path,
    cuda: Cuda | None = None,
    *,
    layout: str | None = "bindings",
    pycuda: bool = False,
    pynvml: bool = False,
    visible: str | None = None,
) -> dict[str, str]:
    """Write the fake packages under ``root`` and return a child's environment for them.

    Args:
        cuda: the devices and versions (the default: an H100 and an L4, CUDA 12.9 on a
            12.6 driver).
        layout: "bindings" (``cuda.bindings.runtime``, cuda-python ≥ 12.6.1), "cudart"
            (``cuda.cudart``, before), or None (no cuda-python: a ``cuda`` package whose
            import fails as a missing one's, hiding any of this machine's).
        pycuda: write pycuda too (else a ``pycuda`` that fails to import, as ``cuda``).
        pynvml: write pynvml too.
        visible: ``CUDA_VISIBLE_DEVICES`` (None: unset).
    """
    cuda = cuda or Cuda()
    files: dict[str, str] = {}
    # ``cuda`` and ``pycuda`` are always regular packages, so that they are the only ones
    # the child imports: a namespace package gives way to a regular one later on the path
    # (cuda-python 12.6.x ships cuda/__init__.py), and without either package the
    # machine's own binding would be found.
    # Each with its distribution's metadata, found before any of this machine's.
    if layout == "bindings":
        files["cuda/__init__.py"] = ""
        files["cuda/bindings/__init__.py"] = f"__version__ = {cuda.version!r}\n"
        files["cuda/bindings/runtime.py"] = _RUNTIME
        files["cuda/bindings/driver.py"] = ""
        files.update(_distribution("cuda-bindings", cuda.version))
    elif layout == "cudart":
        files["cuda/__init__.py"] = f"__version__ = {cuda.version!r}\n"
        files["cuda/cudart.py"] = _RUNTIME
        files["cuda/cuda.py"] = ""
        files.update(_distribution("cuda-python", cuda.version))
    else:  # no cuda-python: its import fails as where it is not installed
        files["cuda/__init__.py"] = _absent("cuda")
    if pycuda:
        files["pycuda/__init__.py"] = "VERSION_TEXT = '2025.1'\n"
        files["pycuda/driver.py"] = _PYCUDA_DRIVER
    else:
        files["pycuda/__init__.py"] = _absent("pycuda")
    if pynvml:
        files["pynvml.py"] = _PYNVML
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    # The fakes first on the path; no user site.
    env["PYTHONPATH"] = str(root)
    env["PYTHONNOUSERSITE"] = "1"
    env["FAKE_CUDA"] = _config(cuda)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


class NVMLError(Exception):
    """pynvml's base error."""


def runtime_module(cuda: Cuda | None = None) -> Any:
    """The fake runtime module in this process (``FAKE_CUDA`` is read when it is made;
    ``CUDA_VISIBLE_DEVICES`` at each call)."""
    module = ModuleType("fake_cuda_runtime")
    saved = os.environ.get("FAKE_CUDA")
    os.environ["FAKE_CUDA"] = _config(cuda or Cuda())
    try:
        exec(_RUNTIME, module.__dict__)
    finally:
        if saved is None:
            del os.environ["FAKE_CUDA"]
        else:
            os.environ["FAKE_CUDA"] = saved
    return module


class FakeNvml:
    """NVML (pynvml's functions) over ``devices``, which it numbers in their order and
    sees whatever ``CUDA_VISIBLE_DEVICES`` says; each call is recorded."""

    NVMLError = NVMLError

    def __init__(self, devices: list[Gpu], *, utilization: bool = True) -> None:
        self.devices = devices
        self.utilization = utilization  # False: as under MIG, utilization is not supported
        self.calls: list[tuple[str, Any]] = []

    def _record(self, call: str, arg: Any = None) -> None:
        self.calls.append((call, arg))

    def nvmlInit(self) -> None:
        self._record("nvmlInit")

    def nvmlDeviceGetCount(self) -> int:
        self._record("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Gpu:
        self._record("nvmlDeviceGetHandleByIndex", index)
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Gpu:
        self._record("nvmlDeviceGetHandleByUUID", uuid)
        for gpu in self.devices:
            if gpu.nvml_uuid == uuid:
                return gpu
        raise NVMLError("Not Found")

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> Gpu:
        self._record("nvmlDeviceGetHandleByPciBusId", bus)
        for gpu in self.devices:
            if _slot(gpu.pci) == _slot(bus):
                return gpu
        raise NVMLError("Not Found")

    def nvmlShutdown(self) -> None:
        self._record("nvmlShutdown")

    def nvmlDeviceGetName(self, gpu: Gpu) -> str:
        return gpu.name

    def nvmlDeviceGetUUID(self, gpu: Gpu) -> str:
        return gpu.nvml_uuid

    def nvmlDeviceGetMemoryInfo(self, gpu: Gpu) -> Any:
        return SimpleNamespace(used=gpu.used_mib * MIB, total=gpu.total_mib * MIB)

    def nvmlDeviceGetUtilizationRates(self, gpu: Gpu) -> Any:
        if not self.utilization:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=gpu.util_pct, memory=0)


def _slot(bus: str) -> tuple[int, ...]:
    """A PCI bus id's numbers ("0000:65:00.0" and NVML's "00000000:65:00.0" are one)."""
    domain, rest = bus.split(":", 1)
    b, dev_fn = rest.split(":")
    d, fn = dev_fn.split(".")
    return tuple(int(x, 16) for x in (domain, b, d, fn))
