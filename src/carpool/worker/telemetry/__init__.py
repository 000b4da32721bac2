"""telemetry: what a worker reports of its host and device (docs/protocol.md §8.2).

:class:`TelemetrySampler` takes one :class:`~carpool.common.protocol.Telemetry` sample:
the host's CPU and memory from psutil, always; the GPU from NVML (nvml.py) on a dGPU, or
from the Jetson's devfreq load (jetson.py) with the unified memory from psutil. The
worker core asks for a sample at heartbeat cadence, never per batch: each costs a few
tens of microseconds (``psutil.cpu_percent(interval=None)`` compares with the last call
and does not wait).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import psutil

from carpool.common.protocol import Telemetry
from carpool.worker.telemetry import jetson, nvml

__all__ = ["TelemetrySampler"]

_MIB = 1 << 20


class TelemetrySampler:
    """Samples of the host and, where readable, the device.

    Args:
        nvml_reader: NVML's answers for the worker's GPU (:class:`nvml.NvmlReader`).
        jetson_load: a Jetson's GPU ``load`` file (used without an NVML reader).
    """

    def __init__(
        self, nvml_reader: nvml.NvmlReader | None = None, jetson_load: Path | None = None
    ) -> None:
        self.nvml_reader = nvml_reader
        self.jetson_load = jetson_load
        psutil.cpu_percent(interval=None)  # the first call only starts the count

    @classmethod
    def detect(cls, gpu: int = 0) -> TelemetrySampler:
        """The sampler for this machine: NVML where it answers, else a Jetson's load
        file where there is one, else the host alone."""
        reader = nvml.PynvmlReader.open(gpu)
        return cls(reader, None if reader is not None else jetson.find_load())

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
        return Telemetry(**fields)
