"""nvml.py: a dGPU's utilization and memory from NVML (nvidia-ml-py's ``pynvml``).

:func:`parse` turns NVML's answers (``nvmlDeviceGetMemoryInfo``: ``total``, ``used``
bytes; ``nvmlDeviceGetUtilizationRates``: ``gpu`` percent) into telemetry fields — pure.
:class:`NvmlReader` is the seam. :meth:`PynvmlReader.open` finds the worker's GPU by the
identity CUDA gave it (UUID, else PCI bus id: NVML ignores ``CUDA_VISIBLE_DEVICES`` and
numbers devices in PCI order, so its index 0 may be another GPU), or by NVML's own number
where no CUDA binding names one, and takes a trial sample; where NVML does not know or
cannot sample the device it answers None.
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


def import_pynvml() -> Any | None:
    """nvidia-ml-py's module, or None where it is not installed (most workers)."""
    try:
        import pynvml  # (the gpu extra)
    except ImportError:
        return None
    return pynvml


def device_count(pynvml: Any) -> int:
    """The GPUs NVML sees (all of the machine's, whatever ``CUDA_VISIBLE_DEVICES`` says);
    0 where NVML does not initialise (no library or driver)."""
    try:
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        logger.debug("no NVML: %s", exc)
        return 0


def _handle(pynvml: Any, uuid: str, pci_bus_id: str, index: int | None) -> Any:
    """NVML's handle of the device with ``uuid``, else at ``pci_bus_id``, else of NVML's
    number ``index``; None: none of them."""
    if index is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            logger.debug("NVML has no device %d: %s", index, exc)
    if uuid:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError as exc:
            logger.debug("NVML does not find %s: %s", uuid, exc)
    if pci_bus_id:
        try:
            # (nvidia-ml-py calls nvmlDeviceGetHandleByPciBusId_v2)
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
        except pynvml.NVMLError as exc:
            logger.debug("NVML does not find %s: %s", pci_bus_id, exc)
    return None


class PynvmlReader:
    """NVML through nvidia-ml-py, for one device's handle."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(
        cls, pynvml: Any, uuid: str = "", pci_bus_id: str = "", *, index: int | None = None
    ) -> PynvmlReader | None:
        """NVML's reader for the device CUDA named, found by its UUID, else its PCI bus id
        (NVML's own numbering is not CUDA's), or for NVML's device ``index`` where CUDA
        named none; once a trial sample has answered. None (and why, in the log) where
        NVML does not know the device or cannot sample it (MIG, Jetson Thor). NVML must be
        initialised (:func:`device_count`)."""
        device = f"NVML's device {index}" if index is not None else uuid or pci_bus_id
        handle = _handle(pynvml, uuid, pci_bus_id, index)
        if handle is None:
            logger.info("no NVML telemetry: NVML does not know %s", device)
            return None
        reader = cls(pynvml, handle)
        try:
            parse(reader.memory(), reader.utilization())
        except pynvml.NVMLError as exc:
            logger.info("no NVML telemetry: NVML does not sample %s (%s)", device, exc)
            return None
        return reader

    @property
    def handle(self) -> Any:
        """NVML's handle of the device (for callers that ask NVML more)."""
        return self._handle

    def memory(self) -> Any:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle)

    def utilization(self) -> Any:
        return self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
