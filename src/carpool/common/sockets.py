"""sockets.py: multipart send and receive without pyzmq's per-frame Python layer.

``Socket.send_multipart`` / ``recv_multipart`` are written in Python over the compiled
``zmq.backend.Socket.send`` / ``recv``: per frame they re-check the buffer, combine enum
flags and ask ``getsockopt(RCVMORE)`` through the option enum; for the small frames of
a request that layer costs more than the send and receive themselves (speed:
docs/benchmarks.md "Why the hot path looks as it does"). These helpers call the compiled
methods directly with plain int flags and read ``Frame.more``, with the same semantics as
``copy=False``: frames arrive as ``zmq.Frame`` (payloads never copied into Python), sends
of ``zmq.Frame`` share the message, small ``bytes`` are copied by libzmq as usual.
Errors are pyzmq's own (``zmq.Again`` for a would-block, ``ZMQError`` otherwise).

If the compiled class is not where pyzmq has kept it (``zmq.backend.Socket``, every
release since 2013), the helpers fall back to the public methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq

SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

_Send = Callable[[Any, Any, int, bool, bool], Any]
_Recv = Callable[[Any, int, bool, bool], zmq.Frame]


_Get = Callable[[Any, int], Any]


def _compiled() -> tuple[_Send, _Recv, _Get] | None:
    backend = getattr(getattr(zmq, "backend", None), "Socket", None)
    send = getattr(backend, "send", None)
    recv = getattr(backend, "recv", None)
    get = getattr(backend, "get", None)
    if (
        backend is None
        or send is None
        or recv is None
        or get is None
        or not issubclass(zmq.Socket, backend)
    ):
        return None
    return send, recv, get


_COMPILED = _compiled()
#: True when the helpers call pyzmq's compiled methods directly (False: the public ones).
DIRECT = _COMPILED is not None


def send_frames(
    sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0, first: Any = None
) -> None:
    """Send ``frames`` as one multipart message (``send_multipart(..., copy=False)``);
    ``first``, if given, goes before them (a ROUTER's routing id: no list to build)."""
    if _COMPILED is None:
        sock.send_multipart(frames if first is None else [first, *frames], flags, copy=False)
        return
    send = _COMPILED[0]
    more = flags | SNDMORE
    last = len(frames) - 1
    if first is not None:
        send(sock, first, more if last >= 0 else flags, False, False)
    for i, frame in enumerate(frames):
        send(sock, frame, more if i < last else flags, False, False)


def recv_frames(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
    """Receive one multipart message as ``zmq.Frame`` objects (``recv_multipart(...,
    copy=False)``); raises ``zmq.Again`` with NOBLOCK when none is waiting."""
    if _COMPILED is None:
        return sock.recv_multipart(flags, copy=False)
    recv = _COMPILED[1]
    frame = recv(sock, flags, False, False)
    frames = [frame]
    while frame.more:
        frame = recv(sock, flags, False, False)
        frames.append(frame)
    return frames


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message is waiting (ZMQ_EVENTS)."""
    events = sock.getsockopt(zmq.EVENTS) if _COMPILED is None else _COMPILED[2](sock, _EVENTS)
    return bool(int(events) & _POLLIN)


def waiting(sock: zmq.Socket[Any], limit: int | None = None) -> Iterator[list[zmq.Frame]]:
    """The messages waiting on ``sock`` (at most ``limit``), received without blocking.

    After the first message it asks ZMQ_EVENTS whether another waits instead of reading
    on until ``zmq.Again``: at low load a drain finds one message. If another waits it
    reads on until ``zmq.Again``, so a busy socket is asked once per drain, not once per
    message. ZMQ_EVENTS is level-triggered: what a drain leaves, the next poll reports.
    Speed: docs/benchmarks.md "Why the hot path looks as it does"."""
    n = 0
    while limit is None or n < limit:
        if n == 1 and not readable(sock):
            return
        try:
            frames = recv_frames(sock, NOBLOCK)
        except zmq.Again:
            return
        n += 1
        yield frames
