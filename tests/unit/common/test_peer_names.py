"""peer_tag: stable within a process, 8 hex digits, and not the routing id in any form."""

from __future__ import annotations

from carpool.common.peer_names import TAG_HEX, peer_tag


def test_a_tag_is_stable_short_and_hides_the_id() -> None:
    ids = [b"\x00" + n.to_bytes(4, "big") for n in range(0x6B8B4567, 0x6B8B4567 + 64)]
    tags = [peer_tag(i) for i in ids]
    assert tags == [peer_tag(i) for i in ids]  # the same peer, the same name
    assert all(len(t) == TAG_HEX and int(t, 16) >= 0 for t in tags)
    assert len(set(tags)) == len(ids)  # neighbouring ids get unrelated tags
    for identity, tag in zip(ids, tags, strict=True):
        assert identity.hex()[-TAG_HEX:] != tag
        assert tag not in identity.hex()
