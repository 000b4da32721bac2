"""memory.py: glibc allocator thresholds, checked in child processes (they are
process-wide) with glibc's own accounting of mmap-backed blocks (mallinfo2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from carpool.common import memory

CHILD = """
import ctypes
from carpool.common.memory import tune_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
tuned = tune_allocator()
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 << 20)  # a 4 MiB tensor frame
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(tuned, mapped >= 4 << 20)
"""


def run_child(**env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


glibc_only = pytest.mark.skipif(not memory.glibc(), reason="the thresholds are glibc's")


@glibc_only
def test_large_blocks_come_from_the_heap_once_tuned() -> None:
    assert run_child() == "True False"


@glibc_only
def test_opt_out_leaves_glibcs_defaults() -> None:
    assert run_child(CARPOOL_MALLOC_TUNING="0") == "False True"


def test_a_libc_that_is_not_glibc_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """musl raises EINVAL for CS_GNU_LIBC_VERSION: no glibc, nothing tuned, no crash."""

    def musl_confstr(name: str) -> str:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "confstr", musl_confstr)
    assert memory.glibc() is False
    assert memory.tune_allocator() is False
