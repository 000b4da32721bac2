"""device.py: the GPU a plan is built for, and the L4T (JetPack) release of a Jetson.

:class:`Device` is what a plan's key (:mod:`.cache`) and the GPU probe's answer
(:mod:`.probe`) name; :func:`parse_l4t` reads ``/etc/nv_tegra_release``. Standard library
only: the probe and the worker's telemetry import it without the rest of the worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["L4T_RELEASE_FILE", "Device", "parse_l4t", "read_l4t"]

L4T_RELEASE_FILE = Path("/etc/nv_tegra_release")

_L4T = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)(?:\.(\d+))?")


def parse_l4t(text: str) -> str | None:
    """The L4T release in ``/etc/nv_tegra_release``'s text, as ``R36.4.3`` (JetPack 6.2),
    or None when it names none."""
    match = _L4T.search(text)
    if match is None:
        return None
    major, minor, patch = match.groups()
    return f"R{major}.{minor}" + (f".{patch}" if patch is not None else "")


def read_l4t(path: Path = L4T_RELEASE_FILE) -> str | None:
    """This machine's L4T release, or None off a Jetson."""
    try:
        return parse_l4t(path.read_text(errors="replace"))
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class Device:
    """The GPU a plan is built for."""

    name: str  # e.g. "NVIDIA H200", "Orin (nvgpu)"
    compute_capability: tuple[int, int]
    l4t: str | None = None  # the L4T release on a Jetson, else None

    def key(self) -> str:
        """A file-name-safe id of this device and ``l4t`` (timing caches are filed by it)."""
        cc = f"sm{self.compute_capability[0]}{self.compute_capability[1]}"
        name = re.sub(r"[^A-Za-z0-9]+", "-", self.name).strip("-").lower() or "gpu"
        return f"{name}-{cc}" + (f"-{self.l4t.lower()}" if self.l4t else "")
