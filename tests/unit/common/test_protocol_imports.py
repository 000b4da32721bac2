"""The protocol package is pure: importing it loads nothing that does I/O."""

from __future__ import annotations

import subprocess
import sys

#: Modules that mean sockets, files, locks, threads or shared memory.
IMPURE = (
    "asyncio",
    "carpool.common.shm",
    "fcntl",
    "mmap",
    "selectors",
    "socket",
    "threading",
    "zmq",
)

PROBE = """
import sys
import carpool.common.protocol
impure = {impure!r}
print(sorted(m for m in sys.modules if m in impure or m.startswith(tuple(i + "." for i in impure))))
"""


def test_the_protocol_package_imports_nothing_impure() -> None:
    probe = PROBE.format(impure=IMPURE)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_the_shm_package_takes_its_references_from_the_protocol() -> None:
    from carpool.common import protocol, shm

    assert shm.parse_ref is protocol.parse_ref
    assert shm.MAX_REF_BYTES == protocol.MAX_REF_BYTES
