"""nvml.py: a dGPU's utilization and memory from NVML (nvidia-ml-py's ``pynvml``).

:func:`parse` turns NVML's answers (``nvmlDeviceGetMemoryInfo``: ``total``, ``used``
bytes; ``nvmlDeviceGetUtilizationRates``: ``gpu`` percent) into telemetry fields — pure.
:class:`NvmlReader` is the seam: :meth:`PynvmlReader.open` imports ``pynvml`` lazily and
initialises NVML; without the package, its library or a device it answers None, and the
worker leaves the device fields off.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_MIB = 1 << 20


class NvmlReader(Protocol):
    """NVML's two answers for one device, as nvidia-ml-py returns them."""

    def memory(self) -> Any:
        """``nvmlDeviceGetMemoryInfo``: an object with ``total`` and ``used`` bytes."""
        ...

    def utilization(self) -> Any:
        """``nvmlDeviceGetUtilizationRates``: an object with ``gpu`` (percent)."""
        ...


def parse(memory: Any, utilization: Any) -> dict[str, Any]:
    """Telemetry fields from NVML's memory and utilization answers."""
    return {
        "device": "nvml",
        "gpu_util_pct": float(min(100, max(0, int(utilization.gpu)))),
        "gpu_mem_used_mib": int(memory.used) // _MIB,
        "gpu_mem_total_mib": int(memory.total) // _MIB,
    }


class PynvmlReader:
    """NVML through nvidia-ml-py, for device ``index``."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, index: int = 0) -> PynvmlReader | None:
        """NVML's reader for GPU ``index``, or None (and why, at debug level) when the
        package, NVML's library or the device is missing."""
        try:
            import pynvml  # (the gpu extra; most workers lack it)
        except ImportError:
            logger.debug("no NVML telemetry: nvidia-ml-py is not installed")
            return None
        try:
            pynvml.nvmlInit()
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
        except pynvml.NVMLError as exc:
            logger.debug("no NVML telemetry: %s", exc)
            return None

    def memory(self) -> Any:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle)

    def utilization(self) -> Any:
        return self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
