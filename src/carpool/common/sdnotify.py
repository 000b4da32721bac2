"""sdnotify.py: systemd's notify protocol — READY, WATCHDOG, STATUS and STOPPING messages.

A message is one datagram of ``NAME=VALUE`` lines sent to the unix socket that systemd
names in ``NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract namespace); the watchdog
interval comes in ``WATCHDOG_USEC``, meant for the process ``WATCHDOG_PID`` names (when
set). Written here rather than taken from python-systemd, which PyPI has as a source
package only (it builds against libsystemd's headers): the protocol is one ``send``.
Without ``NOTIFY_SOCKET`` (not under a ``Type=notify`` unit) every call does nothing.
Never raises: a supervisor that went away must not take the server down.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)


class SdNotifier:
    """The notify socket of this process, if systemd gave it one.

    Args:
        environ: where ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` are read
            (default: the process environment).
        pid: this process's id, compared with ``WATCHDOG_PID`` (default: ``os.getpid()``).
    """

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self._sock: socket.socket | None = None
        self._failed = False
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]  # the abstract namespace
        if address.startswith(("/", "\0")):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(address)
            except OSError as exc:
                sock.close()
                logger.warning("NOTIFY_SOCKET %s: %s; not notifying systemd", address, exc)
            else:
                self._sock = sock
        elif address:  # (vsock: addresses, for VMs; not what a carpool unit gets)
            logger.warning("NOTIFY_SOCKET %s is not a unix socket; not notifying", address)
        #: The watchdog interval systemd expects pings within; None: no watchdog.
        self.watchdog_s = _watchdog_s(env, os.getpid() if pid is None else pid)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: object) -> bool:
        """One message of ``fields`` (``READY=1``, ``STATUS="..."``); False when not sent."""
        sock = self._sock
        if sock is None:
            return False
        text = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            sock.send(text.encode())
        except OSError as exc:
            if not self._failed:  # (once: the next message may well fail the same way)
                self._failed = True
                logger.warning("cannot notify systemd: %s", exc)
            return False
        return True

    def close(self) -> None:
        """Close the socket (``contextlib.closing`` for a ``with``)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_s(env: Mapping[str, str], pid: int) -> float | None:
    """``WATCHDOG_USEC`` in seconds, when it is meant for ``pid`` (sd_watchdog_enabled)."""
    usec, owner = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if owner and owner != str(pid):
        return None  # a parent's watchdog, inherited
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None
