"""logs.py: logging for entry points only (library code just calls getLogger).

Lines go to stderr (journald under systemd) as ``time level logger: message``, and
messages carry stable ``key=value`` fields.
"""

from __future__ import annotations

import logging
import sys


def configure(level: str = "INFO") -> None:
    """Install one stderr handler on the root logger (idempotent)."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    if any(getattr(h, "_carpool", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    handler._carpool = True  # type: ignore[attr-defined]
    root.addHandler(handler)
