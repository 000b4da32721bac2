"""regions.py: shared-memory regions this process makes, and the sweep of orphans.

A region is a file ``/dev/shm/carpool-*``: a header (MAGIC, then a random key, padded to
:data:`HEADER_BYTES`), then tensors. :func:`create_region` makes one, allocated in full
(``posix_fallocate``: a full tmpfs is an error now, not later), never group- or
world-writable, and held with a shared ``flock`` for as long as its maker lives;
:func:`sweep_orphans` removes this user's regions that nobody holds. :class:`OwnedRegion`
is the base of the arena and the ring: the descriptor, and removal when closed. Regions
are written with ``pwrite`` (:func:`write_at`), never through a mapping: a region
truncated under its owner must not be a SIGBUS.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import re
import secrets
import stat
import time

from carpool.common.protocol.refs import (
    KEY_BYTES,
    MAX_OFFSET,
    REGION_HEADER_BYTES,
    REGION_PREFIX,
    valid_region,
)

logger = logging.getLogger(__name__)

#: Where POSIX shared memory lives on Linux (what ``shm_open`` uses).
SHM_DIR = "/dev/shm"
#: Offsets are aligned so that every tensor starts on a cache line (and any dtype's
#: alignment).
ALIGN = 64
#: A region starts with a header: MAGIC, then the region's key (random bytes). A
#: reference must carry the key, so only a client that could read the region (its owner)
#: can make a worker read it: the name alone, visible to anyone in /dev/shm, is not enough.
MAGIC = b"carpool-shm-v1\0\0"
HEADER_BYTES = REGION_HEADER_BYTES  # MAGIC + key, padded to ALIGN; tensors start after it
_PAGE = os.sysconf("SC_PAGE_SIZE")


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


def create_region(
    size: int, mode: int, tag: str, group: str | None = None
) -> tuple[str, str, int, str]:
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
        write_at(fd, memoryview(MAGIC + key), 0)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return name, path, fd, key.hex()


#: A region's name as _create makes it: the maker's pid, then random hex.
_OWNER_RE = re.compile(r"carpool-(?:out-)?(\d{1,10})-[0-9a-f]+")
#: Names of the regions this process made. A region named with this process's pid but
#: not made by it is an orphan: a process restarted in a new pid namespace (a container
#: sharing /dev/shm) may get the pid of the one that crashed; taking that region for its
#: own would leave a region behind at every crash-restart.
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


def write_at(fd: int, data: memoryview, offset: int) -> None:
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
    must not run (a region made by an older carpool holds no lock). A region made in the
    last ``min_age_s`` may not be locked yet: it is left alone. Returns the paths removed.
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
                continue  # its maker runs (an older carpool's region holds no lock)
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


class OwnedRegion:
    """A region this process made: its descriptor, and removal when closed (only by the
    process that made it: a forked child must not remove its parent's region)."""

    def __init__(self, size: int, mode: int, tag: str, group: str | None) -> None:
        self.name, self.path, self.fd, self.key = create_region(size, mode, tag, group)
        self.size = os.fstat(self.fd).st_size
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
        os.close(self.fd)

    def __del__(self) -> None:  # a region never closed is still removed
        if not getattr(self, "closed", True):
            self.close()
