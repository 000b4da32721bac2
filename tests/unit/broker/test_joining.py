"""JoinWindow: a connection must register within its window, and lasts while registered."""

from __future__ import annotations

from carpool.broker.joining import JOIN_WITHIN_S, JoinWindow


def test_a_peer_that_does_not_register_in_time_is_late() -> None:
    w = JoinWindow(within_s=10.0)
    assert w.next_due_s() is None
    assert w.late(100.0) == []
    w.connected(b"a", 1.0)
    w.connected(b"b", 3.0)
    assert w.next_due_s() == 11.0
    assert w.late(10.9) == []
    assert w.late(11.0) == [b"a"]
    assert w.late(13.0) == [b"a", b"b"]


def test_a_registered_peer_has_no_deadline_and_is_asked_only_once() -> None:
    w = JoinWindow(within_s=10.0)
    w.connected(b"a", 0.0)
    asked: list[bytes] = []

    def knows(wid: bytes) -> bool:
        asked.append(wid)
        return True

    w.check(b"a", knows)
    w.check(b"a", knows)
    assert asked == [b"a"]
    assert w.next_due_s() is None
    assert w.late(1000.0) == []


def test_a_peer_not_registered_yet_keeps_its_deadline() -> None:
    w = JoinWindow(within_s=10.0)
    w.connected(b"a", 0.0)
    w.check(b"a", lambda wid: False)
    assert w.late(10.0) == [b"a"]


def test_a_registered_peer_the_core_forgot_is_let_go() -> None:
    w = JoinWindow()
    assert w.within_s == JOIN_WITHIN_S
    w.connected(b"a", 0.0)
    w.connected(b"b", 0.0)
    w.check(b"a", lambda wid: True)
    w.check(b"b", lambda wid: True)
    assert w.forgotten(lambda wid: True) == []
    assert w.forgotten(lambda wid: wid != b"b") == [b"b"]


def test_a_closed_connection_is_neither_late_nor_forgotten() -> None:
    w = JoinWindow(within_s=1.0)
    w.connected(b"a", 0.0)
    w.connected(b"b", 0.0)
    w.check(b"b", lambda wid: True)
    w.gone(b"a")
    w.gone(b"b")
    assert w.late(5.0) == []
    assert w.forgotten(lambda wid: False) == []
    assert w.next_due_s() is None
