"""arena.py: ShmArena — a client's region and a first-fit allocator over it.

The client copies a large input's bytes into its arena and sends a reference instead of
the bytes (§5.4); the space is freed when the request is answered. The arena never
shrinks or truncates its region.
"""

from __future__ import annotations

import bisect

from carpool.common.shm.regions import ALIGN, HEADER_BYTES, OwnedRegion, write_at


class ShmArena(OwnedRegion):
    """One shared-memory region owned by a client, and a first-fit allocator over it.

    ``put`` copies an array's bytes into the region and returns its offset, or None when
    there is no room (the caller sends that tensor inline instead). ``free`` gives the
    space back. Not thread-safe (one per client, like its socket).

    Args:
        size: bytes in the region (rounded up to whole pages).
        mode: file permissions of the region: 0o600 lets only this user's workers read
            it; 0o640 or 0o644 let workers that run as another user (a systemd service
            user) read it, and also anyone else in that group or on the host.
        group: the region's group (this process must belong to it); by default the
            process's own.
    """

    def __init__(self, size: int, *, mode: int = 0o600, group: str | None = None) -> None:
        super().__init__(size, mode, "", group)
        size = self.size
        # (offset, length) of free space, sorted and merged; the header is never free.
        self._free: list[tuple[int, int]] = [(HEADER_BYTES, size - HEADER_BYTES)]
        self._used: dict[int, int] = {}  # offset -> length

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def put(self, data: memoryview) -> int | None:
        """Copy ``data`` (a flat byte view) into the region; its offset, or None if full."""
        need = max(ALIGN, -(-len(data) // ALIGN) * ALIGN)
        for i, (start, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, length - need)
                self._used[start] = need
                write_at(self.fd, data, start)
                return start
        return None

    def free(self, offset: int) -> None:
        """Give back the space of a ``put`` (unknown offsets are ignored)."""
        length = self._used.pop(offset, None)
        if length is None:
            return
        free = self._free
        i = bisect.bisect(free, (offset, length))
        if i < len(free) and free[i][0] == offset + length:  # merge with the next block
            length += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the previous
            offset, length = free[i - 1][0], free[i - 1][1] + length
            del free[i - 1]
            i -= 1
        free.insert(i, (offset, length))
