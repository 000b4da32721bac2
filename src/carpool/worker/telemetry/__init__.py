"""telemetry: what a worker reports of its host and device (docs/protocol.md §8.2).

:class:`TelemetrySampler` takes one :class:`~carpool.common.protocol.Telemetry` sample:
the host's CPU and memory from psutil, always; the GPU from NVML (nvml.py) on a dGPU, or
from the Jetson's devfreq load (jetson.py) with the unified memory from psutil; and the
CUDA binding, runtime and driver versions the GPU probe found. The worker core asks for a
sample at heartbeat cadence, never per batch (``psutil.cpu_percent(interval=None)``
compares with the last call and does not wait).

:meth:`TelemetrySampler.detect` picks the sources once, at start. The worker's GPU is the
one CUDA names (the probe, :mod:`carpool.worker.tensorrt.probe`, which honours
``CUDA_VISIBLE_DEVICES``); NVML is opened by its UUID or PCI bus id. Where there is no
CUDA binding to ask (a worker on onnxruntime-gpu alone), NVML's device 0 is the worker's
when it is the only GPU NVML sees and ``CUDA_VISIBLE_DEVICES`` is unset; otherwise NVML's
numbering, which is not CUDA's, cannot tell which GPU is, and none is reported. The
probe's child runs only where there may be a GPU (NVML sees one, a Jetson load file
exists, or a CUDA binding is installed), so a worker on a plain host starts no process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from carpool.common.protocol import Telemetry
from carpool.worker.telemetry import jetson, nvml
from carpool.worker.tensorrt.probe import GpuProbe, probe

logger = logging.getLogger(__name__)

__all__ = ["TelemetrySampler"]

_MIB = 1 << 20
#: The CUDA bindings' modules: cuda-python's (either layout) and pycuda's (carpool.worker.cuda).
#: Not ``cuda`` alone: other packages (cuda-pathfinder, which CuPy installs) share that name.
_BINDING_MODULES = ("cuda.bindings", "cuda.cudart", "pycuda")


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that fails to import, or has no spec
        return False


def cuda_binding_installed() -> bool:
    """Whether a CUDA binding's module is there (found; only a parent package imported)."""
    return any(_found(name) for name in _BINDING_MODULES)


def _open_nvml(
    module: Any, nvml_gpus: int, found: GpuProbe, environ: Mapping[str, str]
) -> nvml.PynvmlReader | None:
    """NVML's reader for the worker's GPU: the one CUDA named; where no CUDA binding is
    there to name one, NVML's device 0 if it is NVML's only one and
    ``CUDA_VISIBLE_DEVICES`` is unset; else None."""
    if found.ok:
        return nvml.PynvmlReader.open(module, found.uuid, found.pci_bus_id)
    if not found.binding and nvml_gpus == 1 and "CUDA_VISIBLE_DEVICES" not in environ:
        return nvml.PynvmlReader.open(module, index=0)
    return None


class TelemetrySampler:
    """Samples of the host and, where readable, the device.

    Args:
        nvml_reader: NVML's answers for the worker's GPU (:class:`nvml.NvmlReader`).
        jetson_load: a Jetson's GPU ``load`` file (used without an NVML reader).
        gpu: the GPU probe's answer, whose CUDA versions every sample carries.
    """

    def __init__(
        self,
        nvml_reader: nvml.NvmlReader | None = None,
        jetson_load: Path | None = None,
        gpu: GpuProbe | None = None,
    ) -> None:
        self.nvml_reader = nvml_reader
        self.jetson_load = jetson_load
        self._cuda: dict[str, str] = {}
        if gpu is not None:
            told = (gpu.binding, gpu.runtime, gpu.driver)
            keys = ("cuda_binding", "cuda_runtime", "cuda_driver")
            self._cuda = {key: value for key, value in zip(keys, told, strict=True) if value}
        psutil.cpu_percent(interval=None)  # the first call only starts the count

    @classmethod
    def detect(
        cls,
        *,
        import_nvml: Callable[[], Any] = nvml.import_pynvml,
        find_gpu: Callable[[], GpuProbe] = probe,
        sys_root: Path = Path("/sys"),
        binding_installed: Callable[[], bool] = cuda_binding_installed,
        environ: Mapping[str, str] = os.environ,
    ) -> TelemetrySampler:
        """The sampler for this machine: NVML for the GPU CUDA names where NVML knows and
        samples it, else a Jetson's load file where there is one, else the host alone.

        Args:
            import_nvml: nvidia-ml-py's module, or None (its import).
            find_gpu: the GPU probe.
            sys_root: where sysfs is (a Jetson's load file).
            binding_installed: whether a CUDA binding's package is there.
            environ: this process's environment (``CUDA_VISIBLE_DEVICES``).
        """
        module = import_nvml()
        nvml_gpus = nvml.device_count(module) if module is not None else 0
        load = jetson.find_load(sys_root)
        found = None
        if nvml_gpus > 0 or load is not None or binding_installed():
            found = find_gpu()
        reader = None
        if module is not None and nvml_gpus > 0 and found is not None:
            reader = _open_nvml(module, nvml_gpus, found, environ)
        if reader is None and load is not None:
            logger.debug("GPU telemetry from %s", load)
        return cls(reader, None if reader is not None else load, found)

    def __call__(self) -> Telemetry:
        memory = psutil.virtual_memory()
        used_mib, total_mib = (memory.total - memory.available) // _MIB, memory.total // _MIB
        fields: dict[str, Any] = {
            "host_cpu_pct": float(psutil.cpu_percent(interval=None)),
            "host_mem_used_mib": used_mib,
            "host_mem_total_mib": total_mib,
        }
        if self.nvml_reader is not None:
            # A device that stops answering (NVMLError, say): the host's fields alone.
            with contextlib.suppress(Exception):
                reader = self.nvml_reader
                fields.update(nvml.parse(reader.memory(), reader.utilization()))
        elif self.jetson_load is not None:
            load = jetson.read_load(self.jetson_load)
            if load is not None:
                fields.update(
                    device="jetson",
                    gpu_util_pct=load,
                    gpu_mem_used_mib=used_mib,
                    gpu_mem_total_mib=total_mib,
                )
        fields.update(self._cuda)
        return Telemetry(**fields)
