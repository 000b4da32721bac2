"""wake.py: WakePipe — lets any thread or a signal handler wake a blocked zmq poll.

A non-blocking os.pipe whose read end a shell registers in its ``zmq.Poller``;
``wake()`` writes a byte (safe from a signal handler), ``clear()`` drains it.
"""

from __future__ import annotations

import contextlib
import os


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()  # poll `fd`
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    @property
    def write_fd(self) -> int:
        """The write end, for ``signal.set_wakeup_fd``: a signal's C handler writes here
        from whichever thread the signal landed on, and the poll watching ``fd`` wakes."""
        return self._write_fd

    def wake(self) -> None:
        # A full or closed pipe means a wake-up is pending or nobody is listening.
        if self._write_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self._write_fd, b"x")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        """Close both ends, once (a second call does nothing: the numbers may belong to
        new descriptors by then)."""
        if self.fd < 0:
            return
        fds, self.fd, self._write_fd = (self.fd, self._write_fd), -1, -1
        for fd in fds:
            os.close(fd)
