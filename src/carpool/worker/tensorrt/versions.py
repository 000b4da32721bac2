"""versions.py: what a TensorRT release can do, read from its version string. Pure.

The fleet runs TensorRT 10.3 (JetPack 6 on Jetson Orin) beside 10.x and 11.x on GPU
servers, so the code keeps to what both have and decides the rest here, from
``tensorrt.__version__`` alone: 11.0 made every network strongly typed and removed the
precision builder flags (FP16, INT8, ...) and implicit INT8 calibration; 10.0 removed
implicit batch and the binding-index API, so releases before 10 are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from carpool.common.errors import ConfigError

__all__ = ["OLDEST", "TrtVersion"]

#: The oldest release carpool builds and runs plans with (JetPack 6's).
OLDEST = (10, 3)

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, slots=True)
class TrtVersion:
    """A TensorRT release: ``text`` as ``tensorrt.__version__`` gives it."""

    text: str
    major: int
    minor: int
    patch: int
    build: int = 0

    @classmethod
    def parse(cls, text: str) -> TrtVersion:
        """``"10.3.0"``, ``"11.4.0.106"`` (a suffix such as ``.post1`` is kept in ``text``).

        Raises:
            ConfigError: not a TensorRT version, or one older than :data:`OLDEST`.
        """
        match = _VERSION.match(text.strip())
        if match is None:
            raise ConfigError(f"TensorRT version {text!r} is not MAJOR.MINOR.PATCH[.BUILD]")
        major, minor, patch, build = (int(g) if g else 0 for g in match.groups())
        version = cls(text.strip(), major, minor, patch, build)
        if (major, minor) < OLDEST:
            raise ConfigError(
                f"TensorRT {text} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest carpool "
                "uses (10.0 removed the implicit-batch API that older plans need)"
            )
        return version

    @property
    def precision_flags(self) -> bool:
        """Whether the builder has the weak-typing precision flags (BuilderFlag.FP16,
        INT8): 10.x does; 11.0 removed them."""
        return self.major < 11

    @property
    def always_strongly_typed(self) -> bool:
        """Whether every network is strongly typed (11.0 on; 10.x opts in with the
        STRONGLY_TYPED network flag)."""
        return self.major >= 11

    @property
    def progress_monitor(self) -> bool:
        """Whether the builder reports its phases through IProgressMonitor (10.0 on)."""
        return self.major >= 10

    def __str__(self) -> str:
        return self.text
