"""stream.py: Link — one end of a unix stream socket carrying multipart messages.

The framing (carpool.common.link describes why a link exists). Each side first writes the
8 bytes ``carpool\x01`` (the framing's version; a peer that sends anything else is
closed), then per message::

    <u32 frames n> <u64 data bytes> <u64 length> × n   then the n frames back to back

All little-endian. A sender writes the header and the frames with one ``sendmsg`` (the
payloads are not joined first); a receiver reads small messages into one buffer and a
large one straight into a buffer of its own, and hands frames out as memoryviews of
those (never copied again, never reused).

Non-blocking both ways. ``send`` writes what the kernel takes at once; the rest waits in
the link's queue until the socket is writable (``wants_write``: owners poll for POLLOUT
and call ``flush``). ``send`` refuses a message with :class:`LinkFull` when
``max_queued`` bytes are waiting already, as a ZeroMQ socket at its high-water mark
would. ``receive`` hands out at most ``limit`` messages; whole messages it read past that
stay ``pending`` (the socket may never be readable again: owners must not wait for it).
The end of the stream, a reset or a malformed header marks the link ``closed``: the owner
drops it (a broker treats it as a lost worker, a worker connects again).
"""

from __future__ import annotations

import functools
import logging
import socket
import struct
from collections import deque
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

#: The scheme of a link endpoint: ``unix:/run/carpool/workers.sock``.
SCHEME = "unix:"

_HEAD = struct.Struct("<IQ")  # frames, data bytes
#: What each side writes first: the framing's name and version.
PREAMBLE = b"carpool\x01"
#: Frames a message may have: a batch of 4096 requests with 30 tensors each stays below;
#: more in a header is malformed, and ``send`` refuses them (:class:`TooLarge`).
MAX_FRAMES = 1 << 17
#: Bytes a message may carry (4 GiB): a header that claims more is malformed (it would be
#: allocated before its data arrives), and ``send`` refuses more.
MAX_BYTES = 1 << 32
#: Messages up to this size are read into the shared buffer; larger ones get their own.
SMALL = 64 << 10
# Holds a small message or the largest frame-length table, whichever is larger (~1 MiB).
_BUFFER = max(SMALL, _HEAD.size + 8 * MAX_FRAMES) + (64 << 10)
#: Buffers passed to one sendmsg (IOV_MAX is 1024 on Linux).
_IOV = 512
#: Bytes a link queues for a peer that is not reading before ``send`` refuses.
MAX_QUEUED = 256 << 20


class LinkFull(Exception):
    """The peer is not reading: ``max_queued`` bytes are waiting already."""


class TooLarge(ValueError):
    """A message with more than :data:`MAX_FRAMES` frames or :data:`MAX_BYTES` bytes: not
    sent."""


def link_path(endpoint: str) -> str | None:
    """The socket path of a ``unix:PATH`` endpoint; None for any other (a ZeroMQ one)."""
    if not endpoint.startswith(SCHEME):
        return None
    path = endpoint[len(SCHEME) :]
    if path.startswith("//"):  # unix:///run/x.sock, as in a URL
        path = path[2:]
    if not path:
        raise ValueError(f"no socket path in {endpoint!r}")
    return path


@functools.lru_cache(maxsize=1024)
def _head(n: int) -> struct.Struct:
    """The header of a message of ``n`` frames: n, data bytes, n lengths."""
    return struct.Struct(f"<IQ{n}Q")


@functools.lru_cache(maxsize=1024)
def _lengths(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


def _nbytes(frame: Any) -> int:
    if isinstance(frame, bytes | bytearray):
        return len(frame)
    return memoryview(frame).nbytes


class Link:
    """One end of a connected unix stream socket, carrying multipart messages."""

    def __init__(self, sock: socket.socket, *, max_queued: int = MAX_QUEUED) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self.max_queued = max_queued
        self.closed = False
        self.error: str | None = None  # why it closed, when not the end of the stream
        self._out: deque[Any] = deque()  # buffers not written yet
        self._queued = 0
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)  # never resized: compaction moves bytes in place
        self._lo = 0  # unparsed bytes are _buf[_lo:_hi]
        self._hi = 0
        self._big: bytearray | None = None  # a large message's data, being read
        self._big_have = 0
        self._big_lengths: tuple[int, ...] = ()
        self._greeted = False  # the peer's PREAMBLE has arrived
        # The read side is still open. A send that finds the peer gone closes the link
        # but not this: what the peer wrote before it went is still there (`leftovers`).
        self._reading = True
        self._out.append(PREAMBLE)
        self._queued = len(PREAMBLE)
        self.flush()

    @classmethod
    def connect(cls, path: str, **kwargs: Any) -> Link:
        """Connect to a listening link. Raises OSError when nobody listens at ``path``, and
        BlockingIOError when its backlog is full (a stuck listener): never blocks."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        return cls(sock, **kwargs)

    def fileno(self) -> int:
        return self._fd

    @property
    def wants_write(self) -> bool:
        """Bytes wait to be written: poll the socket for POLLOUT and call :meth:`flush`."""
        return bool(self._out)

    @property
    def pending(self) -> bool:
        """A whole message (or a malformed header) waits in the link's buffer, read from
        the socket before :meth:`receive` stopped at its limit: call it again without
        waiting for the socket to be readable, which it may never be again."""
        big = self._big
        if big is not None:
            return self._big_have == len(big)
        lo = self._lo
        buffered = self._hi - lo
        if not self._greeted:
            return buffered >= len(PREAMBLE)
        if buffered < _HEAD.size:
            return False
        n: int
        size: int
        n, size = _HEAD.unpack_from(self._buf, lo)
        if n > MAX_FRAMES:
            return True  # receive() closes the link
        table = _HEAD.size + 8 * n
        if table + size > SMALL:  # large: receive() moves it to a buffer of its own
            return buffered >= table
        return buffered >= table + size

    # ------------------------------------------------------------------ sending

    def send(self, frames: Sequence[Any]) -> None:
        """Send one message (bytes, memoryviews, zmq.Frames, contiguous arrays). What the
        socket does not take now waits for :meth:`flush`. Raises :class:`LinkFull` when
        over ``max_queued`` bytes wait already (the message is not sent); does nothing
        once closed."""
        if self.closed:
            return
        sizes = [len(f) if type(f) is bytes else _nbytes(f) for f in frames]
        if len(sizes) > MAX_FRAMES:
            raise TooLarge(f"{len(sizes)} frames: a link carries at most {MAX_FRAMES}")
        total = sum(sizes)
        if total > MAX_BYTES:
            raise TooLarge(f"{total} bytes: a link carries at most {MAX_BYTES} a message")
        head = _head(len(sizes)).pack(len(sizes), total, *sizes)
        if self._out:  # a backlog: this message goes behind it, in flush()
            if self._queued > self.max_queued:
                raise LinkFull(f"{self._queued} bytes wait for a peer that is not reading")
            self._out.append(head)
            self._out.extend(frames)
            self._queued += len(head) + total
            return
        bufs = [head, *frames]
        if len(bufs) > _IOV:
            self._out.extend(bufs)
            self._queued += len(head) + total
            self.flush()
            return
        try:
            sent = self._sock.sendmsg(bufs, (), socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:  # EPIPE, ECONNRESET: the peer is gone
            self._close(f"send failed: {exc}")
            return
        if sent == len(head) + total:  # the common case: the kernel took it all
            return
        self._out.extend(bufs)
        self._queued += len(head) + total
        self._sent(sent)

    def flush(self) -> None:
        """Write what is queued, as far as the socket takes it. (A send writes at once,
        not at the end of the loop turn: the reader starts while the writer finishes its
        turn: 3-14% off the fleet's round trip in a probe.)"""
        out = self._out
        while out and not self.closed:
            bufs = [out[i] for i in range(min(len(out), _IOV))]
            try:
                sent = self._sock.sendmsg(bufs, (), socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EPIPE, ECONNRESET: the peer is gone
                self._close(f"send failed: {exc}")
                return
            self._sent(sent)

    def _sent(self, sent: int) -> None:
        """Take ``sent`` written bytes off the front of the queue."""
        out = self._out
        self._queued -= sent
        while sent:
            size = _nbytes(out[0])
            if sent >= size:
                out.popleft()
                sent -= size
            else:
                out[0] = memoryview(out[0]).cast("B")[sent:]
                sent = 0
        while out and _nbytes(out[0]) == 0:  # empty frames: nothing to write
            out.popleft()

    # ------------------------------------------------------------------ receiving

    def receive(self, limit: int = 256) -> list[list[memoryview]]:
        """The messages that have arrived (at most ``limit``), without blocking. Sets
        ``closed`` at the end of the stream, a reset or a malformed header; the messages
        before it are still returned."""
        return self._messages(limit, after_close=False)

    def _messages(self, limit: int, *, after_close: bool) -> list[list[memoryview]]:
        """Whole messages, parsed from the buffer and read from the socket while it
        fills the buffer: until the link closes, or (``after_close``) until its read
        side ends."""
        messages: list[list[memoryview]] = []
        more = True  # the socket may hold more than was read
        while len(messages) < limit:
            message = self._parse()
            if message is not None:
                messages.append(message)
            elif not more or not (self._reading if after_close else not self.closed):
                break
            else:
                more = self._fill()
        return messages

    def _parse(self) -> list[memoryview] | None:
        big = self._big
        if big is not None:
            if self._big_have < len(big):
                return None
            self._big = None
            return _split(memoryview(big), self._big_lengths)
        lo = self._lo
        buffered = self._hi - lo
        if not self._greeted:
            if buffered < len(PREAMBLE):
                return None
            if self._view[lo : lo + len(PREAMBLE)] != PREAMBLE:
                self._end_read("not a carpool link, or another version of its framing")
                return None
            self._greeted = True
            self._lo = lo = lo + len(PREAMBLE)
            buffered -= len(PREAMBLE)
        if buffered < _HEAD.size:
            return None
        n, size = _HEAD.unpack_from(self._buf, lo)
        if n > MAX_FRAMES or size > MAX_BYTES:
            self._end_read(f"malformed header: {n} frames, {size} bytes")
            return None
        table = _HEAD.size + 8 * n
        if buffered < table:
            return None
        lengths = _lengths(n).unpack_from(self._buf, lo + _HEAD.size)
        if sum(lengths) != size:
            self._end_read("malformed header: frame lengths do not add up")
            return None
        start = lo + table
        if table + size <= SMALL:
            if buffered < table + size:
                return None
            self._lo = start + size
            data = self._view[start : start + size].tobytes()  # the buffer is reused
            return _split(memoryview(data), lengths)
        # A large message: its data gets a buffer of its own, read into directly.
        have = min(buffered - table, size)
        try:
            big = bytearray(size)
        except MemoryError:
            self._end_read(f"no memory for a message of {size} bytes")
            return None
        big[:have] = self._view[start : start + have]
        self._lo = start + have
        self._big, self._big_have, self._big_lengths = big, have, lengths
        return self._parse() if have == size else None

    def _fill(self) -> bool:
        """Read what the socket has. True when that filled the space it was read into
        (more may be waiting); False when it did not (the socket was drained: no need to
        ask again before the next poll), nothing came, or the link closed."""
        if self._big is not None:
            target = memoryview(self._big)[self._big_have :]
        else:
            if self._lo == self._hi:
                self._lo = self._hi = 0
            elif self._hi == len(self._buf) or self._lo > len(self._buf) // 2:
                rest = self._hi - self._lo
                self._buf[:rest] = self._buf[self._lo : self._hi]
                self._lo, self._hi = 0, rest
            target = self._view[self._hi :]
        try:
            n = self._sock.recv_into(target)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self._end_read(f"receive failed: {exc}")
            return False
        if n == 0:
            self._end_read(None)
            return False
        if self._big is not None:
            self._big_have += n
        else:
            self._hi += n
        return n == len(target)

    def leftovers(self, limit: int = 1 << 20) -> list[list[memoryview]]:
        """After a send found the peer gone (``closed``, ``error`` says why): the whole
        messages it wrote before it went, read without blocking. A unix socket hands a
        writer's bytes to the reader's side when they are written, so they are all there
        (a broker must not lose a worker's last RESULT to its own next BATCH). Empty
        once the end of the stream was read, or when the link is open."""
        return self._messages(limit, after_close=True) if self.closed else []

    # ------------------------------------------------------------------ lifecycle

    def _close(self, error: str | None) -> None:
        self.closed = True
        self.error = error
        self._out.clear()
        self._queued = 0

    def _end_read(self, error: str | None) -> None:
        """The read side is done: the end of the stream, a reset or a malformed message.
        (After a failed send the link is closed already, and keeps that error.)"""
        self._reading = False
        if not self.closed:
            self._close(error)

    def close(self) -> None:
        self._reading = False
        self._close(self.error)
        self._sock.close()


def _split(data: memoryview, lengths: Sequence[int]) -> list[memoryview]:
    frames = []
    at = 0
    for size in lengths:
        frames.append(data[at : at + size])
        at += size
    return frames
