"""telemetry.py: what a worker reports of its host and its device — pure.

HEARTBEAT and RESULT may carry a ``telemetry`` map (docs/protocol.md §8.2): the host's
CPU and memory (every worker), and its GPU's utilization and memory where the worker can
read them (NVML on a GPU server; devfreq load and unified memory on a Jetson), and the
CUDA binding, runtime and driver versions it found. Every field is optional; a reader
drops a field it cannot read rather than the message (the figures inform operators,
nothing is decided on them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

#: Where the device fields came from (``device``).
DEVICE_SOURCES = ("nvml", "jetson")
_MIB_FIELDS = ("host_mem_used_mib", "host_mem_total_mib", "gpu_mem_used_mib", "gpu_mem_total_mib")
_TEXT_FIELDS = ("cuda_binding", "cuda_runtime", "cuda_driver")
#: The longest text field kept from the wire.
MAX_TEXT = 64


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One sample of a worker's host and device; None: not read (left off the wire)."""

    host_cpu_pct: float | None = None  # the host's CPU use since the last sample, 0..100
    host_mem_used_mib: int | None = None
    host_mem_total_mib: int | None = None
    device: str | None = None  # "nvml" or "jetson": where the gpu_* fields came from
    gpu_util_pct: float | None = None  # 0..100
    gpu_mem_used_mib: int | None = None  # on a Jetson: the unified memory (the host's)
    gpu_mem_total_mib: int | None = None
    cuda_binding: str | None = None  # the CUDA binding and its version, "cuda-bindings 12.9.1"
    cuda_runtime: str | None = None  # its CUDA runtime's version, "12.9"
    cuda_driver: str | None = None  # the CUDA version of the driver, "12.6"

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                wire[f.name] = round(value, 1) if isinstance(value, float) else value
        return wire

    @classmethod
    def from_wire(cls, raw: Any) -> Telemetry | None:
        """The sample in a message's ``telemetry`` map; None when it is absent, not a
        map, or holds nothing readable. Fields of the wrong type or range are dropped, and
        text that is empty, longer than :data:`MAX_TEXT` or not printable."""
        if not isinstance(raw, dict):
            return None
        kept: dict[str, Any] = {}
        for key in ("host_cpu_pct", "gpu_util_pct"):
            v = raw.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 100:
                kept[key] = float(v)
        for key in _MIB_FIELDS:
            v = raw.get(key)
            if type(v) is int and v >= 0:
                kept[key] = v
        for key in _TEXT_FIELDS:
            v = raw.get(key)
            if isinstance(v, str) and 0 < len(v) <= MAX_TEXT and v.isprintable():
                kept[key] = v
        if raw.get("device") in DEVICE_SOURCES:
            kept["device"] = raw["device"]
        return cls(**kept) if kept else None
