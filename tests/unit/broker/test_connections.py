"""ConnectionTable: which connection a frontend message came by, and which are open."""

from __future__ import annotations

import zmq

from carpool.broker.frontend import ConnectionTable, connection_number

ACCEPTED, DISCONNECTED = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED)


def test_a_message_from_an_unchanged_descriptor_is_its_open_connections() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    number = table.admit()
    token = table.token(7, number)
    assert token is not None
    assert token in table.alive
    assert table.token(7, number) == token


def test_a_closed_connections_token_is_never_open_again_when_the_descriptor_is_reused() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    old = table.token(7, table.admit())
    table.apply([(DISCONNECTED, 7), (ACCEPTED, 7)])
    new = table.token(7, table.admit())
    assert old is not None
    assert new is not None
    assert new != old
    assert old not in table.alive
    assert new in table.alive


def test_a_message_read_after_its_descriptor_went_to_a_newcomer_is_no_open_connections() -> None:
    """The connection's last message is read after the monitor said that it closed and
    that a newcomer opened on its descriptor: its number tells it from the newcomer's."""
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    first = table.admit()
    table.apply([(DISCONNECTED, 7), (ACCEPTED, 7)])
    assert table.token(7, first) is None
    newcomer = table.token(7, table.admit())
    assert newcomer in table.alive
    assert table.token(7, first) is None  # and still not, once the newcomer has spoken


def test_a_closed_connections_later_messages_are_no_open_connections() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    first = table.admit()
    old = table.token(7, first)
    table.apply([(DISCONNECTED, 7), (ACCEPTED, 7)])
    assert table.token(7, first) is None
    assert old not in table.alive


def test_a_newcomer_numbered_before_it_speaks_gets_its_own_token() -> None:
    """Numbers are given in handshake order: a connection opened before an older one's
    number was given may carry any later number, and keeps the first it carries."""
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7), (ACCEPTED, 8)])
    seven, eight = table.admit(), table.admit()
    on_eight = table.token(8, seven)  # the handshakes ended in the other order
    on_seven = table.token(7, eight)
    assert on_eight is not None
    assert on_seven is not None
    assert on_eight != on_seven
    assert table.token(8, eight) is None  # eight's connection carries seven's number


def test_a_message_from_a_descriptor_with_no_open_connection_is_no_open_connections() -> None:
    table = ConnectionTable()
    table.apply([(DISCONNECTED, 9)])
    assert table.token(9, table.admit()) is None
    assert table.closed_token() not in table.alive
    assert len(table) == 0


def test_an_accept_on_a_descriptor_still_open_closes_the_old_connection() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    old = table.token(7, table.admit())
    table.apply([(ACCEPTED, 7)])
    assert old not in table.alive
    assert len(table) == 1


def test_numbers_order_as_their_strings_do() -> None:
    """The table compares numbers as the strings the door sends."""
    numbers = [connection_number(n) for n in (1, 9, 10, 255, 256, 2**40)]
    assert sorted(numbers) == numbers


def test_a_connection_is_found_by_its_number_while_it_is_open_and_never_after() -> None:
    table = ConnectionTable()
    table.apply([(ACCEPTED, 7)])
    number = table.admit()
    token = table.token(7, number)
    assert table.numbered[number].token == token
    table.apply([(DISCONNECTED, 7)])
    assert table.numbered == {}
