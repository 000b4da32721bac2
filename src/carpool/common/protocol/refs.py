"""refs.py: shared-memory references on the wire (protocol §5.4, §5.5) — pure.

A tensor whose bytes lie in a shared-memory region travels as an empty frame plus a
reference in its descriptor: ``shm: {region, offset, key}`` for a request input (in a
client's region), the same plus ``seq`` for a reply output (in a worker's ring). This
module holds the reference types, the limits a reference must keep, and their
validation and encoding. It opens no file: :mod:`carpool.common.shm` reads and writes the
regions themselves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from carpool.common.errors import ProtocolError, as_sent

#: Every region's file name starts with this.
REGION_PREFIX = "carpool-"
#: What follows the prefix in the names of workers' output rings (§5.5).
RING_TAG = "out-"
_REGION_RE = re.compile(r"carpool-[A-Za-z0-9_.-]{1,200}")
#: A region starts with a header (magic and key, padded to a cache line); no tensor
#: lies in it.
REGION_HEADER_BYTES = 64
#: Bytes of a region's key; a reference carries it as hex.
KEY_BYTES = 16
_KEY_RE = re.compile(r"[0-9a-f]{32}")
#: The largest offset a reference may carry (and the largest region).
MAX_OFFSET = 2**62
#: The most bytes one referenced tensor may claim: without it, an empty frame could
#: claim any size of a dynamic dim and make a worker allocate it.
MAX_REF_BYTES = 2**31

#: (region, offset, key): where an input's bytes are, and the region's key.
ShmRef = tuple[str, int, str]
#: (region, offset, key, seq): where an output's bytes are in a worker's ring (§5.5).
OutputRef = tuple[str, int, str, int]


def valid_region(name: object) -> bool:
    """Whether ``name`` is a well-formed region name (``carpool-`` and 1..200 safe chars)."""
    return type(name) is str and _REGION_RE.fullmatch(name) is not None


def is_ring(region: str) -> bool:
    """Whether a region name is a worker's output ring's."""
    return region.startswith(REGION_PREFIX + RING_TAG)


def parse_ref(obj: Any, what: str, *, ring_ok: bool = False) -> ShmRef:
    """Validate a request tensor descriptor's ``shm`` map: ``{region: str, offset: uint,
    key: str}`` (§5.4). A worker's output ring is no input: the broker refuses it at the
    door, so a worker written from the document alone is safe too. ``ring_ok``: leave
    that to the caller (a worker answers it per request, §5.4; an output reference names
    a ring)."""
    if type(obj) is not dict:
        raise ProtocolError(f"{what}: 'shm' must be a map with 'region', 'offset' and 'key'")
    region = obj.get("region")
    offset = obj.get("offset")
    key = obj.get("key")
    if not valid_region(region):
        raise ProtocolError(
            f"{what}: shm region must match {REGION_PREFIX}[A-Za-z0-9_.-]{{1,200}}, "
            f"got {as_sent(region)}"
        )
    if type(offset) is not int or not REGION_HEADER_BYTES <= offset <= MAX_OFFSET:
        raise ProtocolError(
            f"{what}: shm offset must be an int in {REGION_HEADER_BYTES}..2**62, "
            f"got {as_sent(offset)}"
        )
    if type(key) is not str or _KEY_RE.fullmatch(key) is None:
        raise ProtocolError(f"{what}: shm key must be {2 * KEY_BYTES} lowercase hex digits")
    assert isinstance(region, str)
    if not ring_ok and is_ring(region):
        raise ProtocolError(f"{what}: shm region {region!r} is a worker's output ring")
    return region, offset, key


def ref_wire(ref: ShmRef) -> dict[str, Any]:
    """The ``shm`` map of an input reference."""
    return {"region": ref[0], "offset": ref[1], "key": ref[2]}


def output_ref_wire(ref: OutputRef) -> dict[str, Any]:
    """The ``shm`` map of an output reference."""
    return {"region": ref[0], "offset": ref[1], "key": ref[2], "seq": ref[3]}


def parse_output_ref(obj: Any, what: str) -> OutputRef:
    """Validate a reply tensor descriptor's ``shm`` map: a request reference plus
    ``seq``, the output's position in the ring's byte stream (§5.5)."""
    region, offset, key = parse_ref(obj, what, ring_ok=True)
    seq = obj.get("seq")
    if type(seq) is not int or not 0 <= seq <= MAX_OFFSET:
        raise ProtocolError(f"{what}: shm seq must be an int in 0..2**62, got {seq!r}")
    return region, offset, key, seq


def shm_refs(descriptors: list[Any]) -> tuple[ShmRef | None, ...] | None:
    """The ``shm`` references of a request's input descriptors (§5.4); None if none has
    one. The descriptors are maps (validated before)."""
    refs: list[ShmRef | None] | None = None
    for i, t in enumerate(descriptors):
        obj = t.get("shm")
        if obj is None:
            continue
        if refs is None:
            refs = [None] * len(descriptors)
        refs[i] = parse_ref(obj, f"tensor {t.get('name')!r}")
    return None if refs is None else tuple(refs)


def shm_wire(refs: Sequence[ShmRef | None]) -> list[dict[str, Any] | None]:
    """BATCH ``requests[i].shm``: one map or nil per input."""
    return [None if r is None else ref_wire(r) for r in refs]


def parse_batch_refs(obj: Any, n_inputs: int) -> tuple[ShmRef | None, ...]:
    """BATCH ``requests[i].shm``, checked: one reference or None per input."""
    if type(obj) is not list or len(obj) != n_inputs:
        raise ProtocolError(f"batch: a request's 'shm' must be a list of {n_inputs} entries")
    return tuple(None if r is None else parse_ref(r, "batch request", ring_ok=True) for r in obj)
