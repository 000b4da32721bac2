"""link: multipart messages over a unix stream socket, for workers on the broker's host.

A worker on the broker's own host may connect over a plain unix stream socket instead of
ZeroMQ (``carpool broker --local unix:PATH``, ``carpool worker --broker unix:PATH``). The
messages and their frames are the same as on the ZeroMQ backend (docs/protocol.md); only
the transport differs. Why: a ZeroMQ send wakes libzmq's I/O thread, which writes the
socket, and on the other side the I/O thread reads it and wakes the receiving thread.
A link is written and read by the thread that owns it: one wake-up per hop (speed:
docs/benchmarks.md "Why the hot path looks as it does", ``bench/hot_path.py hops``).

Modules: :mod:`~carpool.common.link.stream` (:class:`Link`: the framing, sending and
receiving on one connection) and :mod:`~carpool.common.link.listener`
(:class:`LinkListener`: the broker's listening socket and its file).
"""

from carpool.common.link.listener import LinkListener
from carpool.common.link.stream import (
    MAX_BYTES,
    MAX_FRAMES,
    MAX_QUEUED,
    PREAMBLE,
    SCHEME,
    SMALL,
    Link,
    LinkFull,
    TooLarge,
    link_path,
)

__all__ = [
    "MAX_BYTES",
    "MAX_FRAMES",
    "MAX_QUEUED",
    "PREAMBLE",
    "SCHEME",
    "SMALL",
    "Link",
    "LinkFull",
    "LinkListener",
    "TooLarge",
    "link_path",
]
