"""Link: multipart messages over a real unix stream socket pair (no fakes)."""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from carpool.common.link import (
    MAX_BYTES,
    MAX_FRAMES,
    PREAMBLE,
    SMALL,
    Link,
    LinkFull,
    LinkListener,
    TooLarge,
    link_path,
)


@pytest.fixture
def pair() -> Iterator[tuple[Link, Link]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = Link(a), Link(b)
    yield left, right
    left.close()
    right.close()


def pump(sender: Link, receiver: Link, want: int, rounds: int = 10_000) -> list[list[bytes]]:
    """Flush and receive until ``want`` messages have arrived (bounded)."""
    got: list[list[bytes]] = []
    for _ in range(rounds):
        sender.flush()
        got += [[bytes(f) for f in m] for m in receiver.receive()]
        if len(got) >= want:
            return got
    raise AssertionError(f"only {len(got)} of {want} messages arrived")


def test_frames_of_every_kind_arrive_as_sent(pair: tuple[Link, Link]) -> None:
    left, right = pair
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    messages: list[list[object]] = [
        [b"CP\x01\x12", b"meta", array, memoryview(b"view"), zmq.Frame(b"zmq frame")],
        [],  # no frames at all
        [b"", b"", b"x"],  # empty frames
    ]
    for m in messages:
        left.send(m)
    got = pump(left, right, 3)
    assert got[0] == [b"CP\x01\x12", b"meta", array.tobytes(), b"view", b"zmq frame"]
    assert got[1] == []
    assert got[2] == [b"", b"", b"x"]
    assert not left.wants_write
    assert not right.closed


def test_receive_returns_at_most_limit_and_keeps_the_rest(pair: tuple[Link, Link]) -> None:
    left, right = pair
    for i in range(10):
        left.send([b"%d" % i])
    first = right.receive(limit=4)
    rest = right.receive()
    assert [bytes(m[0]) for m in first + rest] == [b"%d" % i for i in range(10)]
    assert len(first) == 4


def test_a_message_split_at_every_byte_is_put_back_together() -> None:
    raw, end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = Link(end)
    frames = [b"head", b"", b"payload" * 3]
    sizes = [len(f) for f in frames]
    head = struct.pack("<IQ", 3, sum(sizes)) + struct.pack("<3Q", *sizes)
    wire = PREAMBLE + head + b"".join(frames)
    got = []
    for i in range(len(wire)):
        raw.sendall(wire[i : i + 1])
        got += link.receive()
        if i < len(wire) - 1:
            assert got == [], f"a message came out after {i + 1} of {len(wire)} bytes"
    assert [[bytes(f) for f in m] for m in got] == [frames]
    raw.close()
    link.close()


def test_a_large_message_gets_a_buffer_of_its_own_and_partial_writes_queue() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):  # small kernel buffers: the sender must queue and resume
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    left, right = Link(a), Link(b)
    rng = np.random.default_rng(3)
    big = rng.integers(0, 255, size=3 << 20, dtype=np.uint8)
    left.send([b"meta", big, b"tail"])
    assert left.wants_write, "3 MiB should not fit a 16 KiB socket buffer at once"
    left.send([b"next"])  # queued behind the first, in order
    got: list[list[memoryview]] = []
    for _ in range(100_000):
        left.flush()
        got += right.receive()
        if len(got) == 2:
            break
    assert len(got) == 2
    meta, payload, tail = got[0]
    assert bytes(meta) == b"meta"
    assert bytes(tail) == b"tail"
    assert np.array_equal(np.frombuffer(payload, dtype=np.uint8), big)
    assert payload.obj is meta.obj, "a large message's frames are views of one buffer"
    assert memoryview(payload.obj).nbytes > SMALL
    assert [bytes(f) for f in got[1]] == [b"next"]
    assert not left.wants_write
    left.close()
    right.close()


def test_more_frames_than_one_sendmsg_takes(pair: tuple[Link, Link]) -> None:
    left, right = pair
    frames = [b"%d" % i for i in range(3000)]  # over the 512 buffers of one sendmsg
    left.send(frames)
    assert pump(left, right, 1) == [frames]


def test_end_of_stream_closes_after_the_messages_before_it(pair: tuple[Link, Link]) -> None:
    left, right = pair
    left.send([b"last words"])
    assert left.receive() == []  # the peer's preamble: a socket closed unread resets
    left.close()
    got = right.receive()
    assert [[bytes(f) for f in m] for m in got] == [[b"last words"]]
    # A read that did not fill the buffer leaves the end for the next receive (the poll
    # reports it readable): the messages before it come first either way.
    assert right.receive() == []
    assert right.closed
    assert right.error is None


_HUGE = 1 << 45  # 32 TiB: allocating it before its data arrives would take the process down


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        (PREAMBLE + struct.pack("<IQ", MAX_FRAMES + 1, 0), "malformed"),  # too many frames
        (PREAMBLE + struct.pack("<IQ2Q", 2, 10, 3, 4), "malformed"),  # lengths do not add up
        (PREAMBLE + struct.pack("<IQQ", 1, _HUGE, _HUGE), "malformed"),  # claims too much
        (b"GET / HTTP/1.1\r\n\r\n", "not a carpool link"),  # not a link at all
    ],
)
def test_a_peer_that_breaks_the_framing_is_closed(wire: bytes, why: str) -> None:
    raw, end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = Link(end)
    raw.sendall(wire + b"\0" * 16)
    assert link.receive() == []
    assert link.closed
    assert link.error is not None
    assert why in link.error
    raw.close()
    link.close()


def test_a_peer_that_does_not_read_gets_link_full() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    left = Link(a, max_queued=1 << 20)
    chunk = b"x" * (256 << 10)
    refused_at = None
    for i in range(100):  # bounded: 25 MiB at most
        try:
            left.send([chunk])
        except LinkFull:
            refused_at = i
            break
    assert refused_at is not None
    assert refused_at >= 3, "a 1 MiB queue takes a few 256 KiB messages before it refuses"
    assert left.wants_write
    assert not left.closed
    left.close()
    b.close()


def test_writing_to_a_closed_peer_closes_the_link(pair: tuple[Link, Link]) -> None:
    left, right = pair
    right.close()
    left.send([b"anyone?"])  # EPIPE, not SIGPIPE
    assert left.closed
    assert left.error is not None
    left.send([b"again"])  # a closed link ignores sends
    assert left.receive() == []


def test_what_a_peer_sent_before_it_went_is_left_over_after_a_failed_send(
    pair: tuple[Link, Link],
) -> None:
    """A worker writes its last RESULT and exits; the broker, not having read it, sends
    it a BATCH (EPIPE). The messages are still in the socket: ``leftovers`` has them."""
    left, right = pair
    assert left.leftovers() == []  # open: nothing is left over
    big = bytes(range(256)) * (SMALL // 128)  # one message larger than the shared buffer
    for frames in ([b"last", b"result"], [big], [b"bye"]):
        right.send(frames)
    assert not right.wants_write
    right.close()
    left.send([b"a batch"])
    assert left.closed
    assert left.error is not None
    assert "send failed" in left.error
    assert left.receive() == []  # closed: receive reads nothing more
    got = [[bytes(f) for f in m] for m in left.leftovers()]
    assert got == [[b"last", b"result"], [big], [b"bye"]]
    assert left.leftovers() == []  # the end of the stream was read
    assert "send failed" in (left.error or "")  # the first reason stays


def test_endpoint_paths() -> None:
    assert link_path("unix:/run/carpool/w.sock") == "/run/carpool/w.sock"
    assert link_path("unix:///run/carpool/w.sock") == "/run/carpool/w.sock"
    assert link_path("unix:rel.sock") == "rel.sock"
    assert link_path("ipc:///tmp/x") is None
    assert link_path("tcp://127.0.0.1:5556") is None
    with pytest.raises(ValueError, match="no socket path"):
        link_path("unix:")


def test_listener_accepts_replaces_a_stale_file_and_refuses_a_live_one(tmp_path: Path) -> None:
    path = str(tmp_path / "w.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file nobody listens on: a killed broker's
    stale.close()
    listener = LinkListener(path)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o660)
    with pytest.raises(OSError, match="listening") as info:
        LinkListener(path)
    assert info.value.errno == errno.EADDRINUSE
    assert listener.accept() == []  # refused by the lock: no probe reached this one
    client = Link.connect(path)
    accepted: list[Link] = []
    for _ in range(1000):
        accepted += listener.accept()
        if accepted:
            break
    assert len(accepted) == 1
    client.send([b"ready"])
    assert pump(client, accepted[0], 1) == [[b"ready"]]
    client.close()
    accepted[0].close()
    listener.close()
    assert not os.path.exists(path)


def test_two_listeners_starting_at_once_cannot_both_take_the_path(tmp_path: Path) -> None:
    """The race the lock closes: broker A has found the file stale and removed it, and
    not yet bound its own; broker B, looking now, must not find the path free."""
    path = str(tmp_path / "w.sock")
    first = LinkListener(path)
    os.unlink(path)  # A's moment between the stale check and bind(), frozen
    with pytest.raises(OSError, match="listening") as info:
        LinkListener(path)
    assert info.value.errno == errno.EADDRINUSE
    first.close()
    assert os.path.exists(path + ".lock")  # stays: removing it would race
    again = LinkListener(path)  # the lock is free once the holder closes (or dies)
    again.close()
    again.close()  # twice is harmless


def test_a_dead_brokers_lock_does_not_hold_the_path(tmp_path: Path) -> None:
    path = str(tmp_path / "w.sock")
    code = (
        "import os, sys\n"
        "from carpool.common.link import LinkListener\n"
        f"LinkListener({path!r})\n"
        "os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", code], timeout=60, check=False)
    assert os.path.exists(path)  # killed: its socket file is left behind, stale
    LinkListener(path).close()


def test_listener_will_not_replace_a_file_that_is_not_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "w.sock"
    path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket") as info:
        LinkListener(str(path))
    assert info.value.errno == errno.EEXIST
    assert path.read_text() == "not a socket"


def test_connect_to_nobody_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Link.connect(str(tmp_path / "nobody.sock"))


def test_messages_read_past_the_limit_are_pending_until_taken(pair: tuple[Link, Link]) -> None:
    """One read can hold more messages than receive() hands out; the socket is then no
    longer readable, so the owner must see them as pending or they wait for the peer's
    next message (or for ever)."""
    left, right = pair
    for i in range(40):
        left.send([b"%d" % i])
    first = right.receive(limit=30)
    assert len(first) == 30
    assert right.pending
    readable, _, _ = select.select([right], [], [], 0)
    assert readable == [], "the socket was drained into the buffer"
    rest = right.receive(limit=30)
    assert [bytes(m[0]) for m in first + rest] == [b"%d" % i for i in range(40)]
    assert not right.pending


def test_frames_handed_out_stay_valid_while_the_buffer_is_reused(pair: tuple[Link, Link]) -> None:
    left, right = pair
    kept: list[memoryview] = []
    expected: list[bytes] = []
    for round_ in range(50):  # enough traffic to wrap and compact the receive buffer
        batch = [bytes([round_]) * (100 + 37 * i) for i in range(30)]
        left.send(batch)
        expected += batch
        for _ in range(100):
            left.flush()
            got = right.receive()
            if got:
                kept += got[0]  # the memoryviews themselves, not copies
                break
    assert [bytes(f) for f in kept] == expected


def test_too_many_frames_are_refused_before_anything_is_sent(pair: tuple[Link, Link]) -> None:
    left, right = pair
    with pytest.raises(TooLarge):
        left.send([b""] * (MAX_FRAMES + 1))
    assert not left.wants_write
    left.send([b"fine"])
    assert pump(left, right, 1) == [[b"fine"]]


@pytest.mark.timeout(20)
def test_a_stuck_listener_neither_hangs_a_connect_nor_a_new_broker(tmp_path: Path) -> None:
    """A listener that never accepts (a stopped broker) fills its backlog: connecting
    must fail at once, and a second broker must see the path as taken, not hang."""
    path = str(tmp_path / "stuck.sock")
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.bind(path)
    stuck.listen(0)
    waiting: list[socket.socket] = []
    try:
        refused = False
        for _ in range(1000):  # bounded; the backlog fills after one or two
            try:
                waiting.append(Link.connect(path)._sock)
            except BlockingIOError:
                refused = True
                break
        assert refused, "connect() should say EAGAIN once the backlog is full"
        with pytest.raises(OSError, match="listening") as info:
            LinkListener(path)
        assert info.value.errno == errno.EADDRINUSE
    finally:
        for s in waiting:
            s.close()
        stuck.close()


def test_a_listener_out_of_descriptors_turns_connections_away(tmp_path: Path) -> None:
    """At the descriptor limit accept() fails and the connection stays in the backlog,
    leaving the listener readable: without the spare descriptor the broker's poll spins.
    Run in a child process, which lowers its own limit."""
    script = f"""
import os, resource, select, socket, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[3] / "src")!r})
from carpool.common.link import Link, LinkListener
listener = LinkListener({str(tmp_path / "w.sock")!r})
client = Link.connect(listener.path)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 1, hard))
hog = []
try:
    while True:
        hog.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print("accepted", len(listener.accept()))
print("readable", bool(select.select([listener], [], [], 0)[0]))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "accepted 0" in result.stdout
    assert "readable False" in result.stdout, result.stdout + result.stderr


def test_messages_over_the_byte_limit_are_refused(pair: tuple[Link, Link]) -> None:
    left, right = pair
    # A view that claims MAX_BYTES + 1 bytes over a one-byte buffer: nothing allocated.
    huge = np.broadcast_to(np.zeros(1, np.uint8), (MAX_BYTES + 1,))
    with pytest.raises(TooLarge):
        left.send([b"x", huge])
    left.send([b"fine"])
    assert pump(left, right, 1) == [[b"fine"]]


def test_the_lock_file_is_readable_by_a_broker_restarted_as_another_user(tmp_path: Path) -> None:
    """Made under the service's umask (UMask=0077), it is still 0644, so a broker
    restarted under another DynamicUser= uid can open it and start."""
    path = str(tmp_path / "w.sock")
    old = os.umask(0o077)
    try:
        listener = LinkListener(path)
    finally:
        os.umask(old)
    listener.close()
    assert os.stat(path + ".lock").st_mode & 0o777 == 0o644
