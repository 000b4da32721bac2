"""reader.py: RegionReader — reads referenced bytes out of regions, never through a mapping.

Workers read clients' input regions with it (§5.4), clients read workers' output rings
(§5.5). It reads with ``preadv`` from descriptors it keeps open: a region shorter than a
reference claims gives a short read (an error for that one request), not a SIGBUS. It
opens only ``carpool-*`` names in its directory, never follows a symlink, only reads, and
checks the key a reference carries against the region's.
"""

from __future__ import annotations

import fcntl
import hmac
import os
import stat
import threading
from collections import OrderedDict

from carpool.common.protocol.refs import KEY_BYTES, OutputRef, ShmRef, is_ring, valid_region
from carpool.common.shm.regions import HEADER_BYTES, MAGIC, SHM_DIR, ShmError
from carpool.common.shm.ring import RING_HEADER, RING_HEADER_AT, lock_range, unlock_range


def _not_a_ring(region: str) -> None:
    """An input is read from a client's region, never from a worker's output ring: every
    client that asks for shared-memory outputs learns a ring's name and key (even one on
    another host, which cannot open it), and could hand them back as an input reference
    to make the worker read other clients' outputs for it."""
    if is_ring(region):
        raise ShmError(f"shm region {region!r} is a worker's output ring, not an input region")


class RegionReader:
    """Reads referenced bytes out of clients' regions; keeps the last ``max_open``
    regions' file descriptors open."""

    def __init__(self, max_open: int = 64, directory: str = SHM_DIR) -> None:
        self.max_open = max_open
        self.directory = directory
        self._fds: OrderedDict[str, tuple[int, str]] = OrderedDict()  # region -> fd, key
        # A worker runs batches on its inference thread, or short ones on its loop
        # thread: never two at once, but the lock makes that not matter.
        self._lock = threading.Lock()

    def read_into(self, ref: ShmRef, dest: memoryview) -> None:
        """Fill ``dest`` with ``len(dest)`` bytes of the referenced region from its offset.

        Raises:
            ShmError: the region cannot be opened here, its key is not the reference's,
                or it is shorter than the reference says.
        """
        _not_a_ring(ref[0])
        with self._lock:
            self._read(self._open(ref[0], ref[2]), ref[0], ref[1], dest)

    def check(self, ref: ShmRef, size: int) -> None:
        """Raise :class:`ShmError` unless ``size`` bytes at the reference can be read
        (the region opens, its key matches, it is long enough): checked before a batch
        buffer is allocated for them."""
        _not_a_ring(ref[0])
        with self._lock:
            fd = self._open(ref[0], ref[2])
            if os.fstat(fd).st_size < ref[1] + size:
                raise ShmError(f"shm region {ref[0]!r} ends before offset {ref[1]} + {size} bytes")

    def read_output(self, ref: OutputRef, dest: memoryview) -> None:
        """Copy an output out of a worker's ring (§5.5), checking that it was not
        written over before or while it was copied.

        Raises:
            ShmError: as :meth:`read_into`, or the ring came round over these bytes.
        """
        region, offset, key, seq = ref
        size = len(dest)
        if size == 0:
            return  # nothing to copy (a lock of length 0 would reach to the end)
        try:
            with self._lock:
                self._read_output(region, offset, key, seq, dest)
        except OSError as exc:  # a lock or a read the system refused
            raise ShmError(f"shm region {region!r}: {exc.strerror or exc}") from None

    def _read_output(self, region: str, offset: int, key: str, seq: int, dest: memoryview) -> None:
        size = len(dest)
        fd = self._open(region, key)
        # The writer holds a range only while it copies into it, and never waits: these
        # waits are short.
        lock_range(fd, fcntl.F_RDLCK, offset, size, wait=True)
        try:
            lock_range(fd, fcntl.F_RDLCK, 0, HEADER_BYTES, wait=True)
            try:
                raw = os.pread(fd, RING_HEADER.size, RING_HEADER_AT)
            finally:
                unlock_range(fd, 0, HEADER_BYTES)
            head, capacity = RING_HEADER.unpack(raw) if len(raw) == RING_HEADER.size else (0, 0)
            if not capacity or offset != HEADER_BYTES + seq % capacity:
                raise ShmError(f"shm region {region!r}: not a ring, or offset and seq differ")
            if head > seq + capacity or seq + size > head:
                raise ShmError(
                    f"shm region {region!r}: the output was written over before it was "
                    "read (read replies sooner, or give the worker a larger ring)"
                )
            self._read(fd, region, offset, dest)
        finally:
            unlock_range(fd, offset, size)

    def _open(self, region: str, key: str) -> int:
        fd, own_key = self._fd(region)
        if not hmac.compare_digest(own_key, key):
            raise ShmError(f"shm region {region!r}: the reference's key is not the region's")
        return fd

    def _read(self, fd: int, region: str, offset: int, dest: memoryview) -> None:
        want = len(dest)
        got = 0
        while got < want:
            try:
                n = os.preadv(fd, [dest[got:]], offset + got)
            except OSError as exc:
                raise ShmError(f"shm region {region!r}: read failed: {exc.strerror}") from None
            if n == 0:
                raise ShmError(f"shm region {region!r} ends before offset {offset} + {want} bytes")
            got += n

    def _fd(self, region: str) -> tuple[int, str]:
        """An open descriptor of ``region`` and the region's key (hex)."""
        entry = self._fds.get(region)
        if entry is not None:
            if os.fstat(entry[0]).st_nlink:
                self._fds.move_to_end(region)
                return entry
            # Removed by its client: let its memory go, and see whether it is back.
            del self._fds[region]
            os.close(entry[0])
        if not valid_region(region):
            raise ShmError(f"not a carpool shm region name: {region!r}")
        self._drop_removed()  # a new region: often one that replaced a removed one
        path = os.path.join(self.directory, region)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise ShmError(
                f"shm region {region!r} cannot be opened on this worker ({exc.strerror}); "
                "shared-memory inputs need the client and the worker on one host",
                unreachable=True,
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ShmError(f"shm region {region!r} is not a regular file")
            head = os.pread(fd, len(MAGIC) + KEY_BYTES, 0)
        except OSError as exc:
            os.close(fd)
            raise ShmError(f"shm region {region!r}: read failed: {exc.strerror}") from None
        except ShmError:
            os.close(fd)
            raise
        if len(head) < len(MAGIC) + KEY_BYTES or not head.startswith(MAGIC):
            os.close(fd)
            raise ShmError(f"shm region {region!r} is not a carpool region (no header)")
        entry = (fd, head[len(MAGIC) :].hex())
        self._fds[region] = entry
        while len(self._fds) > self.max_open:
            _, (old, _) = self._fds.popitem(last=False)
            os.close(old)
        return entry

    def sweep(self) -> int:
        """Close the descriptors of regions their clients have removed (an open
        descriptor keeps a removed region's memory). Returns how many were closed."""
        if not self._lock.acquire(blocking=False):
            return 0  # a batch is being read: next time (the caller must not stall)
        try:
            return self._drop_removed()
        finally:
            self._lock.release()

    def _drop_removed(self) -> int:
        closed = 0
        for region, (fd, _) in list(self._fds.items()):
            if not os.fstat(fd).st_nlink:
                del self._fds[region]
                os.close(fd)
                closed += 1
        return closed

    def close(self) -> None:
        with self._lock:
            while self._fds:
                _, (fd, _) = self._fds.popitem()
                os.close(fd)
