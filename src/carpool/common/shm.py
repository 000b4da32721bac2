"""shm.py: shared-memory tensors for clients and workers on one host (protocol §5.4, §5.5).

A client that shares ``/dev/shm`` with the workers can put a large input tensor into a
region of its own and send only a reference (region, offset, key) through the broker; the
worker reads the bytes straight from the region into its batch buffer. Large outputs can
come back the same way, through a ring the worker owns. The payload then never crosses a
socket: neither the broker's process nor the kernel's socket buffers see it. This is the
idea of Triton's system shared memory, without a registration step: a region is a file
in ``/dev/shm`` whose name starts with ``carpool-``.

- :class:`ShmArena` (client side) creates one region, places tensors in it and frees
  them when the request is answered. It never shrinks or truncates its region.
- :class:`ShmRing` (worker side) is the output ring; byte-range locks keep its writer and
  its readers apart, and the writer never waits.
- :class:`RegionReader` reads with ``preadv`` from file descriptors it keeps open, never
  through a mapping: a region that is shorter than a reference claims gives a short read
  (an error for that one request), not a SIGBUS. Workers use it for inputs, clients for
  outputs (:meth:`RegionReader.read_output`).
- Regions are allocated in full when made (``posix_fallocate``), so that a full tmpfs
  is an error then, not later; they are written with ``pwrite``, never through a
  mapping (a region truncated under its owner must not be a SIGBUS), and may not be
  group- or world-writable. An owner holds a shared ``flock`` on its region while it
  lives; :func:`sweep_orphans` removes this user's regions nobody holds.

Trust: a worker reads only files named ``/dev/shm/carpool-*`` that it may open (file
permissions decide; the arena creates its region ``0600`` unless told otherwise), never
follows a symlink, and only reads. A region starts with a header holding a random key,
and a reference must carry that key: region names are visible to every user of the host,
the key only to those who can read the region, so one client cannot make a worker read
another's region.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import grp
import hmac
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from carpool.common.errors import ProtocolError

logger = logging.getLogger(__name__)

#: Where POSIX shared memory lives on Linux (what ``shm_open`` uses).
SHM_DIR = "/dev/shm"
REGION_PREFIX = "carpool-"
#: What follows the prefix in the names of workers' output rings (§5.5).
RING_TAG = "out-"
_REGION_RE = re.compile(r"carpool-[A-Za-z0-9_.-]{1,200}")
#: Offsets are aligned so that every tensor starts on a cache line (and any dtype's
#: alignment).
ALIGN = 64
#: The largest offset a reference may carry (and the largest region).
MAX_OFFSET = 2**62
#: The most bytes one referenced tensor may claim: without it, an empty frame could
#: claim any size of a dynamic dim and make a worker allocate it.
MAX_REF_BYTES = 2**31
#: A region starts with a header: MAGIC, then the region's key (random bytes). A
#: reference must carry the key, so only a client that could read the region (its owner)
#: can make a worker read it: the name alone, visible to anyone in /dev/shm, is not enough.
MAGIC = b"carpool-shm-v1\0\0"
KEY_BYTES = 16
HEADER_BYTES = ALIGN  # MAGIC + key, padded; tensors start after it
_PAGE = os.sysconf("SC_PAGE_SIZE")
_KEY_RE = re.compile(r"[0-9a-f]{32}")


def available() -> bool:
    """Whether this host can use shared-memory tensors: a writable /dev/shm and
    open-file-description locks (Linux)."""
    return (
        os.path.isdir(SHM_DIR)
        and os.access(SHM_DIR, os.W_OK | os.X_OK)
        and hasattr(fcntl, "F_OFD_SETLK")
    )


class ShmError(Exception):
    """A reference that this worker cannot serve: ``unreachable`` when the region cannot
    be opened here (another host or container, permissions), else the reference is bad."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


#: (region, offset, key): where an input's bytes are, and the region's key.
ShmRef = tuple[str, int, str]


def valid_region(name: object) -> bool:
    return type(name) is str and _REGION_RE.fullmatch(name) is not None


def parse_ref(obj: Any, what: str, *, ring_ok: bool = False) -> ShmRef:
    """Validate a request tensor descriptor's ``shm`` map: ``{region: str, offset: uint,
    key: str}`` (§5.4). A worker's output ring is no input (``_not_a_ring``): the broker
    refuses it at the door, so a worker written from the document alone is safe too.
    ``ring_ok``: leave that to the caller (a worker answers it per request, §5.4; an
    output reference names a ring)."""
    region, offset, key = _parse_ref(obj, what)
    if not ring_ok and region.startswith(REGION_PREFIX + RING_TAG):
        raise ProtocolError(f"{what}: shm region {region!r} is a worker's output ring")
    return region, offset, key


def _parse_ref(obj: Any, what: str) -> ShmRef:
    if type(obj) is not dict:
        raise ProtocolError(f"{what}: 'shm' must be a map with 'region', 'offset' and 'key'")
    region = obj.get("region")
    offset = obj.get("offset")
    key = obj.get("key")
    if not valid_region(region):
        raise ProtocolError(
            f"{what}: shm region must match {REGION_PREFIX}[A-Za-z0-9_.-]{{1,200}}, got {region!r}"
        )
    if type(offset) is not int or not HEADER_BYTES <= offset <= MAX_OFFSET:
        raise ProtocolError(
            f"{what}: shm offset must be an int in {HEADER_BYTES}..2**62, got {offset!r}"
        )
    if type(key) is not str or _KEY_RE.fullmatch(key) is None:
        raise ProtocolError(f"{what}: shm key must be {2 * KEY_BYTES} lowercase hex digits")
    assert isinstance(region, str)
    return region, offset, key


def ref_wire(ref: ShmRef) -> dict[str, Any]:
    return {"region": ref[0], "offset": ref[1], "key": ref[2]}


#: (region, offset, key, seq): where an output's bytes are in a worker's ring (§5.5).
OutputRef = tuple[str, int, str, int]


def output_ref_wire(ref: OutputRef) -> dict[str, Any]:
    return {"region": ref[0], "offset": ref[1], "key": ref[2], "seq": ref[3]}


def parse_output_ref(obj: Any, what: str) -> OutputRef:
    """Validate a reply tensor descriptor's ``shm`` map: a request reference plus
    ``seq``, the output's position in the ring's byte stream (§5.5)."""
    region, offset, key = parse_ref(obj, what, ring_ok=True)
    seq = obj.get("seq")
    if type(seq) is not int or not 0 <= seq <= MAX_OFFSET:
        raise ProtocolError(f"{what}: shm seq must be an int in 0..2**62, got {seq!r}")
    return region, offset, key, seq


# --------------------------------------------------------------------------- client side


def _create(size: int, mode: int, tag: str, group: str | None = None) -> tuple[str, str, int, str]:
    """Create a region: (name, path, fd, key hex), header written, held (``flock``) for
    as long as this process keeps ``fd`` open; owned by ``group`` when given (the process
    must be a member). Regions of processes that died are removed first."""
    if not HEADER_BYTES < size <= MAX_OFFSET:
        raise ValueError(
            f"shared-memory size must be in {HEADER_BYTES + 1}..2**62 bytes, got {size}"
        )
    if mode & ~0o777 or mode & 0o022:
        raise ValueError(
            f"shared-memory mode {mode:#o}: group and others may read a region, never write "
            "it (a writer could truncate it under its owner)"
        )
    try:
        sweep_orphans()
    except Exception as exc:  # tidying up must never stop a region from being made
        logger.warning("could not sweep /dev/shm for orphaned regions: %s", exc)
    size = -(-size // _PAGE) * _PAGE
    name = f"{REGION_PREFIX}{tag}{os.getpid()}-{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    _MADE_HERE.add(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # "in use": released when the process ends
        if group is not None:
            os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
        os.fchmod(fd, mode)  # not narrowed by the umask
        # Reserve the pages now: a full tmpfs is an OSError (ENOSPC) here, not later.
        os.posix_fallocate(fd, 0, size)
        key = secrets.token_bytes(KEY_BYTES)
        _write_at(fd, memoryview(MAGIC + key), 0)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return name, path, fd, key.hex()


#: A region's name as _create makes it: the maker's pid, then random hex.
_OWNER_RE = re.compile(r"carpool-(?:out-)?(\d{1,10})-[0-9a-f]+")
#: Names of the regions this process made. A region named with this process's pid but
#: not made by it is an orphan: a process restarted in a new pid namespace (a container
#: sharing /dev/shm) gets the pid of the one that crashed, and took its region for its
#: own, so every crash-restart left a region behind.
_MADE_HERE: set[str] = set()


def _alive(pid: int, me: int, name: str) -> bool:
    """Whether the maker of region ``name``, ``pid``, runs (in this pid namespace;
    elsewhere the lock decides)."""
    if pid == me:
        return name in _MADE_HERE
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (OverflowError: no pid is that large)
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``. With ``pwrite``, not through a mapping: a
    region truncated under its owner (by anyone who may write it) is then extended
    again, where a write through a mapping would kill the process with SIGBUS."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def sweep_orphans(directory: str = SHM_DIR, min_age_s: float = 10.0) -> list[str]:
    """Remove this user's regions whose process is gone: a region's owner holds a shared
    ``flock`` on it for as long as it lives (the kernel lets go when it dies, however it
    dies), so one that can be locked exclusively has no owner; and the pid in its name
    must not run (a carpool from before the lock holds none). A region made in the last
    ``min_age_s`` may not be locked yet: it is left alone. Returns the paths removed.
    Called whenever a region is made, so a crash loop does not fill /dev/shm."""
    removed: list[str] = []
    uid = os.getuid()
    me = os.getpid()
    now = time.time()  # noqa: TID251 (compared with file times, which are wall-clock)
    for entry in os.scandir(directory):
        named = _OWNER_RE.fullmatch(entry.name)
        if named is None or not valid_region(entry.name):
            continue  # not one of ours by name
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode) or now - st.st_ctime < min_age_s:
                continue
            if _alive(int(named[1]), me, entry.name):
                continue  # its maker runs (one from before the lock existed holds none)
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        else:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(entry.path).st_ino == os.fstat(fd).st_ino:  # still that file
                    os.unlink(entry.path)
                    removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


class _Region:
    """A region this process made: its descriptor, and removal when closed (only by the
    process that made it: a forked child must not remove its parent's region)."""

    def __init__(self, size: int, mode: int, tag: str, group: str | None) -> None:
        self.name, self.path, self._fd, self.key = _create(size, mode, tag, group)
        self.size = os.fstat(self._fd).st_size
        self._pid = os.getpid()
        self.closed = False

    def close(self) -> None:
        """Remove the region (peers holding it open keep it until they let go)."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() == self._pid:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)

    def __del__(self) -> None:  # a region never closed is still removed
        if not getattr(self, "closed", True):
            self.close()


class ShmArena(_Region):
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
                _write_at(self._fd, data, start)
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


class ShmRing(_Region):
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
        self._lock_fd = self._fd  # the locks are taken on this descriptor
        self.capacity = self.size - HEADER_BYTES
        self.head = 0
        os.pwrite(self._fd, _RING.pack(0, self.capacity), _RING_AT)

    def place(
        self, sizes: Sequence[int], since: int | None = None
    ) -> list[tuple[int, int] | None] | None:
        """Reserve space for outputs of these sizes: (offset, seq) for each, None for
        one that does not fit (larger than the ring, or it would come round over an
        output placed at stream position ``since`` or later: the first output of the
        batch being written, whose replies are not sent yet); None for all when a reader
        holds the header now."""
        if not _try_lock(self._lock_fd, fcntl.F_WRLCK, 0, HEADER_BYTES):
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
            os.pwrite(self._lock_fd, _RING.pack(self.head, self.capacity), _RING_AT)
            return out
        finally:
            _unlock(self._lock_fd, 0, HEADER_BYTES)

    def write(self, offset: int, data: memoryview) -> bool:
        """Copy ``data`` to a placed offset; False (nothing written) when a reader still
        holds those bytes: the output then goes in its frame."""
        if not _try_lock(self._lock_fd, fcntl.F_WRLCK, offset, len(data)):
            return False
        try:
            _write_at(self._lock_fd, data, offset)
        finally:
            _unlock(self._lock_fd, offset, len(data))
        return True


_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, len, pid


def _lock(fd: int, kind: int, start: int, length: int, *, wait: bool) -> None:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))


def _try_lock(fd: int, kind: int, start: int, length: int) -> bool:
    try:
        _lock(fd, kind, start, length, wait=False)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _unlock(fd: int, start: int, length: int) -> None:
    _lock(fd, fcntl.F_UNLCK, start, length, wait=False)


#: The ring's header fields after MAGIC and the key: head, capacity (little-endian u64).
_RING = struct.Struct("<QQ")
_RING_AT = len(MAGIC) + KEY_BYTES


# --------------------------------------------------------------------------- worker side


def _not_a_ring(region: str) -> None:
    """An input is read from a client's region, never from a worker's output ring: every
    client that asks for shared-memory outputs learns a ring's name and key (even one on
    another host, which cannot open it), and could hand them back as an input reference
    to make the worker read other clients' outputs for it."""
    if region.startswith(REGION_PREFIX + RING_TAG):
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
        _lock(fd, fcntl.F_RDLCK, offset, size, wait=True)
        try:
            _lock(fd, fcntl.F_RDLCK, 0, HEADER_BYTES, wait=True)
            try:
                raw = os.pread(fd, _RING.size, _RING_AT)
            finally:
                _unlock(fd, 0, HEADER_BYTES)
            head, capacity = _RING.unpack(raw) if len(raw) == _RING.size else (0, 0)
            if not capacity or offset != HEADER_BYTES + seq % capacity:
                raise ShmError(f"shm region {region!r}: not a ring, or offset and seq differ")
            if head > seq + capacity or seq + size > head:
                raise ShmError(
                    f"shm region {region!r}: the output was written over before it was "
                    "read (read replies sooner, or give the worker a larger ring)"
                )
            self._read(fd, region, offset, dest)
        finally:
            _unlock(fd, offset, size)

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
