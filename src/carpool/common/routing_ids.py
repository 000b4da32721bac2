"""routing_ids.py: unpredictable routing ids for the ROUTER sockets this process makes.

libzmq 4.3 gives each peer that does not choose its own routing id ``00`` followed by a
32-bit counter, which starts at a value drawn from libc's ``rand()`` when the ROUTER is
made and goes up by one per connection. Nothing seeds libc's generator, so every fresh
process draws the same start (``00 6b 8b 45 67`` for its first ROUTER on glibc), and a peer
that chooses the ids the ROUTER will generate next makes libzmq abort the process when
the ROUTER generates one already in use. :func:`seed_routing_ids`, called before a ROUTER
is made, seeds ``rand()`` from the operating system's random source, so the start cannot
be predicted. (It does not stop a peer from guessing: docs/security.md.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["seed_routing_ids"]


def _srand() -> Callable[[int], object] | None:
    """libc's ``srand``, the one libzmq's ``rand()`` calls use (the process's C library)."""
    for name in (None, ctypes.util.find_library("c")):
        try:
            srand = ctypes.CDLL(name).srand
        except (OSError, AttributeError):
            continue
        srand.argtypes = [ctypes.c_uint]
        srand.restype = None
        return srand
    return None


def seed_routing_ids() -> bool:
    """Seed libc's ``rand()`` with 32 bits from ``os.urandom``; the ROUTER sockets made
    after it start their generated routing ids where nobody can predict. Returns False
    (and logs a warning) where this C library has no ``srand`` to call."""
    srand = _srand()
    if srand is None:
        logger.warning("no libc srand found: generated routing ids stay predictable")
        return False
    srand(int.from_bytes(os.urandom(4), "little"))
    return True
