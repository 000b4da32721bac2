"""jetson.py: a Jetson's GPU load from devfreq/sysfs — pure but for reading one file.

The integrated GPU's driver exposes its load in per-mille (0..1000, "537\\n") in a
``load`` file whose place depends on the module and the L4T release: Orin on JetPack 6
under ``/sys/class/devfreq/17000000.gpu/device/load``, Orin and Xavier on JetPack 5
under ``/sys/devices/17000000.ga10b/load`` and ``/sys/devices/17000000.gv11b/load``,
Nano and TX2 under ``/sys/devices/gpu.0/load`` (``/sys/devices/platform/gpu.0/load`` on
some kernels). Its memory is the host's (unified): the sampler reports psutil's there.
"""

from __future__ import annotations

from pathlib import Path

#: Fixed places of the load file, then devfreq patterns (relative to the sysfs root).
LOAD_PATHS = (
    "devices/gpu.0/load",
    "devices/platform/gpu.0/load",
    "devices/17000000.ga10b/load",
    "devices/17000000.gv11b/load",
    "devices/57000000.gpu/load",
)
LOAD_GLOBS = ("class/devfreq/*.gpu/device/load", "class/devfreq/*gv11b/device/load")


def find_load(sys_root: Path = Path("/sys")) -> Path | None:
    """The GPU load file under ``sys_root``, or None (not a Jetson, or none readable)."""
    for rel in LOAD_PATHS:
        path = sys_root / rel
        if path.is_file():
            return path
    for pattern in LOAD_GLOBS:
        for path in sorted(sys_root.glob(pattern)):
            if path.is_file():
                return path
    return None


def parse_load(text: str) -> float | None:
    """GPU utilization in percent from a ``load`` file's text (per-mille), or None."""
    try:
        permille = int(text.strip())
    except ValueError:
        return None
    return min(100.0, max(0.0, permille / 10.0))


def read_load(path: Path) -> float | None:
    """Read and parse the load file (None when it cannot be read)."""
    try:
        return parse_load(path.read_text())
    except OSError:
        return None
