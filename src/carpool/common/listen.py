"""listen.py: the HOST:PORT of an HTTP listener (``--metrics``), checked; how often its
serving thread looks for a shutdown.

Pure. A bare ``PORT`` or ``:PORT`` listens on 127.0.0.1: an endpoint reachable from
elsewhere is only ever one the operator named.
"""

from __future__ import annotations

from carpool.common.errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
#: How often an HTTP server's thread looks for its shutdown: how long closing it may wait
#: (``serve_forever``'s default is 0.5 s).
SHUTDOWN_POLL_S = 0.1


def parse_listen(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (an IPv4 address or a name), ``:PORT`` or
    ``PORT`` (port 0: any free one).

    Raises:
        ConfigError: not that form, or a port outside 0..65535.
    """
    text = address.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    host = host or DEFAULT_HOST
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535 or ":" in host:
        raise ConfigError(f"metrics address must be HOST:PORT (port 0..65535), got {address!r}")
    return host, int(port_text)


def listen_problems(address: str) -> list[str]:
    """What is wrong with ``address`` ("" is off: nothing), for a config's validation."""
    if not address:
        return []
    try:
        parse_listen(address)
    except ConfigError as exc:
        return [str(exc)]
    return []
