"""joining.py: JoinWindow — which connected peers must say READY by when, and which to let go.

A connection that costs the broker a descriptor and a buffer (a local worker's link) may
stay only while it is a registered worker, or for :data:`JOIN_WITHIN_S` after it
connected (to say READY, or after a refusal). Once the core has registered a peer, the
peer's connection lasts as long as the core knows it: a peer the core forgets (silent
past its liveness, or gone on its own word) is let go, and connects anew if it is still
there. Pure: times are arguments; the transport that owns the connections closes them.
"""

from __future__ import annotations

from collections.abc import Callable

#: How long a connection may stay without its peer registered (READY, or a refusal).
JOIN_WITHIN_S = 10.0


class JoinWindow:
    """Connected peers, by id: those not registered yet (with when they connected), and
    those the core has registered.

    Args:
        within_s: how long a peer may stay connected without being registered.
    """

    def __init__(self, within_s: float = JOIN_WITHIN_S) -> None:
        self.within_s = within_s
        self._unjoined: dict[bytes, float] = {}  # id -> when it connected
        self._joined: set[bytes] = set()

    def connected(self, wid: bytes, now: float) -> None:
        """A peer connected at ``now``: it must be registered within ``within_s``."""
        self._unjoined[wid] = now

    def check(self, wid: bytes, knows: Callable[[bytes], bool]) -> None:
        """After a peer's messages were handled: the first time the core ``knows`` it,
        its deadline ends (asked only until then)."""
        if wid not in self._joined and knows(wid):
            self._joined.add(wid)
            self._unjoined.pop(wid, None)

    def gone(self, wid: bytes) -> None:
        """The peer's connection has closed."""
        self._joined.discard(wid)
        self._unjoined.pop(wid, None)

    def next_due_s(self) -> float | None:
        """When the first unregistered peer's time is up; None when none waits."""
        if not self._unjoined:
            return None
        return min(self._unjoined.values()) + self.within_s

    def late(self, now: float) -> list[bytes]:
        """The peers not registered within ``within_s`` of connecting, as of ``now``."""
        if not self._unjoined:
            return []
        since_s = now - self.within_s
        return [wid for wid, at in self._unjoined.items() if at <= since_s]

    def forgotten(self, knows: Callable[[bytes], bool]) -> list[bytes]:
        """The registered peers that the core (``knows``) no longer knows."""
        if not self._joined:
            return []
        return [wid for wid in self._joined if not knows(wid)]
