"""ring.py: ShmRing — a worker's output ring (§5.5), and the byte-range locks around it.

Large outputs are written one after another into the ring, wrapping around, and the
client copies them out (:meth:`carpool.common.shm.RegionReader.read_output`) before the
ring comes round again. Open-file-description locks keep the writer and its readers
apart; the writer never waits for one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Sequence

from carpool.common.protocol.refs import KEY_BYTES, RING_TAG
from carpool.common.shm.regions import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    OwnedRegion,
    write_at,
)


class ShmRing(OwnedRegion):
    """A worker's output region (§5.5): outputs are written one after another, wrapping
    around; a client copies its outputs out before the ring comes round again.

    After MAGIC and the key, the header holds ``head`` (the end of the byte stream that
    every output ever written lies in, at its ``seq``) and ``capacity`` (bytes after the
    header), both little-endian u64. Byte-range locks (Linux open-file-description
    locks) keep writer and readers apart: the writer changes ``head`` under an exclusive
    lock on the header and an output's bytes under an exclusive lock on their range; a
    reader holds a shared lock on its range while it checks ``head <= seq + capacity``
    (under a shared lock on the header) and copies. The writer never waits for a lock:
    where a reader holds one, that output goes in its frame instead, so a client that
    keeps a lock can cost the worker its ring but cannot stall it.
    """

    def __init__(self, size: int, *, mode: int = 0o600, group: str | None = None) -> None:
        super().__init__(size, mode, RING_TAG, group)
        self._lock_fd = self.fd  # the locks are taken on this descriptor
        self.capacity = self.size - HEADER_BYTES
        self.head = 0
        os.pwrite(self.fd, RING_HEADER.pack(0, self.capacity), RING_HEADER_AT)

    def place(
        self, sizes: Sequence[int], since: int | None = None
    ) -> list[tuple[int, int] | None] | None:
        """Reserve space for outputs of these sizes: (offset, seq) for each, None for
        one that does not fit (larger than the ring, or it would come round over an
        output placed at stream position ``since`` or later: the first output of the
        batch being written, whose replies are not sent yet); None for all when a reader
        holds the header now."""
        if not try_lock_range(self._lock_fd, fcntl.F_WRLCK, 0, HEADER_BYTES):
            return None
        try:
            out: list[tuple[int, int] | None] = []
            for size in sizes:
                need = max(ALIGN, -(-size // ALIGN) * ALIGN)
                pos = self.head % self.capacity
                skip = self.capacity - pos if pos + need > self.capacity else 0
                end = self.head + skip + need
                if need > self.capacity or (since is not None and end - since > self.capacity):
                    out.append(None)
                    continue
                self.head += skip  # never split an output: start over at 0
                if since is None:
                    since = self.head
                out.append((HEADER_BYTES + (0 if skip else pos), self.head))
                self.head = end
            # A reader that checks after this sees the reserved bytes as written over.
            os.pwrite(self._lock_fd, RING_HEADER.pack(self.head, self.capacity), RING_HEADER_AT)
            return out
        finally:
            unlock_range(self._lock_fd, 0, HEADER_BYTES)

    def write(self, offset: int, data: memoryview) -> bool:
        """Copy ``data`` to a placed offset; False (nothing written) when a reader still
        holds those bytes: the output then goes in its frame."""
        if not try_lock_range(self._lock_fd, fcntl.F_WRLCK, offset, len(data)):
            return False
        try:
            write_at(self._lock_fd, data, offset)
        finally:
            unlock_range(self._lock_fd, offset, len(data))
        return True


_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, len, pid


def lock_range(fd: int, kind: int, start: int, length: int, *, wait: bool) -> None:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))


def try_lock_range(fd: int, kind: int, start: int, length: int) -> bool:
    try:
        lock_range(fd, kind, start, length, wait=False)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock_range(fd: int, start: int, length: int) -> None:
    lock_range(fd, fcntl.F_UNLCK, start, length, wait=False)


#: The ring's header fields after MAGIC and the key: head, capacity (little-endian u64).
RING_HEADER = struct.Struct("<QQ")
RING_HEADER_AT = len(MAGIC) + KEY_BYTES
