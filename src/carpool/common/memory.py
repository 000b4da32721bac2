"""memory.py: keep large message buffers in the heap instead of mapping them per message.

glibc serves every allocation above ``M_MMAP_THRESHOLD`` (128 KiB to start, raised as
mapped chunks are freed) with its own ``mmap`` and returns it with ``munmap`` when freed.
libzmq allocates one buffer per received message, so under glibc's defaults a 1 MiB
tensor frame costs a map, 256 fresh-page faults and an unmap in every process it crosses.
This module raises the thresholds through ``mallopt`` (speed: docs/benchmarks.md "Why the
hot path looks as it does").

The cost: freed buffers stay in the process's heap for reuse, up to ``TRIM_BYTES`` per
arena before glibc gives memory back, so a broker's resident size after a burst of large
tensors stays near its peak. Set ``CARPOOL_MALLOC_TUNING=0`` to leave glibc's defaults.
Elsewhere than glibc (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations up to this size come from the heap (glibc's ceiling for it is 32 MiB).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free memory at the top of a heap kept for reuse before it is returned to the system.
TRIM_BYTES = 128 * 1024 * 1024


def glibc() -> bool:
    """Whether this process runs on glibc (where the thresholds mean something)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (OSError, ValueError):  # musl raises EINVAL for this name
        return False


def tune_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds for this process. Returns True if set.

    Call once at start-up, before sockets carry traffic (the broker and worker commands
    do). Safe to call again; does nothing off glibc or with CARPOOL_MALLOC_TUNING=0.
    """
    if os.environ.get("CARPOOL_MALLOC_TUNING", "1") == "0" or not glibc():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)
    )
    if not ok:
        logger.warning("mallopt refused the thresholds; large frames stay mmap-backed")
    return ok
