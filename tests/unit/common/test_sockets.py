"""sockets.py: multipart send/receive on real zmq sockets, direct and through the fallback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from carpool.common import sockets
from carpool.common.sockets import NOBLOCK, readable, recv_frames, send_frames, waiting


@pytest.fixture(params=["direct", "fallback"])
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    if request.param == "fallback":
        monkeypatch.setattr(sockets, "_COMPILED", None)
    else:
        assert sockets.DIRECT, "pyzmq's compiled Socket is not where we expect it"
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://sockets-test")
    b.connect("inproc://sockets-test")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def test_a_multipart_message_arrives_whole_as_frames(pair: Any) -> None:
    a, b = pair
    big = np.arange(100_000, dtype=np.float32)  # above the copy threshold: zero-copy send
    send_frames(a, [b"id", b"", bytearray(b"meta"), memoryview(b"view"), big])
    frames = recv_frames(b)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    assert [f.bytes for f in frames[:4]] == [b"id", b"", b"meta", b"view"]
    np.testing.assert_array_equal(np.frombuffer(frames[4].buffer, np.float32), big)


def test_received_frames_forward_unchanged(pair: Any) -> None:
    a, b = pair
    send_frames(a, [b"one", b"two"])
    send_frames(b, recv_frames(b)[::-1])  # Frame objects sent back as they came
    assert [f.bytes for f in recv_frames(a)] == [b"two", b"one"]


def test_single_frames_and_message_boundaries(pair: Any) -> None:
    a, b = pair
    send_frames(a, [b"x"])
    send_frames(a, [b"y", b"z"])
    assert [f.bytes for f in recv_frames(b)] == [b"x"]
    assert [f.bytes for f in recv_frames(b)] == [b"y", b"z"]


def test_noblock_raises_again_when_nothing_waits(pair: Any) -> None:
    _, b = pair
    with pytest.raises(zmq.Again):
        recv_frames(b, NOBLOCK)


def test_readable_says_whether_a_message_waits(pair: Any) -> None:
    a, b = pair
    assert not readable(b)
    send_frames(a, [b"one", b"two"])
    send_frames(a, [b"three"])
    assert b.poll(1000)
    assert readable(b)
    recv_frames(b, NOBLOCK)
    assert readable(b)  # the second message
    recv_frames(b, NOBLOCK)
    assert not readable(b)


def test_a_mandatory_router_reports_an_unknown_peer() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as router:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, 0)
        with pytest.raises(zmq.ZMQError) as info:
            send_frames(router, [b"nobody", b"hello"], NOBLOCK)
        assert info.value.errno == zmq.EHOSTUNREACH


def test_a_first_frame_goes_before_the_others(pair: Any) -> None:
    a, b = pair
    send_frames(a, [b"two", b"three"], first=b"one")
    send_frames(a, [], first=b"alone")
    assert [f.bytes for f in recv_frames(b)] == [b"one", b"two", b"three"]
    assert [f.bytes for f in recv_frames(b)] == [b"alone"]


def test_waiting_yields_what_waits_up_to_a_limit(pair: Any) -> None:
    a, b = pair
    assert list(waiting(b)) == []
    for i in range(4):
        send_frames(a, [b"m%d" % i, b"x"])
    assert b.poll(1000)
    assert [[f.bytes for f in m] for m in waiting(b, 3)] == [[b"m%d" % i, b"x"] for i in range(3)]
    assert [m[0].bytes for m in waiting(b)] == [b"m3"]  # what the limit left
    assert list(waiting(b)) == []
