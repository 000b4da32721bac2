"""ConnectionTable: which connection a frontend message came by, and which are open."""

from __future__ import annotations

import zmq

from carpool.broker.frontend import ConnectionTable

ACCEPTED, DISCONNECTED = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED)


def test_a_message_from_an_unchanged_descriptor_is_its_open_connections() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    token = table.token(7, b"a")
    assert token in table.alive
    assert table.token(7, b"a") == token


def test_a_closed_connections_token_is_never_open_again_when_the_descriptor_is_reused() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    old = table.token(7, b"a")
    table.apply([(DISCONNECTED, 7), (ACCEPTED, 7)])
    new = table.token(7, b"a")
    assert new != old
    assert old not in table.alive
    assert new in table.alive


def test_a_message_read_while_its_descriptor_changed_goes_to_the_oldest_that_may_have_sent_it() -> (
    None
):
    """The connection open before said this routing id: the message may be its, so it is
    taken for it (and its reply dropped): a doubtful reply is never misdelivered."""
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    old = table.token(7, b"a")
    touched = table.apply([(DISCONNECTED, 7), (ACCEPTED, 7)])
    assert table.choose(7, b"a", touched[7]) == old
    assert old not in table.alive


def test_a_message_under_another_routing_id_than_the_old_connections_is_the_newcomers() -> None:
    """A connection has one routing id: a message under another came by the newcomer."""
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    table.token(7, b"a")
    touched = table.apply([(DISCONNECTED, 7), (ACCEPTED, 7)])
    new = table.choose(7, b"b", touched[7])
    assert new in table.alive
    assert table.token(7, b"b") == new  # and it now says b"b"


def test_a_message_from_a_connection_that_opened_and_closed_unheard_is_no_open_ones() -> None:
    table = ConnectionTable()
    touched = table.apply([(DISCONNECTED, 9)])
    assert table.choose(9, b"a", touched[9]) not in table.alive
    assert len(table) == 0


def test_an_accept_on_a_descriptor_still_open_closes_the_old_connection() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    old = table.token(7, b"a")
    table.apply([(ACCEPTED, 7)])
    assert old not in table.alive
    assert len(table) == 1
