"""listener.py: LinkListener — the broker's listening unix socket that local workers join.

Owns the socket file's life: a lock beside it (``PATH.lock``) so two brokers cannot both
take one path, a stale file replaced, a live one refused, the file's mode and group, and
a spare descriptor to turn a connection away when the process runs out of them. Each
accepted connection becomes a :class:`carpool.common.link.stream.Link`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import os
import socket
import stat

from carpool.common.link.stream import Link

logger = logging.getLogger(__name__)


class LinkListener:
    """A listening unix stream socket that workers on this host connect to.

    A stale socket file (nobody listening: a broker that was killed) is replaced; a live
    one raises ``OSError(EADDRINUSE)``, as a second broker on the same endpoint should.
    Brokers take ``PATH.lock`` (``flock``, released when the process ends) before they
    look, so two started at once cannot both find the file stale and take it from each
    other. The socket file gets ``mode`` (default: owner and group may connect) and, when
    given, ``group`` (this process must belong to it): under systemd's ``DynamicUser=``
    broker and workers have users of their own and share a group to meet here."""

    def __init__(self, path: str, *, mode: int = 0o660, group: str | None = None) -> None:
        self.path = path
        gid = -1 if group is None else grp.getgrnam(group).gr_gid  # KeyError: no such group
        self._lock = _lock(path)
        try:
            self._sock = _listen(path, mode, gid)
        except BaseException:
            if self._lock is not None:
                os.close(self._lock)
            raise
        self._closed = False
        self._ino = os.stat(path).st_ino
        # Kept to be given up when the process runs out of descriptors: a connection left
        # in the backlog keeps the listener readable, and the broker's poll would spin.
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY)

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> list[Link]:
        """The connections waiting, as links."""
        links: list[Link] = []
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return links
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._turn_away(exc)
                return links
            links.append(Link(conn))

    def _turn_away(self, exc: OSError) -> None:
        """Out of descriptors: accept the waiting connection with the spare one and close
        it (the worker sees its link end and tries again later), so the listener is not
        left readable forever."""
        logger.warning("a local worker was turned away: %s", exc)
        if self._spare is None:  # the last turn-away could not take it back: try again
            with contextlib.suppress(OSError):
                self._spare = os.open(os.devnull, os.O_RDONLY)
        if self._spare is None:
            return
        os.close(self._spare)
        self._spare = None
        try:
            conn, _ = self._sock.accept()
            conn.close()
        except OSError:
            pass
        with contextlib.suppress(OSError):
            self._spare = os.open(os.devnull, os.O_RDONLY)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        # Remove the file only if it is still ours (not a later broker's); then let the
        # next broker in. (The lock file stays: removing it would race with one opening it.)
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _lock(path: str) -> int | None:
    """Hold ``PATH.lock`` for this listener's life; EADDRINUSE when a broker holds it. Opened
    read-only (``flock`` needs no more) and made readable by all, so a broker restarted as
    another user (systemd's ``DynamicUser=``) can take a lock file its predecessor left.
    None where the file cannot be opened (one another user made unreadable): the socket
    file's own check is all there is then, as before there was a lock."""
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except PermissionError as exc:
        logger.warning("cannot open %s (%s): starting without the lock", lock, exc.strerror)
        return None
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o644)  # not narrowed by the umask (ours, or another user's: EPERM)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(errno.EADDRINUSE, f"a broker is listening at {path} already") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _listen(path: str, mode: int, gid: int) -> socket.socket:
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    try:
        os.chown(path, -1, gid)
        os.chmod(path, mode)
        sock.listen(64)
    except OSError:
        sock.close()
        os.unlink(path)  # ours: bound a moment ago
        raise
    sock.setblocking(False)
    return sock


def _remove_stale(path: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a stuck listener with a full backlog: EAGAIN, not a hang
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: a stale file
        return
    except BlockingIOError:
        pass  # somebody listens, with a full backlog
    except OSError:
        return  # let bind report it
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"a broker is listening at {path} already")
