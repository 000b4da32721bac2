"""peer_names.py: how log lines name a peer without revealing its routing id.

A ROUTER's generated routing ids go up by one per connection, so a log that shows one
lets its reader claim the next ones, and libzmq aborts the process when it generates an
id a peer already took (docs/security.md). No log line carries a routing id, raw or in
hex: it names the peer by :func:`peer_tag`, an HMAC-SHA256 of the id under a key drawn
from the operating system's random source when the process starts (never configured,
never logged), truncated to 8 hex digits. The same peer gets the same tag for the life
of the process, so its lines can still be followed; a tag tells nothing about the id.
"""

from __future__ import annotations

import hmac
import os

__all__ = ["TAG_HEX", "peer_tag"]

#: Hex digits of a tag (32 bits: enough to tell a process's peers apart in its logs).
TAG_HEX = 8
_KEY = os.urandom(32)


def peer_tag(identity: bytes) -> str:
    """The name log lines give the peer whose routing id is ``identity`` (for a client,
    the broker's id for it, which ends in its routing id: one tag for all its lines)."""
    return hmac.digest(_KEY, identity, "sha256")[: TAG_HEX // 2].hex()
